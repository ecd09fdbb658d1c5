"""sentineld.replay: rebuild the state before an offending step and name where the first
non-finite value was made (module, op, phase), with the evidence."""

from .engine import ReplayError, find_capture, replay_run
from .report import REPORT_SCHEMA_VERSION, Report, render_text

__all__ = ["replay_run", "find_capture", "ReplayError", "Report", "render_text", "REPORT_SCHEMA_VERSION"]
