"""pffs.cache: the two-level block cache (memory over disk). Imports nothing else from pffs."""

from .block_cache import Block, BlockCache
from .stats import COUNTERS, CacheStats

__all__ = ["COUNTERS", "Block", "BlockCache", "CacheStats"]
