"""PyTorch Lightning: ``Trainer(callbacks=[SentineldCallback()])`` is the only change.

::

    from sentineld.integrations.lightning import SentineldCallback
    trainer = Trainer(callbacks=[SentineldCallback(run_id="exp1")])   # attach()'s keywords
    trainer.fit(model, datamodule)

What the callback takes from the trainer: the LightningModule, its (first) optimizer and that
optimizer's LR scheduler (under manual optimization every optimizer, as one
:class:`~.lightning_state.JointOptimizer`), the GradScaler of ``precision="16-mixed"``,
``accumulate_grad_batches``, ``gradient_clip_val``, the global step (step numbers in the stream
are Lightning's ``global_step`` as ``training_step`` reads it) and, under DDP, one run id for all
ranks (broadcast from rank 0). Unless told ``localize="off"`` (or under DDP or manual
optimization) the training process localizes its own incidents with ``training_step`` as the
loss (:class:`~.lightning_replay.LiveStepLoss`); the daemon replays only if that fails.

Where it hooks in, and why there:

- ``on_train_batch_start`` of the first micro-batch of an optimizer step: snapshot and RNG state,
  the agent's "first training forward of the step" (Lightning calls ``training_step``, not the
  module's ``forward``, so the agent's forward pre-hook would never fire).
- ``training_step`` is wrapped on the instance (restored at teardown) to keep its raw loss:
  Lightning divides ``outputs["loss"]`` by ``accumulate_grad_batches`` before the callbacks see
  it, and the replay compares the raw loss bit for bit.
- ``on_before_optimizer_step``: the global grad norm, before Lightning clips. Lightning runs the
  closure (forward and backward) inside ``optimizer.step``, after the optimizer's step
  pre-hooks, so the agent's own pre-hook would see the previous step's gradients (under
  ``16-mixed`` it runs after the clip: with clipping this value is kept, and ``clipped``
  recorded).
- ``on_train_batch_end`` of the batch that advanced ``global_step``: the step record, with the
  list of micro-batches when accumulating.
- ``on_exception``: the crash capture.

The replay needs no user code when the module called ``save_hyperparameters()``: ``run.json``
names :func:`sentineld.integrations.lightning_replay.recipe_from_run` with the module's class
path and hyperparameters (see that module). Each recorded batch is
``{"batch": <the batch>, "batch_idx": <int>, "global_step": <int>, "current_epoch": <int>}``: what
``training_step`` takes, and the trainer state it reads.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ._common import check_attach_kwargs, json_or_error, log
from .codeload import class_ref
from .lightning_state import micro_state, trainer_settings

__all__ = ["SentineldCallback", "RECIPE"]

#: The built-in recipe a Lightning run names in run.json.
RECIPE = "sentineld.integrations.lightning_replay:recipe_from_run"

_FROM_TRAINER = {"scheduler", "scaler", "accumulation_steps", "clip_grad_norm"}

try:  # either package's Callback: both Trainers accept it (Lightning duck-types callbacks)
    from lightning.pytorch import Callback as _Base
except ImportError:  # pragma: no cover - only the standalone package installed
    from pytorch_lightning import Callback as _Base  # type: ignore[no-redef,assignment]


def _package_of(pl_module: Any) -> str:
    for base in type(pl_module).__mro__:
        if base.__module__.startswith("pytorch_lightning."):
            return "pytorch_lightning"
    return "lightning.pytorch"


def _raw_loss(out: Any) -> Any:
    """The loss ``training_step`` returned: a tensor, or ``out["loss"]`` of a mapping, else None."""
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out.get("loss") if hasattr(out, "get") else None
    return out.detach() if hasattr(out, "detach") else None


def replay_args(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """What :func:`~sentineld.integrations.lightning_replay.recipe_from_run` needs, as JSON."""
    saved = hasattr(pl_module, "_hparams_initial")
    hparams, error = json_or_error(dict(pl_module.hparams_initial) if saved else {},
                                   f"the hyperparameters of {type(pl_module).__name__}",
                                   "pass only JSON values (numbers, strings, lists, dicts) to "
                                   "__init__, or save_hyperparameters(ignore=[...]) the others and "
                                   "give them defaults")
    clip = trainer.gradient_clip_val
    algo = trainer.gradient_clip_algorithm
    return {"lightning": _package_of(pl_module), "module_class": class_ref(type(pl_module)),
            "hparams": hparams, "hparams_saved": saved, "hparams_error": error,
            "precision": str(trainer.precision),
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
            "gradient_clip_val": None if clip is None else float(clip),
            "gradient_clip_algorithm": str(getattr(algo, "value", algo) or "norm"),
            "automatic_optimization": bool(pl_module.automatic_optimization),
            "trainer": trainer_settings(trainer),
            "device": str(pl_module.device), "cwd": os.getcwd()}


class SentineldCallback(_Base):  # type: ignore[misc,valid-type]
    """Watches a Lightning ``fit`` with the sentineld agent.

    Args:
        **attach_kwargs: :func:`sentineld.agent.attach`'s keywords (``run_id``, ``runs_dir``,
            ``recipe``/``recipe_args`` to replay with your own recipe, config fields such as
            ``metrics_port``...). ``scheduler``, ``scaler``, ``accumulation_steps`` and
            ``clip_grad_norm`` come from the trainer.

    Attributes:
        watch: the :class:`sentineld.agent.Watch` while training runs (None before and after a
            failed attach).

    Raises:
        ValueError: an unknown keyword, or one the trainer supplies.
    """

    def __init__(self, **attach_kwargs: Any) -> None:
        check_attach_kwargs(attach_kwargs, _FROM_TRAINER)
        self.attach_kwargs = attach_kwargs
        self.watch: Any = None
        self._micro: list[dict[str, Any]] = []
        self._loss: Any = None
        self._gs0 = 0
        self._k = 1
        self._module: Any = None
        self._warned = False
        self._clip: float | None = None
        self._manual = False
        self._backward: Any = None

    # ------------------------------------------------------------------ attach
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from sentineld.agent import attach  # noqa: PLC0415
        from sentineld.agent.runinfo import default_run_id  # noqa: PLC0415

        from .lightning_state import JointOptimizer  # noqa: PLC0415

        opts = list(trainer.optimizers)
        if not opts:
            log.warning("sentineld: the trainer has no optimizer; nothing to watch")
            return
        self._manual = not pl_module.automatic_optimization
        if len(opts) > 1 and not self._manual:
            log.warning("sentineld: %d optimizers; watching the first only", len(opts))
        # Manual optimization steps every optimizer in training_step: one snapshot holds them all.
        opt = JointOptimizer(opts) if self._manual and len(opts) > 1 else opts[0]
        kw = dict(self.attach_kwargs)
        kw["scheduler"] = next((c.scheduler for c in trainer.lr_scheduler_configs
                                if getattr(c.scheduler, "optimizer", None) is opt), None)
        kw["scaler"] = getattr(trainer.precision_plugin, "scaler", None)
        self._k = kw["accumulation_steps"] = max(1, int(trainer.accumulate_grad_batches))
        clip, algo = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        norm_clip = clip and str(getattr(algo, "value", algo) or "norm") == "norm"
        kw["clip_grad_norm"] = self._clip = float(clip) if norm_clip else None  # in-process replay too
        if "recipe" not in kw:
            try:
                kw["recipe_args"] = replay_args(trainer, pl_module)
                kw["recipe"] = RECIPE
                _warn_unreplayable(kw["recipe_args"], type(pl_module))
            except Exception as exc:  # noqa: BLE001 - never stop the fit for what the replay needs
                log.warning("sentineld: cannot record how to rebuild %s (%r); the replay will need "
                            "--recipe", type(pl_module).__name__, exc)
        if ("loss_fn" not in kw and "recipe" in kw and kw.get("localize") != "off" and not self._manual
                and trainer.world_size == 1):  # a DDP step is the daemon's (every rank's capture)
            # The training process localizes its own incidents (seconds, no framework import in a
            # subprocess); the daemon replays with the recipe only if that fails.
            from .lightning_replay import LiveStepLoss  # noqa: PLC0415

            kw["loss_fn"] = LiveStepLoss(trainer_settings(trainer), str(trainer.precision),
                                         pl_module.device.type)
        if "run_id" not in kw and trainer.world_size > 1:
            kw["run_id"] = trainer.strategy.broadcast(default_run_id(), src=0)
        self.watch = attach(pl_module, opt, **kw)
        # Lightning's global_step, so a resumed fit numbers its steps as Lightning does.
        self.watch.start_at(int(trainer.global_step))
        self._wrap_training_step(pl_module)

    def _wrap_training_step(self, pl_module: Any) -> None:
        original = pl_module.training_step

        @functools.wraps(original)  # __wrapped__: Lightning's is_overridden still sees the user's
        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._backward = None
            out = original(*args, **kwargs)
            loss = _raw_loss(out)
            # Manual optimization often returns nothing: the step's loss is then the last one
            # given to manual_backward (the replay takes the same one).
            self._loss = loss if loss is not None or not self._manual else self._backward
            return out

        pl_module.training_step = training_step
        if self._manual:
            backward = pl_module.manual_backward

            @functools.wraps(backward)
            def manual_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
                self._backward = loss.detach() if hasattr(loss, "detach") else None
                return backward(loss, *args, **kwargs)

            pl_module.manual_backward = manual_backward
        self._module = pl_module

    # ------------------------------------------------------------------- steps
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        w = self.watch
        if w is None or not w.enabled:
            return
        if not self._micro:
            w.begin_step()  # the step starts here: snapshot + RNG (see module doc)
        # With the trainer state training_step reads (the replay gives it back: lightning_state).
        self._micro.append({"batch": batch, "batch_idx": int(batch_idx), **micro_state(trainer)})
        self._gs0 = trainer.global_step

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        w = self.watch
        if w is not None and w.enabled and (optimizer is w.optimizer
                                            or optimizer in getattr(w.optimizer, "optimizers", ())):
            # Fresh gradients, before clipping: with clipping the value is kept for the step
            # (under 16-mixed the optimizer's pre-hook runs after the clip) and `clipped` recorded.
            w.grads_ready(clip_max=self._clip if pl_module.automatic_optimization else None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        w = self.watch
        if w is None or not w.enabled:
            return
        if self._manual:  # every training_step is one step (it steps its optimizers itself)
            self._micro = self._micro[-1:]
        elif trainer.global_step == self._gs0:  # still accumulating
            self._micro = self._micro[-self._k:]
            return
        micro, self._micro = self._micro, []
        loss, self._loss = self._loss, None
        if loss is None:
            if not self._warned:
                self._warned = True
                log.warning("sentineld: training_step returned no loss; steps are not recorded "
                            "(return the loss, or a dict with 'loss')")
            return
        w.step(loss, micro if self._k > 1 else micro[-1])

    # --------------------------------------------------------------- lifetime
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watch is not None:
            self.watch.__exit__(type(exception), exception, exception.__traceback__)  # crash capture
        self._restore()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.watch is not None:
            self.watch.close("finished")
        self._restore()

    def _restore(self) -> None:
        if self._module is not None:
            self._module.__dict__.pop("training_step", None)
            self._module.__dict__.pop("manual_backward", None)
            self._module = None


def _warn_unreplayable(args: dict[str, Any], cls: type) -> None:
    """Say at the start of training, not at the incident, what the replay will be missing."""
    from .lightning_replay import hparams_problem  # noqa: PLC0415

    problem = args.get("hparams_error") or hparams_problem(cls, bool(args.get("hparams_saved")))
    if problem:
        log.warning("sentineld: the replay will not be able to rebuild %s: %s", cls.__name__, problem)
