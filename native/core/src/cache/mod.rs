//! The block cache (DESIGN.md's `cache/`): so far the checksum and the block file format.

pub mod block_file;
pub mod checksum;
