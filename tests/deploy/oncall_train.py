"""One rank of a training run for the on-call tests: the demo's digits MLP with the agent on a
known metrics port. Healthy until NAN_AT_S seconds after start, then a NaN batch; ``persist``
lets the NaN reach the weights (every later step is NaN, as on a real divergence), ``recover``
skips the optimizer step of the NaN_STEPS poisoned batches (the loop guards against NaN) and
trains on. Exits DURATION_S seconds after start.

Usage: python oncall_train.py RUNS_DIR RUN_ID RANK WORLD PORT NAN_AT_S DURATION_S MODE RECIPE SLEEP_S
(MODE persist|recover, RECIPE yes|no, SLEEP_S between steps).
"""

import math
import os
import sys
import time

import torch


def main() -> None:
    runs_dir, run_id, rank, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    nan_at_s, duration_s, mode, recipe = float(sys.argv[6]), float(sys.argv[7]), sys.argv[8], sys.argv[9]
    sleep_s = float(sys.argv[10])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    torch.set_num_threads(1)
    from sentineld.agent import attach
    from sentineld.demo_model import load_digits_tensors, loss_fn, make_recipe

    r = make_recipe("none")
    model, opt = r.model, r.optimizer
    if recipe == "no":
        # A model class only __main__ knows (as in a training script): the replay cannot import
        # it, so no forward-only verdict either; this run gets no verdict at all (no_recipe).
        class ScriptNet(type(model)):  # type: ignore[misc,valid-type]
            pass

        model.__class__ = ScriptNet
    # Without a recipe: no in-process localization either, so no verdict can come (no_recipe).
    kw = (dict(recipe="sentineld.demo_model:make_recipe", recipe_args={"fault": "none"}) if recipe == "yes"
          else {"localize": "off"})
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=port, num_classes=10,
                   flush_s=0.2, **kw)
    assert watch.metrics_port == port, (watch.metrics_port, port)
    xtr, ytr, _, _ = load_digits_tensors()
    g = torch.Generator().manual_seed(10 + rank)
    t0 = time.time()
    poisoned = 0
    while time.time() - t0 < duration_s:
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        x, y = xtr[idx].clone(), ytr[idx]
        poison = time.time() - t0 >= nan_at_s and (mode == "persist" and poisoned == 0
                                                    or mode == "recover" and poisoned < 3)
        if poison:
            x[0, 0] = float("nan")
            poisoned += 1
        opt.zero_grad()
        loss = loss_fn(model, (x, y))
        loss.backward()
        if mode == "persist" or math.isfinite(loss.item()):
            opt.step()
        watch.step(loss, batch=(x, y))
        time.sleep(sleep_s)
    watch.close()


if __name__ == "__main__":
    main()
