"""Fork hooks that do not keep their objects alive: a forked child (a DataLoader worker) must not inherit
locks held by threads that no longer exist there, nor work queued for them."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable


def _weak_call(method: Callable[[], object]) -> Callable[[], None]:
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def after_fork_in_child(method: Callable[[], object]) -> None:
    """Calls the bound `method` in every forked child, for as long as its object lives."""
    os.register_at_fork(after_in_child=_weak_call(method))


def at_exit(method: Callable[[], object]) -> None:
    """Calls the bound `method` at interpreter exit if its object still lives."""
    atexit.register(_weak_call(method))
