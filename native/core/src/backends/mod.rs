//! The backends (DESIGN.md's `backends/`): so far S3's ranged GET.

pub mod s3_get;
