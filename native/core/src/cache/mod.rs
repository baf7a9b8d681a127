//! The block cache (DESIGN.md's `cache/`): the checksum, the block file format of the disk tier, the native
//! engine's reads of the node's disk tier, and its memory tier.

pub mod block_file;
pub mod checksum;
pub mod disk;
pub mod memory;
