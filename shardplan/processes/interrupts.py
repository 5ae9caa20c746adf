"""Ctrl-C: the first one stops the program, at a moment its work can stop at; the ones after it are
ignored, so pressing it twice never turns a clean stop into tracebacks from half-finished shutdown
(`atexit` callbacks, orbax's writer threads) or a torn checkpoint."""

from __future__ import annotations

import contextlib
import signal
import threading

_deferring = 0
_pending = False


def _on_sigint(signum, frame) -> None:
    global _pending
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _deferring:
        _pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_once():
    """While in it (a CLI's main), Ctrl-C raises KeyboardInterrupt once, and later ones are ignored to the
    end of the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is _on_sigint:  # no Ctrl-C came: leave the process as it was
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """A Ctrl-C inside waits for the block to finish (a checkpoint save completes), then stops the program."""
    global _deferring, _pending
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _pending:
        _pending = False
        raise KeyboardInterrupt
