//! The backends (DESIGN.md's `backends/`): so far S3's ranged GET, its listings and HEAD.

pub mod bucket;
pub mod s3_get;
pub mod s3_list;
