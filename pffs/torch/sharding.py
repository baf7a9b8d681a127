"""Which objects each DataLoader worker of each rank reads in an epoch.

Every rank computes the same order (a shuffle seeded with seed + epoch), takes every world_size-th object
from its rank on, and its DataLoader workers split that share the same way. So an epoch reads every object
exactly once across all ranks and workers, and a rank's DataLoader yields its share in the epoch's order.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import random
from typing import Any


def epoch_order(count: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Indexes 0..count-1 in this epoch's order: the same on every rank for the same seed and epoch."""
    order = list(range(count))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def rank_share(order: list[int], rank: int, world_size: int, *, drop_last: bool) -> list[int]:
    """The part of `order` that `rank` reads (its DataLoader workers split it as `share[worker::workers]`);
    with drop_last, the epoch's last objects are left out so that every rank gets as many."""
    if drop_last:
        order = order[: len(order) - len(order) % world_size]
    return order[rank::world_size]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) as given, else torch.distributed's once initialised, else $RANK and $WORLD_SIZE
    (torchrun sets them), else (0, 1)."""
    if (rank is None) != (world_size is None):
        raise ValueError("give both rank and world_size, or neither (then torch.distributed's are used)")
    if rank is None or world_size is None:
        rank, world_size = _rank_of_this_process()
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, not {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be from 0 to world_size - 1 = {world_size - 1}, not {rank}")
    return rank, world_size


def _rank_of_this_process() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return 0, 1
    values = []
    for name in ("RANK", "WORLD_SIZE"):
        raw = os.environ.get(name, "")
        try:
            values.append(int(raw))
        except ValueError:
            raise ValueError(f"${name} is {raw!r} in the environment; it must be an integer") from None
    return values[0], values[1]


class SharedEpoch:
    """The epoch number in shared memory, so that `set_epoch` in the training loop reaches DataLoader
    workers already running (persistent_workers=True keeps the dataset copies they were started with)."""

    def __init__(self) -> None:
        # Raw (no lock): one writer, the training loop, between epochs. Forked workers inherit the mapping;
        # spawned ones get it passed as they start (see __getstate__).
        self._value: Any = multiprocessing.RawValue("q", 0)
        self._plain = 0

    def get(self) -> int:
        return int(self._value.value) if self._value is not None else self._plain

    def set(self, epoch: int) -> None:
        if self._value is not None:
            self._value.value = epoch
        self._plain = epoch

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory can only travel to a process being started (a spawned DataLoader worker); any other
        # pickle (a copy, a dataset saved to disk) carries the number alone.
        if multiprocessing.context.get_spawning_popen() is not None:
            return {"_value": self._value, "_plain": self.get()}
        return {"_value": None, "_plain": self.get()}
