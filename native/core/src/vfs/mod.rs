//! The native engine's file system view (DESIGN.md's `vfs/`): names and versions (`namespace`) and the
//! reads of open files through the cache (`reader`).

pub mod namespace;
pub mod reader;
