//! The block cache (DESIGN.md's `cache/`): so far the checksum of its block format.

pub mod checksum;
