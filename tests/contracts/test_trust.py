"""The trust rules of sentineld/trust.py on real files and folders (modes set by the test)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sentineld.contracts.verdict import is_verdict
from sentineld.contracts.trust import (UntrustedError, check_chain, check_import_path, check_interpreter, check_owned,
                             install_import_guard, untrusted_reason)


def test_group_or_other_writable_files_are_untrusted(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    f.chmod(0o644)
    check_owned(f)
    for mode in (0o664, 0o646, 0o666):
        f.chmod(mode)
        with pytest.raises(UntrustedError, match="writable by group or others"):
            check_owned(f)


def test_sticky_folder_is_trusted_except_on_the_import_path(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    check_owned(d)  # others cannot replace what we own there
    with pytest.raises(UntrustedError, match="import path entry"):
        check_import_path([str(d)])  # but they can add a module
    d.chmod(0o777)
    with pytest.raises(UntrustedError):
        check_owned(d)


def test_chain_checks_every_folder_and_the_symlink_target(tmp_path):
    bad = tmp_path / "open"
    bad.mkdir()
    bad.chmod(0o777)
    target = bad / "python3"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    link_dir = tmp_path / "bin"
    link_dir.mkdir(mode=0o755)
    (link_dir / "python").symlink_to(target)
    with pytest.raises(UntrustedError, match="open"):
        check_chain(link_dir / "python")
    assert "open" in (untrusted_reason([link_dir / "python"]) or "")
    with pytest.raises(UntrustedError, match="absolute"):
        check_interpreter("python3")
    check_interpreter(os.path.realpath(sys.executable))  # this interpreter is ours (or root's)


def test_import_guard_refuses_a_writable_module_and_allows_ours(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir(mode=0o755)
    good = proj / "sntl_guard_ok.py"
    good.write_text("VALUE = 41\n")
    good.chmod(0o644)
    bad = proj / "sntl_guard_bad.py"
    bad.write_text("raise SystemExit('must never run')\n")
    bad.chmod(0o666)
    monkeypatch.syspath_prepend(str(proj))
    install_import_guard(proj)
    import sntl_guard_ok  # noqa: PLC0415

    assert sntl_guard_ok.VALUE == 41
    with pytest.raises(UntrustedError, match="sntl_guard_bad"):
        import sntl_guard_bad  # noqa: F401, PLC0415


def test_only_a_verdict_of_this_run_is_a_verdict():
    v = {"schema_version": 1, "phase": "forward", "reproduced": True, "run_id": "r1", "step": 7}
    assert is_verdict(v, "r1")
    assert not is_verdict({}, "r1")  # what the planted interpreter printed on d9bb298
    assert not is_verdict(v, "r2")
    assert not is_verdict({**v, "phase": "everything is fine"}, "r1")
    assert not is_verdict({**v, "step": "7"}, "r1")
    assert not is_verdict([v], "r1")
