"""pffs.vfs: paths, metadata with TTLs, read-ahead, reads through the block cache."""

from pffs.vfs.vfs import OpenObject, Vfs, shared_block_cache

__all__ = ["OpenObject", "Vfs", "shared_block_cache"]
