//! pffs's native data plane, without Python: the binding crate (`../python`) exposes to Python only what
//! Python calls. Its folders follow DESIGN.md's layers (`fuse/` → `vfs/` → `cache/` → `backends/`); the
//! native engine serves read-only S3 mounts (fuse/, vfs/, the memory tier in cache/, backends/).

pub mod backends;
pub mod cache;
pub mod fuse;
pub mod log;
pub mod sync;
pub mod vfs;

/// A digest of native/'s sources, which setup.py sets: cargo rebuilds a crate when a variable it reads at
/// compile time changes, so checkouts sharing one cached target folder never reuse each other's build
/// of different sources (cargo's own check compares file times, not contents).
pub const SOURCE_DIGEST: Option<&str> = option_env!("PFFS_NATIVE_SOURCE");
