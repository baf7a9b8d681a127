"""Random reads fetch the pieces that hold their bytes, not whole blocks, and not much more.

A block (4 MiB by default) is the unit of sequential reading and read-ahead. A random read that fetched its
whole block fetched up to 1,000 times what it asked for (issue 15: a parquet column projection fetched 3x the
columns' bytes, 300 random 64 KiB reads 5x). So the part of a block that a random read wants, when the block
is not cached whole, comes from pieces: the 64 KiB pieces (PIECE_SIZE) that lie wholly inside it, rounded
out to pages, and the 4 KiB pages (PAGE_PIECE_SIZE) at its two ends that it does not fill a 64 KiB piece
with. Issue 34: with 64 KiB pieces alone, a random 4 KiB read fetched 16 times its bytes and a 64 KiB read
(68 KiB through FUSE, which reads whole pages) 2 to 3 times; pages alone would cost a cache entry per 4 KiB.
So a read fetches its bytes rounded out to pages (what FUSE asks for anyway), and keeps them in at most two
entries per 64 KiB.

The missing pieces of a read are fetched in one ranged GET per run of consecutive missing pieces, and cached
(memory and disk) under keys of their own: the object version's cache id, then "p" and the piece size, then
the piece's index. A block key has a number where a piece key has "p<size>", so the two never mix; pieces do
not depend on the block size, and a new version of the object has a new cache id, so its reads never find
an old version's pieces. A page not cached as a page is taken from its 64 KiB piece if that is cached.
Threads that want the same missing piece at once share one fetch (BlockCache.get_consecutive).
"""

from __future__ import annotations

from dataclasses import dataclass

from pffs.backends.backend import Backend, ObjectInfo
from pffs.cache import Block, BlockCache
from pffs.cache.aligned import aligned_buffer

PIECE_SIZE = 64 << 10
PAGE_PIECE_SIZE = 4 << 10


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of the object, cached under `key`."""

    key: str
    start: int
    end: int


class PieceReader:
    def __init__(self, backend: Backend, cache: BlockCache) -> None:
        self.backend = backend
        self.cache = cache

    @staticmethod
    def prefix(info: ObjectInfo, piece_size: int = PIECE_SIZE) -> str:
        """What every piece key of this version of the object, of this piece size, starts with."""
        return f"{info.cache_id}-p{piece_size}-"

    def key(self, info: ObjectInfo, index: int, piece_size: int = PIECE_SIZE) -> str:
        return f"{self.prefix(info, piece_size)}{index}"

    @staticmethod
    def piece_range(info: ObjectInfo, index: int, piece_size: int = PIECE_SIZE) -> tuple[int, int]:
        start = index * piece_size
        return start, min(start + piece_size, info.size)

    def plan(self, info: ObjectInfo, start: int, end: int) -> list[Piece]:
        """The pieces that hold [start, end) (start < end <= size), in order: [start, end) rounded out to
        pages, as 64 KiB pieces where it holds one whole (the object's last, short one included) and as
        pages where it does not."""
        position = start // PAGE_PIECE_SIZE * PAGE_PIECE_SIZE
        stop = min(-(-end // PAGE_PIECE_SIZE) * PAGE_PIECE_SIZE, info.size)
        pieces = []
        while position < stop:
            if position % PIECE_SIZE == 0 and min(position + PIECE_SIZE, info.size) <= stop:
                size = PIECE_SIZE
            else:
                size = PAGE_PIECE_SIZE
            index = position // size
            piece_start, piece_end = self.piece_range(info, index, size)
            pieces.append(Piece(self.key(info, index, size), piece_start, piece_end))
            position = piece_end
        return pieces

    def read(self, info: ObjectInfo, start: int, end: int) -> Block:
        """Bytes [start, end) of the object (start < end <= size), from its pieces."""
        pieces = self.plan(info, start, end)
        found = [None if p.end - p.start == PIECE_SIZE else self._from_whole_piece(info, p) for p in pieces]

        def fetch(i: int, j: int) -> Block:  # pieces i .. j-1, in one GET
            run_start, run_end = pieces[i].start, pieces[j - 1].end
            return self.backend.read_range(info, run_start, run_end, into=aligned_buffer(run_end - run_start))

        got = self.cache.get_consecutive(
            [p.key for p in pieces], [p.end - p.start for p in pieces], fetch, found=found
        )
        head = start - pieces[0].start
        if len(got) == 1:
            return memoryview(got[0])[head : head + end - start]
        parts = [memoryview(p) for p in got]
        parts[0] = parts[0][head:]
        parts[-1] = parts[-1][: end - pieces[-1].start]
        return b"".join(parts)

    def _from_whole_piece(self, info: ObjectInfo, page: Piece) -> Block | None:
        """A page, if it is cached as a page, or else as part of its cached 64 KiB piece; None if neither
        (only a page cached as a page is counted a hit or taken by get_consecutive itself)."""
        if self.cache.memory.get(page.key) is not None:
            return None  # get_consecutive finds (and counts) it
        index = page.start // PIECE_SIZE
        piece_start = index * PIECE_SIZE
        return self.cache.get_range_if_cached(
            self.key(info, index), page.start - piece_start, page.end - piece_start
        )
