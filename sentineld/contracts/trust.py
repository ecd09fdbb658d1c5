"""Whose files may name code that sentineld executes: the trust model, shared by daemon and replay.

sentineld executes code in two places: the daemon starts an interpreter named by a run's
``run.json``, and the replay imports the recipe module named there, plus whatever that module
imports from the run's working directory. A file is *trusted* when it is owned by the current user
(or root) and no one else can write it: not group- or other-writable, and every folder above it
likewise (a folder with the sticky bit, like ``/tmp``, may be writable by others: they cannot
rename or replace what we own in it). Anything else could have been written by another user, and
executing it would run their code as us.

Why each rule (docs/reliability.md, "Trust model", has the whole picture):

- *Every folder on the way*: whoever can write a folder can swap the file in it.
- *Symlinks resolved*: a trusted link to an untrusted interpreter is untrusted; both the link's
  folders and the target's are checked.
- *Modules checked when imported* (:class:`ImportGuard`), not once before: a recipe pulls in other
  modules lazily, and a planted ``numpy.py`` in a world-writable working folder would otherwise
  shadow the real one. Only files under a folder the replay itself put on ``sys.path`` are
  checked; the interpreter's own import path is checked once at start (:func:`check_import_path`).

This module imports no torch, no daemon and no CLI code: both sides import it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Sequence

from .errors import BadInput

__all__ = ["REPLAY_PATH_ENV", "add_replay_path", "module_command", "UntrustedError", "check_owned", "check_chain",
           "untrusted_reason", "check_interpreter", "check_import_path", "ImportGuard", "install_import_guard"]


#: Environment variable by which the daemon hands its ``$PYTHONPATH`` to the replay it starts
#: with ``python -I`` (which ignores ``$PYTHONPATH``); see :func:`add_replay_path`.
REPLAY_PATH_ENV = "SENTINELD_REPLAY_PATH"


def add_replay_path(environ: dict[str, str] | None = None) -> list[str]:
    """Put the entries of :data:`REPLAY_PATH_ENV` on ``sys.path`` as ``$PYTHONPATH`` would (first,
    in order); returns them. The caller checks them with :func:`check_import_path` next."""
    env = os.environ if environ is None else environ
    entries = [e for e in env.get(REPLAY_PATH_ENV, "").split(os.pathsep) if e]
    for e in reversed(entries):
        if e not in sys.path:
            sys.path.insert(0, e)
    return entries


def module_command(module: str) -> list[str]:
    """The command that runs ``module`` as ``python -m module`` would, minus the working directory.

    ``python -m`` puts the working directory first on ``sys.path``: ``cd /tmp && sentineld start``
    started the daemon (as root) with another user's ``/tmp/sentineld/__init__.py`` imported
    instead of ours. This runs the same interpreter with ``-c``, whose ``''`` entry is dropped
    before anything is imported; arguments appended to the list reach ``sys.argv[1:]``.
    """
    boot = ("import sys\n"
            "if sys.path and sys.path[0] == '':\n"
            "    del sys.path[0]  # the working directory: another user may write it\n"
            "import runpy\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    return [sys.executable, "-c", boot]


class UntrustedError(BadInput):
    """A file that would be executed (or that names code) is owned or writable by another user."""


def check_owned(path: Path, *, allow_sticky: bool = True) -> None:
    """Raise :class:`UntrustedError` unless ``path`` is ours (or root's) and writable by no one else.

    Args:
        path: a file or folder (symlinks are not followed: the link itself is judged).
        allow_sticky: a sticky folder writable by others passes (others cannot replace what we
            own in it). False for a folder on ``sys.path``: there others could *add* a module.

    Raises:
        UntrustedError: owned by another user, or group/other-writable; the message says how to
            fix it (``chmod go-w``) or that ``--trust`` overrides.
    """
    st = os.lstat(path)
    me = os.getuid()
    if st.st_uid not in (me, 0):
        raise UntrustedError(f"{path} is owned by uid {st.st_uid}, not by you (uid {me}); sentineld "
                             "would execute code it names. Inspect it, then pass --trust")
    if stat.S_ISLNK(st.st_mode):  # a link's own mode bits mean nothing: judge where it leads
        check_chain(Path(os.path.realpath(path)), leaf_allow_sticky=allow_sticky)
        return
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and allow_sticky
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
        raise UntrustedError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                             f"another user could have changed it. Run `chmod go-w {path}` or pass --trust")


def check_chain(path: Path, *, leaf_allow_sticky: bool = True) -> None:
    """Check ``path`` and every folder above it up to ``/``, then the same for its resolved target.

    Raises:
        UntrustedError: the first file or folder on the way that another user could write.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(os.path.abspath(path))
    for candidate in dict.fromkeys([path, Path(os.path.realpath(path))]):
        check_owned(candidate, allow_sticky=leaf_allow_sticky)
        for parent in candidate.parents:
            check_owned(parent)


def untrusted_reason(paths: Sequence[Path]) -> str | None:
    """The reason the first of ``paths`` is untrusted, or None when all are trusted (or missing).

    A pure check for the daemon's policy: it returns instead of raising so the caller can put the
    reason into the message it sends.
    """
    for p in paths:
        try:
            check_chain(Path(p))
        except FileNotFoundError:
            continue
        except UntrustedError as exc:
            return str(exc)
        except OSError as exc:
            return f"cannot check {p}: {exc}"
    return None


def check_interpreter(python: str) -> None:
    """Raise unless the interpreter file, its target and every folder above both are trusted.

    Raises:
        UntrustedError: the interpreter could have been written by another user.
        FileNotFoundError: it does not exist.
    """
    p = Path(python)
    if not p.is_absolute():
        raise UntrustedError(f"interpreter {python!r} is not an absolute path; refusing to search $PATH for it")
    check_chain(p)


def check_import_path(entries: Sequence[str] | None = None) -> None:
    """Raise unless every existing folder on the import path is trusted with no sticky exemption.

    Called at the start of a replay the daemon started (``python -I``, so neither the working
    folder nor ``$PYTHONPATH`` is on the path): what remains is the interpreter's own library and
    site-packages, where a folder others can write would let them add a module.

    Raises:
        UntrustedError: naming the entry and how to fix it.
    """
    for entry in (sys.path if entries is None else entries):
        if not entry or not os.path.isdir(entry):
            continue  # zip files and missing entries hold nothing anyone can plant now
        p = Path(os.path.abspath(entry))
        try:
            check_owned(p, allow_sticky=False)
            for parent in p.parents:
                check_owned(parent)
        except UntrustedError as exc:
            raise UntrustedError(f"import path entry {entry}: {exc}") from None


class ImportGuard(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that refuses modules another user could have written.

    It asks the ordinary path finder what would be loaded; if that file lies under one of the
    guarded roots (folders sentineld itself put on ``sys.path``: the run's working folder), the
    file, its byte-code cache and the folders up to the root must be trusted, else the import
    raises :class:`UntrustedError` (an ``ImportError`` would be swallowed by ``try: import x``
    fallbacks in user code, so the error is deliberately not one).
    """

    def __init__(self) -> None:
        self.roots: list[Path] = []
        self._lock = threading.Lock()

    def add_root(self, root: Path) -> None:
        """Guard every module loaded from under ``root`` (resolved)."""
        with self._lock:
            r = Path(os.path.realpath(root))
            if r not in self.roots:
                self.roots.append(r)

    def _root_of(self, file: Path) -> Path | None:
        real = Path(os.path.realpath(file))
        for r in self.roots:
            if real == r or r in real.parents:
                return r
        return None

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: object | None = None) -> importlib.machinery.ModuleSpec | None:
        if not self.roots:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        files: list[Path] = []
        if spec.origin and spec.has_location:
            files.append(Path(spec.origin))
            cached = spec.cached or (importlib.util.cache_from_source(spec.origin)
                                     if spec.origin.endswith(".py") else None)
            if cached and os.path.exists(cached):
                files += [Path(cached), Path(cached).parent]
        files += [Path(d) for d in (spec.submodule_search_locations or [])]
        for f in files:
            root = self._root_of(f)
            if root is None:
                continue
            try:
                check_owned(f)
                for parent in Path(os.path.abspath(f)).parents:
                    check_owned(parent)
                    if parent == root:
                        break
            except UntrustedError as exc:
                raise UntrustedError(f"refusing to import {fullname!r} from {f}: {exc}") from None
        return None  # checked: the normal finders (builtins first) load it as they would without us


_GUARD = ImportGuard()


def install_import_guard(root: Path) -> ImportGuard:
    """Guard imports from ``root`` for the rest of this process (idempotent); return the guard."""
    _GUARD.add_root(root)
    if _GUARD not in sys.meta_path:
        sys.meta_path.insert(0, _GUARD)
    return _GUARD
