"""A real training process for the end-to-end tests: the demo's digits MLP in a plain loop with
the agent attached. Usage: python train_digits.py RUNS_DIR RUN_ID FAULT [MAX_STEPS] [SLEEP_S]"""

import sys
import time

import torch

from sentineld.agent import attach
from sentineld.demo_model import load_digits_tensors, loss_fn, make_recipe


def main() -> None:
    runs_dir, run_id, fault = sys.argv[1], sys.argv[2], sys.argv[3]
    max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 60
    sleep_s = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    xtr, ytr, _, _ = load_digits_tensors()
    recipe = make_recipe(fault)
    model, opt = recipe.model, recipe.optimizer
    watch = attach(model, opt, run_id=run_id, runs_dir=runs_dir, metrics_port=0, num_classes=10,
                   recipe="sentineld.demo_model:make_recipe", recipe_args={"fault": fault}, flush_s=0.2)
    g = torch.Generator().manual_seed(1)
    step = 0
    while step < max_steps:
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(xtr) - 63, 64):
            idx = perm[i:i + 64]
            x, y = xtr[idx], ytr[idx]
            opt.zero_grad()
            loss = loss_fn(model, (x, y))
            loss.backward()
            opt.step()
            watch.step(loss, batch=(x, y))
            step += 1
            if sleep_s:
                time.sleep(sleep_s)
            if step >= max_steps:
                break
    watch.close()


if __name__ == "__main__":
    main()
