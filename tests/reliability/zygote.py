"""A zygote for crash trials: imports torch and the agent once, then forks one real training
process per trial, so 20+ trials do not pay 20+ torch imports on a 2-core machine.

Protocol (JSON lines): stdin ``{"op": "train", ...spec}`` -> stdout ``{"pid": P}``;
``{"op": "reap", "pid": P}`` -> ``{"pid": P, "status": S}`` (waitpid status: negative = signal).
Children stay zombies until reaped, so the test never signals a recycled pid.

A trial (``train``): an MLP with Adam, ``steps`` steps of random data, a NaN planted in the
input at step ``nan_at`` (-1: none), ``sleep_s`` between steps, the agent attached with the
given settings (``agent``: AgentConfig fields); optionally a SIGTERM handler of the loop's own,
or SIGTERM ignored, before attach. Also usable directly: ``python zygote.py --once SPEC_JSON``
runs one trial as a plain interpreter (for the excepthook and exit tests, where the
interpreter's own shutdown sequence must run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

from sentineld.agent import attach


def make_model(hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    return model, torch.optim.Adam(model.parameters(), 1e-3)


def train(spec: dict) -> None:
    torch.set_num_threads(1)
    if spec.get("user_sigterm_marker"):
        def _user_handler(signum, frame):  # a loop's own graceful-shutdown handler, set before attach
            open(spec["user_sigterm_marker"], "w").close()
            sys.exit(143)

        signal.signal(signal.SIGTERM, _user_handler)
    if spec.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hidden = int(spec.get("hidden", 256))
    model, opt = make_model(hidden)
    recipe = spec.get("recipe")
    watch = attach(model, opt, run_id=spec["run_id"], runs_dir=spec["runs_dir"], metrics_port=0,
                   recipe=recipe, recipe_args={"hidden": hidden} if recipe else None,
                   **spec.get("agent", {}))
    g = torch.Generator().manual_seed(int(spec.get("seed", 1)))
    nan_at, sleep_s = int(spec.get("nan_at", -1)), float(spec.get("sleep_s", 0.0))
    raise_at = int(spec.get("raise_at", -1))
    for step in range(int(spec["steps"])):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        if step == nan_at:
            x[0, 0] = float("nan")
        if step == raise_at:
            raise RuntimeError(f"planted failure at step {step}")
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
        if sleep_s:
            time.sleep(sleep_s)
        if spec.get("marker") and step == int(spec.get("marker_step", 0)):
            open(spec["marker"], "w").close()
    if not spec.get("skip_close"):
        watch.close()


def make_recipe(hidden: int = 256):
    """The trials' model as a replay recipe (``tests.reliability.zygote:make_recipe``)."""
    from sentineld.contracts.recipe import Recipe

    model, opt = make_model(hidden)
    return Recipe(model=model, optimizer=opt, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "train":
            pid = os.fork()
            if pid == 0:
                try:
                    fd = os.open(req.get("log", os.devnull), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    train(req)
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    code = 1
                os._exit(code)
            print(json.dumps({"pid": pid}), flush=True)
        elif req["op"] == "reap":
            _, status = os.waitpid(req["pid"], 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"pid": req["pid"], "status": code}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--once":
        train(json.loads(sys.argv[2]))
    else:
        # Warm what a trial would import lazily, without running any torch op (no thread pool
        # exists yet, so forking stays safe): the optimizer pulls in torch._dynamo (seconds).
        import h5py  # noqa: F401

        import sentineld.agent.diskring  # noqa: F401
        import sentineld.contracts.rng  # noqa: F401

        make_model(8)
        print(json.dumps({"ready": True}), flush=True)
        serve()

