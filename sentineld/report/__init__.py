"""``sentineld report``: one self-contained HTML page about a run (curves, per-layer heatmaps,
weight and activation histograms at the capture, the alert timeline, the replay verdict).

Modules: :mod:`.data` (pure: records to arrays), :mod:`.sources` (reading the run and daemon
dirs), :mod:`.activations` (one forward through the recipe), :mod:`.figures` (matplotlib to SVG),
:mod:`.page` (HTML), :mod:`.command` (the click command).
"""

from .build import default_report_path, write_report

__all__ = ["write_report", "default_report_path"]
