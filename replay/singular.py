"""Forward ops whose value is finite at a point where their derivative is not, with the words to say so.

The cause *class* (``grad_at_singularity``, ``where_masked_branch``) is decided from evidence in
:mod:`replay.causes`; this table only says, per forward op, where the derivative blows up and how
the user keeps the input away from there, so the fix names the op the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Singular", "SINGULAR", "singular_point"]


@dataclass(frozen=True)
class Singular:
    """``point``: where the derivative is infinite; ``derivative``: its formula; ``fix``: how to stay off it."""

    point: str
    derivative: str
    fix: str


_NORM_FIX = ("add eps before the root (sqrt(sum(x * x) + eps)), or use torch.linalg.vector_norm / "
             "F.normalize, whose gradient at 0 is 0")

#: forward op -> its singular point. Ops not here have no finite-valued singular point worth naming.
SINGULAR: dict[str, Singular] = {
    "aten.sqrt": Singular("x = 0", "d sqrt(x)/dx = 1 / (2 sqrt(x))",
                          "add eps inside the sqrt (sqrt(x + eps)) or clamp it (x.clamp_min(eps)); for a "
                          "norm use torch.linalg.vector_norm / F.normalize, whose gradient at 0 is 0"),
    "aten.rsqrt": Singular("x = 0", "d x^(-1/2)/dx = -x^(-3/2) / 2", "add eps inside (rsqrt(x + eps))"),
    "aten.pow": Singular("base = 0", "d x^p/dx = p x^(p-1) (infinite at 0 for p < 1) and d x^p/dp = "
                         "x^p log(x)", "clamp the base away from 0 (x.clamp_min(eps) ** p), or keep the "
                         "exponent >= 1"),
    "aten.acos": Singular("|x| = 1", "d acos(x)/dx = -1 / sqrt(1 - x^2)",
                          "clamp into the open interval: x.clamp(-1 + eps, 1 - eps) (eps ~1e-6 in float32); "
                          "clamp(-1, 1) still lets x = 1 through"),
    "aten.asin": Singular("|x| = 1", "d asin(x)/dx = 1 / sqrt(1 - x^2)",
                          "clamp into the open interval: x.clamp(-1 + eps, 1 - eps)"),
    "aten.atanh": Singular("|x| = 1", "d atanh(x)/dx = 1 / (1 - x^2)", "clamp into (-1 + eps, 1 - eps)"),
    "aten.acosh": Singular("x = 1", "d acosh(x)/dx = 1 / sqrt(x^2 - 1)", "clamp to x >= 1 + eps"),
    "aten.log": Singular("x = 0", "d log(x)/dx = 1 / x",
                         "add eps inside the log or compute in log space (F.logsigmoid, log_softmax)"),
    "aten.log2": Singular("x = 0", "d log2(x)/dx = 1 / (x ln 2)", "add eps inside the log"),
    "aten.log10": Singular("x = 0", "d log10(x)/dx = 1 / (x ln 10)", "add eps inside the log"),
    "aten.reciprocal": Singular("x = 0", "d (1/x)/dx = -1 / x^2", "add eps to the denominator"),
    "aten.div": Singular("denominator = 0", "d (a/b)/db = -a / b^2", "add eps to the denominator"),
    "aten.linalg_vector_norm": Singular("x = 0", "d ||x||/dx = x / ||x||", _NORM_FIX),
    "aten.norm": Singular("x = 0", "d ||x||/dx = x / ||x||", _NORM_FIX),
    "aten._cdist_forward": Singular("equal points", "d ||a - b||/da = (a - b) / ||a - b||",
                                    "add eps before the root (sqrt(squared distance + eps)) or mask the "
                                    "diagonal before the distance"),
    "aten.xlogy": Singular("y = 0", "d (x log y)/dy = x / y", "clamp y away from 0"),
    "aten.erfinv": Singular("|x| = 1", "d erfinv(x)/dx = sqrt(pi)/2 exp(erfinv(x)^2)",
                            "clamp into (-1 + eps, 1 - eps)"),
}


def singular_point(op: str | None) -> Singular | None:
    """The table entry of forward op ``op`` (``aten.sqrt``), or None."""
    return SINGULAR.get(op) if op else None
