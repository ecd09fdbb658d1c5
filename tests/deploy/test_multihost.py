"""One run on two hosts is one page naming every rank and host (issue 16): two real daemons,
each with its own runs dir, state dir and ``host`` in its config file (two hosts faked on one
machine), each watching the rank that trains on "its" host, both posting to one real
Alertmanager with the shipped routes and templates (Slack to an HTTP sink).

With host-free labels both daemons posted the same alert and Alertmanager kept the annotations
of the last poster: the page named one host and its rank only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from .helpers import Server, free_port, http_json, wait_for
from .test_alertmanager_config import Mailbox
from .test_oncall import TimedSink, _am_config, _train

HOSTS = ("node-a", "node-b")


def _steps(run_dir: Path, rank: int) -> int:
    try:
        return (run_dir / f"stream-rank{rank}.jsonl").read_text().count('"kind":"step"')
    except OSError:
        return 0


@pytest.mark.slow
def test_two_hosts_one_page_naming_every_rank_and_host(
        tmp_path: Path, start_alertmanager: Callable[[Path], Server]) -> None:
    pytest.importorskip("aiosmtpd")
    from tests.conftest import DaemonProc

    slack, mailbox = TimedSink(), Mailbox()
    daemons: list[Any] = []
    procs: list[Any] = []
    poison = tmp_path / "poison"
    try:
        am = start_alertmanager(_am_config(tmp_path, slack.url + "/slack", mailbox.port))
        for rank, host in enumerate(HOSTS):
            runs = tmp_path / f"runs-{host}"
            runs.mkdir()
            config = tmp_path / f"{host}.toml"
            config.write_text(f'host = "{host}"\n')
            daemons.append(DaemonProc(runs, tmp_path / f"state-{host}", [],
                                      ["--alertmanager-url", am.url, "--config", str(config), "--no-replay"]).start())
            procs.append(_train(runs, "mh", rank, 2, free_port(), 0.0, "persist", "yes", tmp_path / f"{host}.log",
                                duration_s=90.0, sleep_s=0.05, env={"ONCALL_POISON_FILE": str(poison)}))
        wait_for(lambda: all(_steps(tmp_path / f"runs-{h}" / "mh", r) >= 5 for r, h in enumerate(HOSTS)), 120,
                 "both ranks to train")
        poison.touch()  # both ranks go non-finite at about the same step
        poisoned_s = time.time()

        def pages() -> list[dict[str, Any]]:
            slack.stamp()
            return [a for r in list(slack.received) for a in r["json"]["attachments"]
                    if a["title"].endswith(" run mh")]

        first = wait_for(pages, 60, "the page of run mh")[0]
        assert first["title"] == "[FIRING:2] SentineldNonfinite run mh", first
        text = first["text"]
        # The first host's alert in full, the second's in one line: both hosts, both ranks.
        assert "rank(s): 0  step:" in text and "host: node-a" in text, text
        assert "also on host node-b: rank(s) 1, step " in text, text
        # the advice ("likely causes" list, or a data fault's one "fix:" line) comes once: the
        # second host's alert does not repeat it
        assert text.count("likely causes") + text.count("\nfix: ") == 1, text
        alerts = http_json(f"{am.url}/api/v2/alerts?filter=run%3D%22mh%22")
        assert sorted((a["labels"]["host"], a["annotations"]["rank"]) for a in alerts) == [("node-a", "0"),
                                                                                           ("node-b", "1")]
        assert {a["labels"]["alertname"] for a in alerts} == {"SentineldNonfinite"}
        assert time.time() - poisoned_s < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for d in daemons:
            d.stop()
        slack.close()
        mailbox.close()
