"""The one safe way to touch a run dir (contracts/safeio.py): no link followed or replaced, no FIFO
opened blocking, O_EXCL temp files, bounded size and JSON depth."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest

from sentineld.contracts.safeio import (
    SafeDir,
    UnsafeDirError,
    json_depth_ok,
    read_json,
    read_regular,
    write_atomic,
)


def test_write_replaces_its_own_file_and_leaves_no_temp(tmp_path: Path) -> None:
    write_atomic(tmp_path / "run.json", "{}")
    write_atomic(tmp_path / "run.json", b'{"a": 1}')
    assert json.loads((tmp_path / "run.json").read_text()) == {"a": 1}
    assert oct((tmp_path / "run.json").stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_planted_temp_name_or_target_link_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.html.tmp").symlink_to(victim)  # the old fixed temp name
    (run / "report.html").symlink_to(victim)
    with pytest.raises(OSError) as exc:
        write_atomic(run / "report.html", "<html>")
    assert exc.value.errno == errno.EEXIST and "replaces only files it wrote" in str(exc.value)
    write_atomic(run / "capture.h5", b"x")  # the planted temp name is no obstacle either
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in run.iterdir()) == ["capture.h5", "report.html", "report.html.tmp"]


def test_no_replace_keeps_an_existing_file(tmp_path: Path) -> None:
    (tmp_path / "c.h5").write_bytes(b"old")
    with SafeDir.open(tmp_path) as d, pytest.raises(FileExistsError):
        d.write("c.h5", b"new", replace=False)
    assert (tmp_path / "c.h5").read_bytes() == b"old" and len(list(tmp_path.iterdir())) == 1


def test_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with SafeDir.open(tmp_path) as d, pytest.raises(RuntimeError):
        with d.create("x.json") as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_reads_refuse_links_fifos_and_big_files_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(b"x" * 100)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    os.mkfifo(tmp_path / "fifo")
    done = threading.Event()

    def reads() -> None:
        with pytest.raises(OSError, match="FIFO"):
            read_regular(tmp_path / "fifo", 10)
        done.set()

    t = threading.Thread(target=reads, daemon=True)
    t.start()
    t.join(5)
    assert done.is_set(), "opening a FIFO blocked"
    with pytest.raises(OSError, match="symbolic link"):
        read_regular(tmp_path / "link", 1000)
    with pytest.raises(OSError, match="limit"):
        read_regular(tmp_path / "big", 99)


def test_directories_are_checked_for_link_owner_and_mode(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    (tmp_path / "l").symlink_to(tmp_path / "d")
    with pytest.raises(UnsafeDirError, match="symbolic link"):
        SafeDir.open(tmp_path / "l")
    with pytest.raises(UnsafeDirError, match="owned by uid"):
        SafeDir.open(tmp_path / "d", owners=(os.geteuid() + 1,))
    (tmp_path / "d").chmod(0o777)
    with pytest.raises(UnsafeDirError, match="writable by group or others"):
        SafeDir.open(tmp_path / "d", private=True)


def test_json_depth_is_checked_before_parsing(tmp_path: Path) -> None:
    assert json_depth_ok('{"a": [[1]], "b": "[[[[[\\\\", "c": "\\"[[[["}', 3)
    assert not json_depth_ok("[[[[]]]]", 3)
    assert json_depth_ok('["]]]]]]]]", [[1]]]', 3)  # brackets in strings do not count
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="nests deeper"):
        read_json(tmp_path / "deep.json", 1 << 20)
