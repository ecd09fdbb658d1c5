"""The report, end to end and all real: a user's project with a planted bug trains with the agent
while a real daemon watches (alerts, capture, replay), ``sentineld report`` writes the page, and a
real headless Chromium loads it: no console output, every plot drawn, nothing fetched from outside.

Set ``SENTINELD_ARTIFACTS`` to a folder to keep the screenshot there (else it stays in tmp_path).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sentineld.report.page import PLOT_IDS
from tests.conftest import wait_until
from tests.report import planted
from tests.report.chromium import Rendered, chromium, page_problems, render

needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium not installed (scripts/system-deps.sh)")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@needs_chromium
@pytest.mark.slow
def test_report_of_a_watched_run_renders_every_plot_in_chromium(tmp_path: Path, daemon_factory) -> None:
    daemon = daemon_factory()
    project = planted.write_project(tmp_path / "project")
    run = planted.train(project, daemon.runs_dir)
    run_dir = run["run_dir"]
    replays = daemon.state_dir / "replays"
    wait_until(lambda: replays.is_dir() and list(replays.glob("*.json")), 120, "the daemon's replay record")
    wait_until(lambda: any(n.get("kind") == "verdict" for n in _notes(daemon.state_dir)), 30,
               "the verdict notification in the outbox")

    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "sentineld", "report", str(run_dir), "--state-dir",
                           str(daemon.state_dir), "-o", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    html = out.read_text()
    planned = re.search(r'<meta name="sentineld-plots" content="([^"]*)">', html).group(1).split(",")
    assert planned == list(PLOT_IDS)  # this run has data for every plot the page can hold

    shot = Path(os.environ.get("SENTINELD_ARTIFACTS", tmp_path)) / "sentineld-report.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page = render(out, screenshot=shot)
    assert page_problems(page, list(PLOT_IDS)) == []
    assert len(re.findall(r"<svg\b", page.dom)) == len(PLOT_IDS)
    assert _png_size(shot) == (1280, 6000) and shot.stat().st_size > 50_000

    shutil.copy(out, shot.with_suffix(".html"))
    _says_what_happened(page.dom)


def _says_what_happened(dom: str) -> None:
    """The replay's verdict, the daemon's alerts, the capture's snapshot, the recipe's forward."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<svg\b.*?</svg>", "", dom, flags=re.S)))
    text = " ".join(text.split())
    assert "step 7: first non-finite value made in forward, module norm (SampleNorm), op aten.div" in text
    assert re.search(r"<td>alert</td><td>critical</td><td>nonfinite</td><td>7</td>", dom)
    assert re.search(r"<td>verdict</td><td>critical</td><td>replay</td><td>7</td>", dom)
    assert "model tensors of the capture's snapshot (the state before step 5)" in text
    # the incident's own batch on the state before it (issue 22): snapshot 5, steps 5..6 re-executed
    assert "outputs of 6 leaf modules in one forward of the incident step 7's batch, on the state before step 7 " \
        "(snapshot 5 and steps 5..6 re-executed)" in text
    assert "reproduced True (max loss deviation 0 over 2 rebuilt steps)" in text

def _notes(state_dir: Path) -> list[dict]:
    out = []
    for p in list((state_dir / "outbox").glob("*.json")) + list((state_dir / "outbox" / "delivered").glob("*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return out


@needs_chromium
def test_the_check_catches_console_errors_missing_plots_and_outside_references(tmp_path: Path) -> None:
    # Negative control: the check above must be able to fail.
    good_svg = '<svg xmlns="http://www.w3.org/2000/svg"><path d="M0 0L1 1"/></svg>'
    page = tmp_path / "bad.html"
    page.write_text(f'<!DOCTYPE html><html><body><figure class="plot" id="plot-curves">{good_svg}</figure>'
                    '<figure class="plot" id="plot-weights"><p>nothing</p></figure>'
                    '<img src="https://example.invalid/x.png">'
                    '<script>console.error("planted"); notDefined();</script></body></html>')
    problems = page_problems(render(page), ["curves", "weights", "timeline"])
    assert any("planted" in p for p in problems)
    assert any("notDefined is not defined" in p for p in problems)
    assert "plot weights has no drawn SVG" in problems
    assert "plot timeline missing" in problems
    assert any(p.startswith("external reference src='https://example.invalid") for p in problems)


def test_page_problems_is_quiet_on_a_clean_page() -> None:
    r = Rendered('<figure class="plot" id="plot-curves"><svg><clipPath id="p1"/><path clip-path="url(#p1)" '
                 'd="M0 0"/><use xlink:href="#g"/></svg></figure>', [])
    assert page_problems(r, ["curves"]) == []


def test_chromium_is_installed_by_system_deps() -> None:
    text = (Path(__file__).parents[2] / "scripts" / "system-deps.sh").read_text()
    assert "need+=(chromium)" in text
