"""One rank of a training run for the on-call tests: the demo's digits MLP with the agent on a
known metrics port. Healthy until NAN_AT_S seconds after start, then a NaN batch; ``persist``
lets the NaN reach the weights (every later step is NaN, as on a real divergence), ``recover``
skips the optimizer step of the NaN_STEPS poisoned batches (the loop guards against NaN) and
trains on; ``heal`` poisons every batch (skipping its optimizer step) until the file
``RUNS_DIR/heal-RUN_ID`` exists, so a test decides when the run recovers; ``raise`` raises at
NAN_AT_S instead (a crash: the agent writes a crash capture). With ``$ONCALL_POISON_FILE`` set,
the fault starts once that file exists instead of at NAN_AT_S (ranks of two fake hosts then go
non-finite at the same step). Exits DURATION_S seconds after start.

Usage: python oncall_train.py RUNS_DIR RUN_ID RANK WORLD PORT NAN_AT_S DURATION_S MODE RECIPE SLEEP_S
(MODE persist|recover|heal|raise, RECIPE yes|no, SLEEP_S between steps).
"""

import math
import os
import sys
import time
from pathlib import Path

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
    heal = Path(runs_dir) / f"heal-{run_id}"
    poison_file = Path(os.environ["ONCALL_POISON_FILE"]) if os.environ.get("ONCALL_POISON_FILE") else None
    while time.time() - t0 < duration_s:
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        x, y = xtr[idx].clone(), ytr[idx]
        late = poison_file.exists() if poison_file else time.time() - t0 >= nan_at_s
        if late and mode == "raise":
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (a shape bug in the loop)")
        poison = late and (mode == "persist" and poisoned == 0 or mode == "recover" and poisoned < 3
                           or mode == "heal" and not heal.exists())
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
