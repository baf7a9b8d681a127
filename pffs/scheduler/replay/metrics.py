"""The replay's figure of merit: GPU allocation against GPU demand ("alloc at X% arrived").

After every pod event (placed or failed) the replay records ``arrived`` (GPU milli requested by all pods
submitted so far) and ``used`` (GPU milli allocated in the cluster). "Alloc at X%" is the mean allocation
over the events whose arrived demand rounds to X% of capacity; the published curves use X = 0..130.

The arithmetic is the published analysis script's, so that a seed's numbers can be compared to the
published ones to the last digit: percentages as milli / GPUs / 10, arrived rounded half to even, each
event's allocation rounded to 2 decimals before the mean, the mean rounded to 2 decimals, and a level no
event rounds to takes the events within one point of it.
"""

from __future__ import annotations

import numpy as np

from pffs.scheduler.replay.model import MILLI, IntArray


def arrived_percent(arrived: IntArray, capacity_milli: int) -> np.ndarray:
    """Each event's demand in whole percent of capacity."""
    return np.round(arrived / (capacity_milli // MILLI) / 10)


def alloc_percent(used: IntArray, capacity_milli: int) -> np.ndarray:
    """Each event's allocation in percent of capacity, to 2 decimals (Python's rounding, as pandas' apply)."""
    return np.array([round(v, 2) for v in (used / (capacity_milli // MILLI) / 10).tolist()])


def alloc_at(arrived: IntArray, used: IntArray, capacity_milli: int, level: int) -> float | None:
    """Mean allocation (%) over the events whose demand rounds to ``level`` %, None if there are none."""
    return _level(arrived_percent(arrived, capacity_milli), alloc_percent(used, capacity_milli), level)


def alloc_curve(arrived: IntArray, used: IntArray, capacity_milli: int) -> dict[int, float]:
    """``alloc_at`` for every level from 0 to the highest demand reached."""
    demand = arrived_percent(arrived, capacity_milli)
    alloc = alloc_percent(used, capacity_milli)
    top = int(demand.max(initial=-1))
    curve = {}
    for level in range(top + 1):
        value = _level(demand, alloc, level)
        if value is not None:
            curve[level] = value
    return curve


def _level(demand: np.ndarray, alloc: np.ndarray, level: int) -> float | None:
    picked = alloc[demand == level]
    if picked.size == 0:
        picked = alloc[(demand >= level - 1) & (demand <= level + 1)]
    if picked.size == 0:
        return None
    return float(np.round(picked.mean(), 2))
