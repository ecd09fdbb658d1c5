"""What the daemon tells Alertmanager about one incident of a run, beyond the signature alert.

One incident is one page (issue 16): the daemon's signature alert (``SentineldNonfinite``...) is
the page; the replay's verdict and a crash are their own alerts with the same ``run`` label and
the incident's severity, so Alertmanager's ``group_by: [run]`` (deploy/alertmanager) puts them in
the incident's notification group and the on-call sees them as an update of that page, not as a
new page. A replay that cannot run because the run gave no recipe is no news: the incident's own
alert says so from the first notification (annotation ``replay``).

Pure functions; the daemon's :class:`~sentineld.daemon.notifier.Notifier` posts what they build
through :class:`sentineld.daemon.alertmanager.ActiveAlerts`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from sentineld.daemon.alertmanager import Alert, to_am_alert
from sentineld.daemon.replay_runner import ReplayOutcome

__all__ = ["EXTRA_SIGNATURES", "NO_RECIPE", "incident_annotations", "incident_severity", "verdict_alert",
           "crash_alert", "no_recipe_reason", "no_recipe_outcome", "localizes_in_process",
           "replayable_without_recipe", "verdict_may_come"]

#: Signatures of the incident's extra alerts (not detectors): alert names SentineldReplay and
#: SentineldCrashed.
EXTRA_SIGNATURES = ("replay", "crashed")

#: Replay result of a run that gave no recipe: nothing was run, nothing failed.
NO_RECIPE = "no_recipe"

_ORDER = {"critical": 0, "warning": 1, "info": 2}


def no_recipe_reason(run: str) -> str:
    """Why a run's capture was not replayed, and how to replay it by hand."""
    return (f"not run: run {run} gave no recipe (attach(..., recipe=\"module:function\")); "
            f"replay by hand: sentineld replay {run} --recipe module:function")


def localizes_in_process(extra: Any) -> bool:
    """True for a run whose training process localizes its own captures (``attach(loss_fn=)``:
    ``run.json`` ``localize`` not off, :mod:`sentineld.daemon.inprocess`): a verdict comes
    without a recipe."""
    return isinstance(extra, Mapping) and extra.get("localize") not in (None, "off")


def replayable_without_recipe(extra: Any) -> bool:
    """True when a run without a recipe may still get a forward-only replay verdict: its
    ``run.json`` names an importable model class (``extra.model_class``, not ``__main__:...``;
    the same test as replay/forward_replay.py makes before it imports the class)."""
    spec = extra.get("model_class") if isinstance(extra, Mapping) else None
    return isinstance(spec, str) and not spec.startswith("__main__:")


def verdict_may_come(extra: Any) -> bool:
    """A run without a recipe still gets a verdict: in process or forward-only (``run.json`` extra)."""
    return localizes_in_process(extra) or replayable_without_recipe(extra)


def incident_annotations(recipe: str | None, replay_enabled: bool, run: str,
                         in_process: bool = False) -> dict[str, str]:
    """Annotations every daemon alert of a run carries from its first notification.

    Args:
        recipe: the run's recipe (``run.json``), None when it gave none.
        replay_enabled: the daemon replays captures (``--no-replay`` turns it off).
        run: run id.
        in_process: the run localizes in process (:func:`localizes_in_process`) or may get a
            forward-only replay (:func:`replayable_without_recipe`): a verdict may come.

    Returns:
        ``{"replay": why no replay will come}`` for a run whose captures the daemon cannot
        replay, else ``{}``.
    """
    if replay_enabled and recipe is None and not in_process:
        return {"replay": no_recipe_reason(run)}
    return {}


def incident_severity(active: Iterable[Mapping[str, Any]]) -> str:
    """The most severe severity among a run's active signature alerts; ``critical`` if none.

    A verdict or crash without an active signature alert (a crash capture, a replay after a
    restart) pages: a dead training process is worth a page.
    """
    sevs = [a.get("severity", "critical") for a in active]
    return min(sevs, key=lambda s: _ORDER.get(s, 0)) if sevs else "critical"


def verdict_alert(*, run: str, severity: str, title: str, body: str, step: int | None,
                  rank: int | None, host: str, starts_at: float) -> Alert:
    """The replay verdict (localized or not, or why it failed) as alert ``SentineldReplay``.

    Args:
        run: run id (the grouping label: lands in the incident's notification group).
        severity: the incident's severity (:func:`incident_severity`): same route, same group.
        title, body: :func:`sentineld.contracts.verdict.notification_text` or
            :func:`sentineld.daemon.messages.replay_failed_text`.
        step: the replayed step, None if unknown.
        rank: the rank whose capture was replayed, None if unknown.
        host: the daemon's host name.
        starts_at: Unix seconds.
    """
    return to_am_alert(signature="replay", run=run, severity=severity, summary=title,
                       description=body, step=step, ranks=[] if rank is None else [rank],
                       host=host, starts_at=starts_at)


def crash_alert(*, run: str, severity: str, title: str, body: str, step: int | None,
                rank: int | None, host: str, starts_at: float) -> Alert:
    """A training process that ended abnormally, as alert ``SentineldCrashed`` (same group).

    Arguments as for :func:`verdict_alert`; ``step`` is the last completed step, ``rank`` the
    rank whose process died.
    """
    return to_am_alert(signature="crashed", run=run, severity=severity, summary=title,
                       description=body, step=step, ranks=[] if rank is None else [rank],
                       host=host, starts_at=starts_at)


def no_recipe_outcome(run: str, recipe: str | None, outcome: ReplayOutcome,
                      in_process: bool = False) -> ReplayOutcome:
    """A replay that failed only because the run gave no recipe, as result :data:`NO_RECIPE`.

    Not a failure to page about (the incident's alert says so from the start); a damaged capture,
    a refused or timed-out replay, a run that named a recipe, and a run that localizes in process
    (its localization failing is news: no annotation announced it) keep their result.

    Args:
        run: run id.
        recipe: the run's recipe (``run.json``), None when it gave none.
        outcome: what :func:`sentineld.daemon.replay_runner.run_replay_subprocess` or
            :class:`sentineld.daemon.inprocess.InProcessVerdicts` gave.
        in_process: as for :func:`incident_annotations` (then no annotation announced the
            failure, so it is news).
    """
    if (outcome.result == "failed" and recipe is None and not in_process
            and "recipe" in outcome.reason.lower()):
        return ReplayOutcome(NO_RECIPE, None, no_recipe_reason(run), outcome.elapsed_s, outcome.exit_code)
    return outcome
