"""Process-wide exit paths shared by every open Watch: an uncaught exception, SIGTERM and
interpreter exit write the crash capture before the process ends."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any, Protocol

from .agent_config import AgentConfig

__all__ = ["EXITS", "SIGTERM_CAPTURE_TIMEOUT_S", "Closable"]

log = logging.getLogger("sentineld.agent")


#: Seconds the SIGTERM path waits for its capture: schedulers SIGKILL after a grace period
#: (Kubernetes 30 s, Slurm KillWait 30 s), and the process must still die by SIGTERM before that.
SIGTERM_CAPTURE_TIMEOUT_S = 20.0


class Closable(Protocol):
    """What the exit paths need of a watch (:class:`~sentineld.agent.watch.Watch`): its config,
    and the two ways to end it."""

    config: AgentConfig

    def _crash(self, message: str, reason: str, timeout_s: float = ...) -> None: ...

    def close(self, reason: str = ..., timeout_s: float = ...) -> None: ...


class _ExitPaths:
    """Process-wide hooks shared by every open watch (:class:`Closable`): the ways a process ends without
    ``close()`` (an uncaught exception, SIGTERM, interpreter exit) write the crash capture first.

    - ``sys.excepthook``: a ``crash`` capture naming the exception (not for KeyboardInterrupt),
      then the previous hook (which prints the traceback as before).
    - SIGTERM (main thread, unless SIGTERM is ignored): a ``crash`` capture, then the previous
      handler is called, or (default action) the handler is reset and the signal re-sent, so the
      process still dies by SIGTERM with the usual exit status. Further SIGTERMs during the
      capture are held off until it is written.
    - ``atexit``: a watch left open is closed (pending captures are finished, not cut off).

    Each hook is installed once, chains what was there, and is removed when the last watch
    closes if it is still the one in place.
    """

    def __init__(self) -> None:
        self.watches: weakref.WeakSet[Closable] = weakref.WeakSet()
        self.prev_hook: Any = None
        self.prev_term: Any = None
        self.term_installed = False
        self.atexit_registered = False
        self.terminating = False

    def register(self, w: Closable) -> None:
        self.watches.add(w)
        if not self.atexit_registered:
            atexit.register(self._at_exit)
            self.atexit_registered = True
        if w.config.capture_on_crash and sys.excepthook != self._excepthook:
            self.prev_hook, sys.excepthook = sys.excepthook, self._excepthook
        if (w.config.capture_on_sigterm and not self.term_installed
                and threading.current_thread() is threading.main_thread()):
            try:
                prev = signal.getsignal(signal.SIGTERM)
                if prev != signal.SIG_IGN:
                    signal.signal(signal.SIGTERM, self._on_sigterm)
                    self.prev_term, self.term_installed = prev, True
            except (ValueError, OSError) as exc:  # not the main interpreter, or no signals here
                log.debug("sentineld: no SIGTERM handler: %s", exc)

    def unregister(self, w: Closable) -> None:
        self.watches.discard(w)
        if len(self.watches):
            return
        if sys.excepthook == self._excepthook:
            sys.excepthook, self.prev_hook = self.prev_hook or sys.__excepthook__, None
        # While the SIGTERM path runs, its handler stays: close() inside it unregisters the watch
        # before the capture is on disk, and a default handler back in place would let the next
        # SIGTERM kill the process mid-write.
        if self.term_installed and not self.terminating and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self.prev_term if self.prev_term is not None
                                  else signal.SIG_DFL)
                self.term_installed, self.prev_term = False, None
            except (ValueError, OSError):
                pass

    def _crash_all(self, message: str, reason: str, timeout_s: float) -> None:
        for w in list(self.watches):
            try:
                w._crash(message, reason, timeout_s)
            except Exception as exc:  # noqa: BLE001 - never in the way of the process ending
                log.warning("sentineld: crash path failed: %r", exc)

    def _excepthook(self, etype: type[BaseException], value: BaseException, tb: Any) -> None:
        if not issubclass(etype, KeyboardInterrupt):
            self._crash_all(f"{etype.__name__}: {value}", "crashed", 120.0)
        (self.prev_hook or sys.__excepthook__)(etype, value, tb)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.terminating:
            # A second SIGTERM while the first one's capture is written (a scheduler and torchrun
            # both signal the process group, 45-258 ms apart): dying now would cut the capture
            # off. The first call finishes it (bounded by SIGTERM_CAPTURE_TIMEOUT_S) and then dies
            # by the signal, so the process still ends the way it was told to.
            log.warning("sentineld: SIGTERM again while writing the crash capture: finishing it first")
            return
        self.terminating = True
        prev = self.prev_term
        self._crash_all("terminated by SIGTERM (preemption or shutdown)", "terminated",
                        SIGTERM_CAPTURE_TIMEOUT_S)
        if callable(prev):
            prev(signum, frame)
            return
        # Default action: die by the signal, exactly as without the agent.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _at_exit(self) -> None:
        for w in list(self.watches):
            try:
                w.close("finished")
            except Exception:  # noqa: BLE001
                pass


EXITS = _ExitPaths()
