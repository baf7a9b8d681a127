//! The block cache (DESIGN.md's `cache/`): the checksum, the block file format of the disk tier, and the
//! native engine's memory tier.

pub mod block_file;
pub mod checksum;
pub mod memory;
