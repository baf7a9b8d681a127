"""A reference model of what a reader of pffs may see while other writers change the store (issue 29).

Pure bookkeeping, no I/O: test_mount_model.py drives the real mounts and the SDK, and asks this model
whether each observation is allowed.

Every object's bytes say which version they are: word i (8 bytes) of version `uid` is (uid, i), so any
byte range read names the version(s) it came from, and a mix of two is caught even where the lengths
agree. Sizes differ per version too, so a size seen names the version it belongs to.

Time is what the model knows of staleness. Each name has a history of states (a version, or absent); a
state becomes visible when the change that made it begins, and stops being current when the next change
ends. A view (a mount, the SDK) may show a state at time T if it was current at some moment of
[T - staleness, T], where staleness is what the view's TTLs allow; a view that changed a name itself shows
its own change or a later one (read-your-writes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

WORD = 8


@lru_cache(maxsize=256)
def content(uid: int, size: int) -> bytes:
    words = -(-size // WORD)
    return (np.arange(words, dtype=">u8") + np.uint64(uid << 32)).astype(">u8").tobytes()[:size]


def versions_in(data: bytes, offset: int) -> set[int]:
    """The version uids the words wholly inside data (read at `offset`) claim to be from."""
    skip = -(-offset // WORD) * WORD - offset
    whole = (len(data) - skip) // WORD
    if whole <= 0:
        return set()
    words = np.frombuffer(data, dtype=">u8", count=whole, offset=skip)
    return {int(uid) for uid in np.unique(words >> np.uint64(32))}


@dataclass
class State:
    """One state of a name: a version (uid, size) or absent (uid None)."""

    uid: int | None
    size: int
    visible_from: float  # when the change that made it began
    current_until: float | None = None  # when the change that replaced it ended

    @property
    def present(self) -> bool:
        return self.uid is not None

    def describe(self) -> str:
        return f"v{self.uid} ({self.size} B)" if self.present else "absent"


@dataclass
class Name:
    states: list[State] = field(default_factory=list)

    @property
    def current(self) -> State:
        return self.states[-1]


class Model:
    def __init__(self) -> None:
        self.names: dict[str, Name] = {}
        self.floors: dict[tuple[str, str], int] = {}  # (view, name) -> first state the view may show
        self._next_uid = 1

    def new_uid(self) -> int:
        uid = self._next_uid
        self._next_uid += 1
        return uid

    def add_name(self, name: str, at: float) -> None:
        self.names[name] = Name([State(None, 0, at)])

    def change(self, name: str, uid: int | None, size: int, began: float, ended: float) -> State:
        """`name` now holds version uid (or nothing): the change ran from `began` to `ended`."""
        history = self.names[name]
        history.current.current_until = ended
        state = State(uid, size, began)
        history.states.append(state)
        return state

    def changed_by(self, view: str, name: str) -> None:
        """`view` made the last change of `name`: from now on it shows that change or a later one."""
        self.floors[(view, name)] = len(self.names[name].states) - 1

    def allowed(self, view: str, name: str, began: float, ended: float, staleness: float) -> list[State]:
        """The states a look at `name` through `view` during [began, ended] may show."""
        history = self.names[name].states
        floor = self.floors.get((view, name), 0)
        return [
            s
            for s in history[floor:]
            if s.visible_from <= ended and (s.current_until is None or s.current_until + staleness >= began)
        ]

    def state_of_size(self, states: list[State], size: int) -> State | None:
        return next((s for s in states if s.present and s.size == size), None)

    def is_current(self, name: str, uid: int | None) -> bool:
        return self.names[name].current.uid == uid


def explain(states: list[State]) -> str:
    return ", ".join(s.describe() for s in states) or "nothing"
