"""Reads byte ranges of objects through the block cache, with read-ahead.

A read of [offset, offset+length) is split into blocks; each block comes from memory, disk or one ranged GET
(see pffs.cache). Blocks of one large read are fetched in parallel; blocks beyond it are prefetched when the
reader is sequential. A random read takes from a block only the part it wants: from the block if that is
cached, else from pieces of 64 KiB and of a page (see pieces.py). Every key carries the object's identity,
so bytes of two versions never mix.

Memory (issue 43, docs/guides/memory.md): the buffers of reads come from two budgets of bytes, whatever the
number of readers. Read-ahead holds at most `readahead_bytes` (it shrinks when that is used up); the reads
that wait for blocks hold at most `reads_bytes` (fetch_workers blocks), counted for every block a read
touches, so a reader waits for room before it asks for any block and never while holding one.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pffs.backends.backend import Backend, ObjectInfo
from pffs.cache import Block, BlockCache
from pffs.cache.aligned import aligned_buffer
from pffs.cache.disk_tier import WRITE_BEHIND_BYTES
from pffs.cache.fork import after_fork_in_child
from pffs.peers.group import PeerGroup
from pffs.vfs.byte_ranges import covered_bytes
from pffs.vfs.pieces import PIECE_SIZE, PieceReader
from pffs.vfs.readahead import ByteBudget, ReadAheadState

if TYPE_CHECKING:
    from pffs.config import CacheSettings


class ObjectReader:
    def __init__(
        self,
        backend: Backend,
        cache: BlockCache,
        block_size: int,
        readahead_bytes: int,
        workers: int,
    ) -> None:
        self.backend = backend
        self.cache = cache
        self.block_size = block_size
        self.readahead_blocks = readahead_bytes // block_size
        self.budget = ByteBudget(readahead_bytes)  # blocks fetched ahead, until their reader is past them
        # Blocks of the reads being served, from wherever they come: one block per fetch thread, at least
        # two (a read across a block boundary).
        self.reads = ByteBudget(reads_budget_bytes(block_size, workers))
        self.workers = workers
        self.pieces = PieceReader(backend, cache)
        self.peers: PeerGroup | None = None  # a cache group's members, asked before the backend
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        after_fork_in_child(self._reset_after_fork)

    def _reset_after_fork(self) -> None:
        # The parent's worker threads do not exist here; make new ones on first use.
        self._pool = None
        self._pool_lock = threading.Lock()
        self.budget.reset_after_fork()
        self.reads.reset_after_fork()

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            with self._pool_lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pffs-fetch")
                    self._pool_pid = os.getpid()
        return self._pool

    def new_state(self) -> ReadAheadState:
        return ReadAheadState(self.readahead_blocks, slack_bytes=self.block_size, budget=self.budget)

    def key(self, info: ObjectInfo, index: int) -> str:
        return f"{info.cache_id}-{self.block_size}-{index}"

    def block_count(self, info: ObjectInfo) -> int:
        return -(-info.size // self.block_size)

    def block_range(self, info: ObjectInfo, index: int) -> tuple[int, int]:
        start = index * self.block_size
        return start, min(start + self.block_size, info.size)

    def block(
        self,
        info: ObjectInfo,
        index: int,
        keep_in_memory: bool = True,
        *,
        ask_peers: bool = True,
        ahead: bool = False,
    ) -> Block:
        """One block, from memory, disk, its owner in the cache group (unless `ask_peers` is False: a
        member asking this process, which owns it) or the backend; `ahead`: for a reader yet to come
        (counted as a prefetch, see BlockCache.get)."""
        start, end = self.block_range(info, index)
        key = self.key(info, index)
        if ahead and keep_in_memory:
            # A file fetched ahead for the memory tier (a directory's next small files, see dir_prefetch):
            # in flight, it takes room in the read-ahead budget, and is skipped if there is none (it is a
            # guess; this runs on a fetch thread, which must never wait for a budget).
            if not self.budget.try_acquire(end - start):
                return b""
            try:
                return self._get(info, index, start, end, key, keep_in_memory, ask_peers, ahead)
            finally:
                self.budget.release(end - start)
        return self._get(info, index, start, end, key, keep_in_memory, ask_peers, ahead)

    def _get(
        self,
        info: ObjectInfo,
        index: int,
        start: int,
        end: int,
        key: str,
        keep_in_memory: bool,
        ask_peers: bool,
        ahead: bool,
    ) -> Block:
        return self.cache.get(
            key,
            lambda: self._fetch(info, start, end, key if ask_peers else None),
            length=end - start,
            keep_in_memory=keep_in_memory,
            ahead=ahead,
        )

    def _fetch(self, info: ObjectInfo, start: int, end: int, key: str | None = None) -> Block:
        peers = self.peers if key is not None else None
        if not self.cache.direct_io and peers is None:
            # A buffer of the backend's own (a bytes object the native S3 client fills, not zeroed first):
            # a whole-block read returns it without a copy. Zeroing a buffer, then copying the block out
            # of it, cost a quarter of the GIL a cold small-file read holds (py-spy).
            return self.backend.read_range(info, start, end)
        # Into a page-aligned buffer, which the disk tier writes with O_DIRECT.
        into = aligned_buffer(end - start)
        if peers is not None and key is not None and peers.fetch(peers.request(key, info, start, end), into):
            return into
        return self.backend.read_range(info, start, end, into=into)

    def read(self, info: ObjectInfo, offset: int, length: int, state: ReadAheadState | None = None) -> bytes:
        """Bytes [offset, offset+length) of the version `info` names, clipped at the end of the object."""
        data = self.read_view(info, offset, length, state, as_view=False)
        assert isinstance(data, bytes)
        return data

    def read_view(
        self,
        info: ObjectInfo,
        offset: int,
        length: int,
        state: ReadAheadState | None = None,
        *,
        as_view: bool = True,
    ) -> Block:
        """As `read`, but a part of one block comes back as a memoryview of it (no copy)."""
        end = self._end(info, offset, length)
        if offset >= end:
            return b""
        first, last = offset // self.block_size, (end - 1) // self.block_size
        most = max(1, self.reads.limit_bytes // self.block_size)  # blocks one read may hold at once
        if last - first + 1 > most:
            return self._read_in_parts(info, offset, end, state, most, as_view)
        ready: dict[int, Future[Block]] = {}
        random_access = False
        if state is not None:
            with state.lock:
                ready = state.take(first, last)
                self._read_ahead(info, state, offset, end, last)
                random_access = state.random
            for index in ready:  # fetched (or found) ahead for this read: counted then
                self.cache.forget_ahead(self.key(info, index))
        if random_access and not ready:
            # Pieces of at most the bytes asked for (rounded out to pieces) and the whole blocks inside.
            with self.reads.held(min((last - first + 1) * self.block_size, end - offset + 2 * PIECE_SIZE)):
                data = self._read_sparse(info, offset, end, first, last)
                return data if as_view or isinstance(data, bytes) else bytes(data)
        # Room for every block of the read before it asks for any (so it never waits holding one).
        with self.reads.held((last - first + 1) * self.block_size):
            # Blocks after the first are fetched in parallel while the first is read here.
            for index in range(first + 1, last + 1):
                if index not in ready:
                    ready[index] = self.pool.submit(self.block, info, index)
            try:
                first_block = ready.pop(first).result() if first in ready else self.block(info, first)
                blocks = [first_block] + [ready[i].result() for i in range(first + 1, last + 1)]
            finally:
                for future in ready.values():
                    future.cancel()
            return self._assemble(blocks, offset, end, first, last, as_view)

    def _read_in_parts(
        self,
        info: ObjectInfo,
        offset: int,
        end: int,
        state: ReadAheadState | None,
        most: int,
        as_view: bool,
    ) -> Block:
        """A read of more blocks than one read may hold at once: `most` blocks at a time, into one buffer
        (the caller's bytes, not the cache's)."""
        out = bytearray(end - offset)
        position = offset
        while position < end:
            stop = min(end, (position // self.block_size + most) * self.block_size)
            part = self.read_view(info, position, stop - position, state)
            out[position - offset : position - offset + len(part)] = part
            position += len(part)
            del part
        return memoryview(out) if as_view else bytes(out)

    def _read_sparse(self, info: ObjectInfo, offset: int, end: int, first: int, last: int) -> Block:
        """A random read of [offset, end): the blocks it covers whole are read as blocks (in parallel); of
        a block it wants only part of, that part comes from the block if it is cached, else from pieces."""
        # In order: a block being fetched, a cached part, or a stretch [start, stop) to read from pieces.
        plan: list[Future[Block] | Block | tuple[int, int]] = []
        try:
            for index in range(first, last + 1):
                block_start, block_end = self.block_range(info, index)
                start, stop = max(offset, block_start), min(end, block_end)
                if (start, stop) == (block_start, block_end):
                    plan.append(self.pool.submit(self.block, info, index))
                    continue
                part = self.cache.get_range_if_cached(
                    self.key(info, index), start - block_start, stop - block_start
                )
                if part is not None and len(part) == stop - start:
                    plan.append(part)
                elif plan and isinstance(plan[-1], tuple):  # one block's tail, the next one's head: one GET
                    plan[-1] = (plan[-1][0], stop)
                else:
                    plan.append((start, stop))
            parts = [
                step.result()
                if isinstance(step, Future)
                else self.pieces.read(info, *step)
                if isinstance(step, tuple)
                else step
                for step in plan
            ]
        finally:
            for step in plan:
                if isinstance(step, Future):
                    step.cancel()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_now(self, info: ObjectInfo, offset: int, length: int, state: ReadAheadState) -> Block | None:
        """The read, if every block it needs is in memory or already fetched ahead; else None, having
        changed nothing (the caller then calls `read` from a worker thread). For event loops: never blocks.
        """
        end = self._end(info, offset, length)
        if offset >= end:
            return b""
        first, last = offset // self.block_size, (end - 1) // self.block_size
        blocks: list[Block] = []
        from_memory: list[tuple[str, int]] = []  # (key, bytes) read from the memory tier
        with state.lock:
            for index in range(first, last + 1):
                future = state.pending.get(index)
                if future is not None:
                    if not future.done() or future.cancelled() or future.exception() is not None:
                        return None
                    blocks.append(future.result())
                    self.cache.forget_ahead(self.key(info, index))  # counted when looked up ahead
                    continue
                key = self.key(info, index)
                block = self.cache.memory.get(key)
                if block is None:
                    return None
                blocks.append(block)
                block_start = index * self.block_size
                from_memory.append((key, min(end, block_start + len(block)) - max(offset, block_start)))
            state.take(first, last)
            self._read_ahead(info, state, offset, end, last)
        for key, size in from_memory:
            self.cache.count_hit("memory", key, size)
        return self._assemble(blocks, offset, end, first, last, True)

    def _assemble(
        self, blocks: list[Block], offset: int, end: int, first: int, last: int, as_view: bool
    ) -> Block:
        """Bytes [offset, end) from the blocks first..last: a view of one block, or one joined copy."""
        head = offset - first * self.block_size
        if len(blocks) == 1:
            block = blocks[0]
            if head == 0 and end - offset == len(block) and (as_view or isinstance(block, bytes)):
                return block  # a whole-block read (the common sequential case): no copy
            part = memoryview(block)[head : head + end - offset]
            return part if as_view else bytes(part)
        parts = [memoryview(b) for b in blocks]
        parts[0] = parts[0][head:]
        parts[-1] = parts[-1][: end - last * self.block_size]
        return b"".join(parts)

    @staticmethod
    def _end(info: ObjectInfo, offset: int, length: int) -> int:
        """Where a read of `length` bytes at `offset` stops (-1: to the end), clipped at the object's end."""
        return min(info.size, offset + length) if length >= 0 else info.size

    def _read_ahead(self, info: ObjectInfo, state: ReadAheadState, offset: int, end: int, last: int) -> None:
        """Records the read [offset, end) and starts the blocks the read-ahead window asks for now.
        Called with state.lock held."""
        for index in state.on_read(offset, end, last):
            if index >= self.block_count(info):
                break
            if index in state.pending:  # fetched ahead before a seek back: still held, still coming
                continue
            start, stop = self.block_range(info, index)
            if not state.hold(index, stop - start):
                # The budget is used up: the window shrinks to what it got; the rest is asked for again at
                # the next read (read-ahead waits, it never allocates past the budget).
                state.scheduled_up_to = index - 1
                break
            state.pending[index] = self._prefetch(info, index)

    def _prefetch(self, info: ObjectInfo, index: int) -> Future[Block]:
        """Starts fetching a block ahead of the reader (its budget taken: see ReadAheadState.hold)."""
        # Not into the memory tier: a stream read once would push out everything else there (and its
        # blocks would fill fresh memory, which costs more here than the network). The handle holds the
        # block while it reads it; the disk tier keeps it.
        return self.pool.submit(self.block, info, index, False, ahead=True)

    def warm_block(self, info: ObjectInfo, index: int) -> int:
        """Puts one block on disk (not in memory); returns the bytes fetched, 0 if it was cached already."""
        start, end = self.block_range(info, index)
        if start >= end:
            return 0
        key = self.key(info, index)
        fetched = self.cache.ensure_on_disk(key, lambda: self._fetch(info, start, end, key))
        return end - start if fetched else 0

    def warm(self, info: ObjectInfo) -> int:
        """Puts every block of the object on disk; returns the bytes fetched from the backend."""
        return sum(self.warm_block(info, i) for i in range(self.block_count(info)))

    def cached_bytes(self, info: ObjectInfo) -> int:
        """Bytes of the object on the disk tier, in blocks of any block size (a mount or warm-up may have
        used another one) or in the pieces random reads fetched, each byte counted once (after everything
        read so far is written; for the node's cache report, xattrs and `pffs du`). One range scan of the
        disk index: no lookup per block, however large the object."""
        return cached_bytes_in(self.cache, info.cache_id, info.size)

    def cached_fraction(self, info: ObjectInfo) -> float:
        """The fraction of the object's bytes on the disk tier (see cached_bytes)."""
        if info.size == 0:
            return 1.0
        return self.cached_bytes(info) / info.size


def reads_budget_bytes(block_size: int, workers: int) -> int:
    """Bytes the blocks of reads in progress may hold at once (see ObjectReader.reads)."""
    return max(2, workers) * block_size


# What a mount process holds besides the budgets of memory_bound: the interpreter, libraries, pyfuse3, the
# clients and the threads (82-86 MiB of resident memory in an idle mount), memory freed that malloc keeps
# for reuse, and per-file state (handles, listings). Chosen so the bound at the default options is
# --memory-cache-size plus 320 MiB (pffs.fuse.mount.MEMORY_OVERHEAD_BYTES, docs/operations.md).
FIXED_BYTES = 124 << 20


def memory_bound(settings: CacheSettings, fixed_bytes: int = FIXED_BYTES) -> int:
    """The most memory a mount with these settings uses, whatever the number of readers (docs/guides/
    memory.md): the memory tier, the read-ahead budget, the reads budget, the disk tier's write-behind
    queue (and the one block that may join it past its bound), and `fixed_bytes`. For the SDK, pffs's
    share of its process is the same less the interpreter's part of `fixed_bytes`."""
    return (
        settings.memory_cache_size
        + settings.readahead_size
        + reads_budget_bytes(settings.block_size, settings.fetch_workers)
        + WRITE_BEHIND_BYTES
        + settings.block_size
        + fixed_bytes
    )


def cached_bytes_in(cache: BlockCache, cache_id: str, size: int) -> int:
    """Bytes of the object `cache_id` (of `size` bytes) on `cache`'s disk tier (see Reader.cached_bytes)."""
    if cache.disk is None:
        return 0
    cache.wait_for_disk()
    prefix = f"{cache_id}-"
    held = (_key_range(key[len(prefix) :], size) for key in cache.stored_keys(prefix))
    return covered_bytes(r for r in held if r is not None)


def _key_range(rest: str, size: int) -> tuple[int, int] | None:
    """The bytes of an object of `size` that a cache key holds, from the key's part after the version's
    cache id: "<block size>-<index>" (a block) or "p<piece size>-<index>" (a piece, see pieces.py)."""
    unit, _, index = rest.partition("-")
    try:
        length, number = int(unit.removeprefix("p")), int(index)
    except ValueError:
        return None
    start = number * length
    return (start, min(start + length, size)) if start < size and length > 0 else None
