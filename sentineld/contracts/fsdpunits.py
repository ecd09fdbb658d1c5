"""An FSDP2 run's units and their mixed precision, as run.json records them (``extra.fsdp_units``).

``fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...))`` makes the
unit compute in ``param_dtype`` (its parameters cast before the all-gather, its floating-point
inputs cast at its forward when ``cast_forward_inputs``), reduce-scatter its gradients in
``reduce_dtype`` and cast its outputs to ``output_dtype``. A replay that runs the model in the
parameters' own dtype (float32) computes other losses, so the agent records, for every module
that is an FSDP unit, its qualified name ("" for the root) and its policy
(:func:`record_units`, agent side), and the replay reads them back (:func:`read_units`): the
relaunch at the recorded world size (:mod:`sentineld.replay.fsdp_relaunch`) shards the recipe's
model into the same units with the same policies; the consolidated replay says the losses it
rebuilds in the parameters' dtype are not the run's, and how to get them.

run.json is another user's file to the daemon: :func:`read_units` accepts only the shape written
here, dtypes from :data:`DTYPES`, and raises :class:`~sentineld.contracts.errors.BadInput` naming
what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadInput

__all__ = ["UNITS_KEY", "DTYPES", "Unit", "record_units", "read_units", "mixed_units"]

#: run.json ``extra`` key of the recorded units.
UNITS_KEY = "fsdp_units"

#: Dtype names a recorded policy may hold (``torch.<name>``); anything else is refused.
DTYPES = ("float64", "float32", "bfloat16", "float16")

_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: ``module`` (qualified name, "" for the root) and its mixed-precision policy
    (dtype names from :data:`DTYPES` or None: the parameter's own dtype)."""

    module: str
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    cast_forward_inputs: bool = True

    @property
    def mixed(self) -> bool:
        """True when the policy computes or reduces in a dtype other than the parameters'."""
        return any(getattr(self, f) is not None for f in _FIELDS)

    def policy(self) -> Any:
        """This unit's ``torch.distributed.fsdp.MixedPrecisionPolicy``."""
        import torch  # noqa: PLC0415
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415

        def dt(name: str | None) -> Any:
            return None if name is None else getattr(torch, name)

        return MixedPrecisionPolicy(param_dtype=dt(self.param_dtype), reduce_dtype=dt(self.reduce_dtype),
                                    output_dtype=dt(self.output_dtype), cast_forward_inputs=self.cast_forward_inputs)

    def to_json(self) -> dict[str, Any]:
        """The run.json form (a JSON object of the fields)."""
        return {"module": self.module, "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                "output_dtype": self.output_dtype, "cast_forward_inputs": self.cast_forward_inputs}


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def record_units(model: Any) -> list[dict[str, Any]]:
    """The FSDP units of ``model`` (an ``nn.Module`` after ``fully_shard``), pre-order, as JSON objects.

    A module is a unit when it is an ``FSDPModule``; its policy is read from its FSDP state
    (``_get_fsdp_state()._mp_policy``, torch 2.6-2.13: a private attribute, so a torch without it
    records the unit with no policy). Empty for a model that is not ``fully_shard``-ed.
    """
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:  # a torch built without distributed
        return []
    out: list[dict[str, Any]] = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            mp = m._get_fsdp_state()._mp_policy
        except AttributeError:
            mp = None
        p, r, o = (_dtype_name(getattr(mp, f, None)) for f in _FIELDS)
        out.append(Unit(name, p, r, o, bool(getattr(mp, "cast_forward_inputs", True))).to_json())
    return out


def read_units(extra: dict[str, Any], where: str = "run.json") -> list[Unit] | None:
    """The recorded units of a run's ``extra`` (None when not recorded: an unsharded run, or one
    recorded before the units were).

    Raises:
        BadInput: ``extra.fsdp_units`` is not a list of objects of the recorded shape (a module
            name, dtypes from :data:`DTYPES` or null, a boolean ``cast_forward_inputs``).
    """
    raw = extra.get(UNITS_KEY)
    if raw is None:
        return None

    def bad(what: str) -> BadInput:
        return BadInput(f"{where}: extra.{UNITS_KEY} {what}; the agent writes a list of "
                        '{"module": name, "param_dtype": ..., "reduce_dtype": ..., "output_dtype": ..., '
                        f'"cast_forward_inputs": bool}} with dtypes in {list(DTYPES)} or null: '
                        "rewrite it so, or delete the key to replay without the run's units")

    if not isinstance(raw, list):
        raise bad(f"is a {type(raw).__name__}, not a list")
    units: list[Unit] = []
    for i, u in enumerate(raw):
        if not isinstance(u, dict) or not isinstance(u.get("module"), str):
            raise bad(f"[{i}] is not an object with a string module")
        for f in _FIELDS:
            if u.get(f) is not None and u.get(f) not in DTYPES:
                raise bad(f"[{i}].{f} is {u.get(f)!r}")
        cast = u.get("cast_forward_inputs", True)
        if not isinstance(cast, bool):
            raise bad(f"[{i}].cast_forward_inputs is {cast!r}, not a boolean")
        units.append(Unit(u["module"], u.get("param_dtype"), u.get("reduce_dtype"), u.get("output_dtype"), cast))
    return units


def mixed_units(units: list[Unit] | None) -> list[Unit]:
    """The units whose policy is mixed precision (:attr:`Unit.mixed`); empty for None."""
    return [u for u in units or [] if u.mixed]
