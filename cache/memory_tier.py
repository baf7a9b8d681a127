"""The memory tier: blocks kept in RAM, bounded by total bytes, least recently used evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict

from .stats import CacheStats


class MemoryTier:
    def __init__(self, capacity_bytes: int, stats: CacheStats) -> None:
        self.capacity_bytes = capacity_bytes
        self.stats = stats
        self._blocks: OrderedDict[str, bytes | memoryview] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def reset_after_fork(self) -> None:
        # A lock held by another thread at fork time would stay locked forever in the child.
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: str) -> bytes | memoryview | None:
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        size = len(data)
        if size > self.capacity_bytes:
            return
        evicted = 0
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._blocks[key] = data
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self._bytes -= len(dropped)
                evicted += 1
        if evicted:
            self.stats.add("memory_evictions", evicted)

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._bytes -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0
