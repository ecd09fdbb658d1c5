"""The agent on a GPU, in one short script: no host sync per step, overhead, a capture, a replay.

On a CUDA machine (``python bench/gpu_check.py``, a few minutes on one GPU):

1. **No sync per step.** A CUDA MLP trains under ``torch.cuda.set_sync_debug_mode("error")``,
   first bare (the loop itself is sync-free), then watched by the agent at its defaults with the
   per-layer probes off: any host-device sync the agent adds raises inside it, the agent disables
   itself, and the check fails. With the probes on (defaults), the mode is ``"warn"`` and the
   syncs are counted: the probes read their figures back once per sampled step (every
   ``layer_every`` = 50 steps), never on other steps.
2. **Overhead.** Bare vs watched loop (defaults), same process, blocks alternating; each block
   timed with CUDA events (GPU time) and with the host clock (wall); the median of per-block
   ratios is printed with its 10th-90th percentile.
3. **Capture and replay.** A run whose batch at step 30 holds a NaN writes its ``nonfinite``
   capture (sync debug mode back to default: the capture thread synchronizes, by design);
   ``sentineld replay`` then rebuilds it on the GPU through this file's recipe, in a fresh
   interpreter, timed from start to verdict.

Without CUDA it says so and exits 0. ``--device cpu`` runs the same steps on the CPU (no sync
mode, host clock instead of CUDA events) as a dry run of the script's own logic.

Run from the repository root: ``python bench/gpu_check.py [--device cuda|cpu] [--steps 200]``;
CPU dry run: ``python bench/gpu_check.py --device cpu --width 128 --steps 60 --blocks 4 --block 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sentineld.contracts.recipe import Recipe  # noqa: E402

NAN_STEP = 30


def _net(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(512, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 10))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_recipe(device: str = "cuda", width: int = 2048) -> Recipe:
    """The replay's recipe: the same MLP and Adam as the check's run (seeded, on ``device``)."""
    torch.manual_seed(0)
    model = _net(width).to(device)
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), 1e-4), loss_fn=_loss)


def _batches(device: str, n: int, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(256, 512, generator=g), torch.randint(0, 10, (256,), generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        out.append((x.to(device), y.to(device)))
    return out


def _train(rec: Recipe, batches: list[Any], watch: Any) -> None:
    for b in batches:
        rec.optimizer.zero_grad()
        loss = rec.loss_fn(rec.model, b)
        loss.backward()
        rec.optimizer.step()
        if watch is not None:
            watch.step(loss, batch=b)


class _Timer:
    """GPU time via CUDA events on CUDA, host time otherwise; wall time always (seconds)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Any) -> tuple[float, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, time.perf_counter() - w0
        w0 = time.perf_counter()
        fn()
        w = time.perf_counter() - w0
        return w, w


def check_syncs(device: str, runs: Path, steps: int, width: int) -> dict[str, Any]:
    """Part 1: bare and watched loops under sync debug mode "error"; probes' syncs counted."""
    from sentineld.agent import attach

    out: dict[str, Any] = {}
    rec = make_recipe(device, width)
    batches = _batches(device, steps)
    _train(rec, batches[:5], None)  # warm-up: allocator, cuBLAS handles
    cuda = device == "cuda"
    # Attached before the mode is set: what is checked is the per-step path, not attach.
    w = attach(rec.model, rec.optimizer, run_id="gpu-sync", runs_dir=runs, metrics_port=-1,
               layer_every=0, localize="off")
    w.step(torch.zeros((), device=device))  # a first record outside the mode (pinned pool warm)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        _train(rec, batches, None)
        out["bare_loop_sync_free"] = True
        _train(rec, batches, w)
        out["agent_enabled_after_error_mode"] = w.enabled
        out["steps_recorded"] = w.latest.steps_total
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    w.close()
    w2 = attach(rec.model, rec.optimizer, run_id="gpu-sync-probes", runs_dir=runs, metrics_port=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            _train(rec, batches, w2)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    w2.close()
    syncs = [c for c in caught if "synchroniz" in str(c.message).lower()]
    out["syncs_with_probes"] = len(syncs)
    out["probe_sampled_steps"] = len(range(0, steps, 50))
    out["ok"] = bool(out["agent_enabled_after_error_mode"]) and (not cuda or len(syncs) <= out["probe_sampled_steps"])
    return out


def check_overhead(device: str, runs: Path, blocks: int, block: int, width: int) -> dict[str, Any]:
    """Part 2: bare vs watched, blocks alternating; GPU-time and wall ratios."""
    from sentineld.agent import attach

    bare, watched = make_recipe(device, width), make_recipe(device, width)
    w = attach(watched.model, watched.optimizer, run_id="gpu-overhead", runs_dir=runs, metrics_port=-1)
    batches = _batches(device, block)
    timer = _Timer(device)
    timer(lambda: _train(bare, batches, None))
    timer(lambda: _train(watched, batches, w))
    gpu, wall, bare_ms = [], [], []
    for i in range(blocks):
        order = [("bare", bare, None), ("agent", watched, w)]
        if i % 2:
            order.reverse()
        res = {lab: timer(lambda r=r, wa=wa: _train(r, batches, wa)) for lab, r, wa in order}
        gpu.append(res["agent"][0] / res["bare"][0])
        wall.append(res["agent"][1] / res["bare"][1])
        bare_ms.append(1e3 * res["bare"][1] / block)
    w.close()

    def summary(r: list[float]) -> str:
        q = statistics.quantiles(r, n=10) if len(r) > 1 else [r[0], r[0]]
        return f"{statistics.median(r):.3f}x [{q[0]:.3f}, {q[-1]:.3f}]"

    return {"bare_step_ms": round(statistics.median(bare_ms), 3), "gpu_time_ratio": summary(gpu),
            "wall_ratio": summary(wall), "ok": True}


def check_capture_replay(device: str, runs: Path, width: int) -> dict[str, Any]:
    """Part 3: a NaN batch at NAN_STEP -> capture -> ``sentineld replay`` in a fresh interpreter."""
    from sentineld.agent import attach

    rec = make_recipe(device, width)
    w = attach(rec.model, rec.optimizer, run_id="gpu-capture", runs_dir=runs, metrics_port=-1,
               recipe="bench.gpu_check:make_recipe", recipe_args={"device": device, "width": width},
               localize="off")
    _train(rec, _batches(device, NAN_STEP + 4, nan_at=NAN_STEP), w)
    t0 = time.perf_counter()
    w.close()
    out: dict[str, Any] = {"captures": [p.name for p in w.captures], "close_s": round(time.perf_counter() - t0, 2)}
    if not w.captures:
        out["ok"] = False
        return out
    out["capture_mib"] = round(w.captures[0].stat().st_size / 2**20, 1)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sentineld.replay", str(w.run_dir), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out["replay_s_incl_interpreter"] = round(time.perf_counter() - t0, 2)
    try:
        rep = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out.update(ok=False, replay_rc=proc.returncode, replay_stderr=proc.stderr[-1500:])
        return out
    out["verdict"] = {k: rep.get(k) for k in ("result", "phase", "module", "op", "reproduced", "step")}
    out["ok"] = proc.returncode == 0 and rep.get("step") == NAN_STEP
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--steps", type=int, default=200, help="steps of the sync check")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=30)
    ap.add_argument("--width", type=int, default=2048, help="MLP hidden width (2048: 5.3M parameters)")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "none"
    if device == "none" or (device == "cuda" and not torch.cuda.is_available()):
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing checked. "
              "Run `python bench/gpu_check.py --device cpu` for a dry run of this script on the CPU.")
        return 0
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: no sync mode, host clock)"
    print(f"gpu_check: torch {torch.__version__}, device {name}", flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sentineld-gpu-") as tmp:
        runs = Path(tmp)
        for part, fn in (("sync", lambda: check_syncs(device, runs, args.steps, args.width)),
                         ("overhead", lambda: check_overhead(device, runs, args.blocks, args.block, args.width)),
                         ("capture_replay", lambda: check_capture_replay(device, runs, args.width))):
            t0 = time.perf_counter()
            try:
                results[part] = fn()
            except Exception as exc:  # noqa: BLE001 - report every part, then fail
                results[part] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            results[part]["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"{part}: {json.dumps(results[part])}", flush=True)
    ok = all(r.get("ok") for r in results.values())
    print(f"gpu_check: {'PASS' if ok else 'FAIL'} on {device}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
