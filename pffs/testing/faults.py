"""Faults a test puts a server through."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) inside the block, resumed after it even on failure: it keeps its
    sockets, so connections are accepted by the kernel and never answered, as with a black-holed network."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
