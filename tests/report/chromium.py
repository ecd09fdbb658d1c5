"""Open a page in a real headless Chromium (Debian's ``chromium``): the DOM it built, what its
console printed, and a screenshot. ``scripts/system-deps.sh`` installs the browser."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Rendered", "chromium", "render", "page_problems"]


@dataclass(frozen=True)
class Rendered:
    """``dom``: the serialized DOM after load; ``console``: console lines (messages, uncaught errors)."""

    dom: str
    console: list[str]


def chromium() -> str | None:
    """The Chromium binary, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # A fresh profile per run (no state from another test), no network for a file:// page anyway.
    with tempfile.TemporaryDirectory(prefix="sentineld-chromium-") as profile:
        return subprocess.run(
            [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *extra, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120, check=True)


def render(page: Path, screenshot: Path | None = None, size: tuple[int, int] = (1280, 6000)) -> Rendered:
    """Load ``page``; return its DOM and console lines; write a PNG screenshot when asked."""
    out = _run(page, "--dump-dom")
    # Chromium logs every console message and uncaught exception as "INFO:CONSOLE(line)] ...".
    console = [ln for ln in out.stderr.splitlines() if re.search(r":CONSOLE[:(]", ln)]
    if screenshot is not None:
        shot = _run(page, f"--screenshot={screenshot}", f"--window-size={size[0]},{size[1]}",
                    "--hide-scrollbars")
        console += [ln for ln in shot.stderr.splitlines() if re.search(r":CONSOLE[:(]", ln)]
    return Rendered(out.stdout, console)


def page_problems(r: Rendered, expected_plots: list[str]) -> list[str]:
    """What is wrong with a rendered report: console output, missing plots, plots without an SVG,
    references to anything outside the page."""
    problems = [f"console: {ln}" for ln in r.console]
    figures = dict(re.findall(r'<figure class="plot" id="plot-([a-z_]+)">(.*?)</figure>', r.dom, re.S))
    for name in expected_plots:
        body = figures.get(name)
        if body is None:
            problems.append(f"plot {name} missing")
        elif not re.search(r"<svg\b[^>]*>.*<path\b", body, re.S):
            problems.append(f"plot {name} has no drawn SVG")
    extra = sorted(set(figures) - set(expected_plots))
    if extra:
        problems.append(f"unexpected plots {extra}")
    for attr, url in re.findall(r'\b(src|href|xlink:href)="([^"]*)"', r.dom):
        if not url.startswith(("#", "data:")):  # in-page ids and inline images (imshow's raster)
            problems.append(f"external reference {attr}={url!r}")
    if re.search(r"url\((?!#)", r.dom):
        problems.append("external url() in CSS")
    return problems
