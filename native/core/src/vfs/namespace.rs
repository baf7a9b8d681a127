//! The names of the native engine: an inode per key seen, a listing per directory trusted for `dir_ttl`
//! (one LIST of the directory answers every lookup in it), and what was last seen served past its TTL
//! while the store cannot be reached (stale-if-error, as pffs/vfs does).
//!
//! An S3 prefix is a directory; a key `a` beside keys under `a/` is hidden by the directory (Mountpoint's
//! rule for shadowed keys, and pffs.vfs.namespace's). A key's inode number stays the same while the
//! mount lives, across changes of the object: the version a reader gets is pinned at open (vfs::reader),
//! not here. The state is plain maps of numbers and keys, so a successor process could be handed it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::backends::bucket::{Bucket, describe, errno_of};
use crate::backends::s3_get::GetError;
use crate::sync::{lock, read, write};

pub const ROOT: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// What the engine knows of one name.
#[derive(Clone, Debug)]
pub struct Node {
    pub ino: u64,
    pub parent: u64,
    pub kind: Kind,
    /// The object's key, or a directory's prefix ("" for the bucket's root, else ending in "/").
    pub key: Arc<str>,
    pub size: u64,
    pub etag: Arc<str>,
    pub mtime_secs: i64,
}

struct Listing {
    children: BTreeMap<String, u64>,
    listed_at: Instant,
    /// Known out of date (an object in it changed): listed again at the next lookup, whatever its age.
    outdated: bool,
}

#[derive(Default)]
struct Table {
    nodes: HashMap<u64, Node>,
    by_key: HashMap<Arc<str>, u64>,
    listings: HashMap<u64, Listing>,
    next_ino: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct NamespaceConfig {
    /// How long a listing (and so a lookup, a size) is trusted.
    pub dir_ttl: Duration,
    /// How long past its TTL a listing is served while the store cannot be reached (0: never).
    pub stale_if_error: Duration,
}

#[derive(Default)]
pub struct NamespaceStats {
    pub lists: AtomicU64,
    pub stale_served: AtomicU64,
    pub backend_errors: AtomicU64,
}

pub struct Namespace {
    bucket: Arc<Bucket>,
    config: NamespaceConfig,
    table: RwLock<Table>,
    /// One LIST of a directory at a time: lookups in a directory being listed wait for that listing.
    listing_locks: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
    pub stats: NamespaceStats,
}

/// An errno, for the kernel.
pub type Errno = i32;

impl Namespace {
    /// The namespace of the keys under `prefix` ("" or ending in "/"), the mount's root.
    pub fn new(bucket: Arc<Bucket>, prefix: &str, config: NamespaceConfig) -> Self {
        let mut table = Table {
            next_ino: ROOT + 1,
            ..Table::default()
        };
        let key: Arc<str> = prefix.into();
        table.by_key.insert(key.clone(), ROOT);
        table.nodes.insert(
            ROOT,
            Node {
                ino: ROOT,
                parent: ROOT,
                kind: Kind::Dir,
                key,
                size: 0,
                etag: "".into(),
                mtime_secs: now_secs(),
            },
        );
        Namespace {
            bucket,
            config,
            table: RwLock::new(table),
            listing_locks: Mutex::new(HashMap::new()),
            stats: NamespaceStats::default(),
        }
    }

    pub fn bucket(&self) -> &Bucket {
        &self.bucket
    }

    /// The node as last seen (no backend call).
    pub fn node(&self, ino: u64) -> Option<Node> {
        read(&self.table).nodes.get(&ino).cloned()
    }

    pub fn lookup(&self, parent: u64, name: &str) -> Result<Node, Errno> {
        self.fresh_listing(parent)?;
        let table = read(&self.table);
        let ino = table
            .listings
            .get(&parent)
            .and_then(|listing| listing.children.get(name))
            .ok_or(libc::ENOENT)?;
        table.nodes.get(ino).cloned().ok_or(libc::ENOENT)
    }

    /// The node, its directory's listing refreshed if past its TTL (a changed size shows).
    pub fn getattr(&self, ino: u64) -> Result<Node, Errno> {
        let node = self.node(ino).ok_or(libc::ENOENT)?;
        if node.ino != ROOT {
            // Seen again or gone: either way the kernel's copy is answered as the listing says.
            self.fresh_listing(node.parent)?;
        }
        self.node(ino).ok_or(libc::ENOENT)
    }

    /// Forgets the listing of the node's directory: the object changed under a reader (ESTALE), so the
    /// next open lists it again and pins the new version rather than fail the same way.
    pub fn changed(&self, node: &Node) {
        let mut table = write(&self.table);
        if let Some(listing) = table.listings.get_mut(&node.parent) {
            listing.outdated = true;
        }
    }

    /// A directory's entries, by name, from a listing within its TTL.
    pub fn entries(&self, dir: u64) -> Result<Vec<(String, Node)>, Errno> {
        self.fresh_listing(dir)?;
        let table = read(&self.table);
        let listing = table.listings.get(&dir).ok_or(libc::ENOENT)?;
        Ok(listing
            .children
            .iter()
            .filter_map(|(name, ino)| Some((name.clone(), table.nodes.get(ino)?.clone())))
            .collect())
    }

    /// Lists `dir` unless its listing is within its TTL; past it, a failed LIST leaves the last
    /// listing in place for `stale_if_error` more.
    fn fresh_listing(&self, dir: u64) -> Result<(), Errno> {
        if self.listed_within(dir, self.config.dir_ttl) {
            return Ok(());
        }
        let listing_lock = lock(&self.listing_locks).entry(dir).or_default().clone();
        let _listing = lock(&listing_lock);
        if self.listed_within(dir, self.config.dir_ttl) {
            return Ok(()); // listed by the reader we waited for
        }
        let node = self.node(dir).ok_or(libc::ENOENT)?;
        if node.kind != Kind::Dir {
            return Err(libc::ENOTDIR);
        }
        self.stats.lists.fetch_add(1, Ordering::Relaxed);
        match self.bucket.list_dir(&node.key) {
            Ok(page) => {
                self.apply_listing(dir, &node.key, page);
                Ok(())
            }
            Err(err) => self.listing_failed(dir, &node.key, &err),
        }
    }

    fn listing_failed(&self, dir: u64, prefix: &str, err: &GetError) -> Result<(), Errno> {
        self.stats.backend_errors.fetch_add(1, Ordering::Relaxed);
        let usable = self.config.dir_ttl + self.config.stale_if_error;
        let answerable = matches!(
            err,
            GetError::Io { .. } | GetError::Answer { status: 500.., .. }
        );
        if answerable && self.listed_within(dir, usable) {
            self.stats.stale_served.fetch_add(1, Ordering::Relaxed);
            crate::log::warn(&format!(
                "listing {prefix:?} failed ({}): serving it as last seen (stale-if-error)",
                describe(err)
            ));
            return Ok(());
        }
        crate::log::warn(&format!("listing {prefix:?} failed: {}", describe(err)));
        Err(errno_of(err))
    }

    fn listed_within(&self, dir: u64, ttl: Duration) -> bool {
        read(&self.table)
            .listings
            .get(&dir)
            .is_some_and(|listing| !listing.outdated && listing.listed_at.elapsed() < ttl)
    }

    fn apply_listing(&self, dir: u64, prefix: &str, page: crate::backends::s3_list::ListPage) {
        let mut table = write(&self.table);
        let mut children = BTreeMap::new();
        for object in page.objects {
            let Some(name) = child_name(prefix, &object.key) else {
                continue; // the directory's own marker, or a name no file system can show
            };
            let ino = table.node_for(&object.key, dir, Kind::File);
            if let Some(node) = table.nodes.get_mut(&ino) {
                node.size = object.size;
                node.etag = object.etag.as_str().into();
                node.mtime_secs = object.mtime_secs;
            }
            children.insert(name.to_string(), ino);
        }
        for sub in page.prefixes {
            let Some(name) = child_name(prefix, sub.trim_end_matches('/')) else {
                continue;
            };
            // A directory hides a key of the same name (`a` beside `a/b`).
            let ino = table.node_for(&sub, dir, Kind::Dir);
            children.insert(name.to_string(), ino);
        }
        table.listings.insert(
            dir,
            Listing {
                children,
                listed_at: Instant::now(),
                outdated: false,
            },
        );
    }
}

impl Table {
    /// The inode of `key` as a `kind`, made if new (a key that turned from file to directory, or back,
    /// gets a new one).
    fn node_for(&mut self, key: &str, parent: u64, kind: Kind) -> u64 {
        if let Some(&ino) = self.by_key.get(key)
            && self.nodes.get(&ino).is_some_and(|node| node.kind == kind)
        {
            return ino;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        let key: Arc<str> = key.into();
        self.by_key.insert(key.clone(), ino);
        self.nodes.insert(
            ino,
            Node {
                ino,
                parent,
                kind,
                key,
                size: 0,
                etag: "".into(),
                mtime_secs: now_secs(),
            },
        );
        ino
    }
}

/// The name a key has in the directory `prefix`, if a file system can show it.
fn child_name<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    let name = key.strip_prefix(prefix)?;
    let bad =
        name.is_empty() || name == "." || name == ".." || name.contains('/') || name.len() > 255;
    (!bad).then_some(name)
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_what_a_file_system_can_show() {
        assert_eq!(child_name("d/", "d/a.txt"), Some("a.txt"));
        assert_eq!(child_name("", "a.txt"), Some("a.txt"));
        assert_eq!(child_name("d/", "d/"), None);
        assert_eq!(child_name("d/", "d/x/y"), None);
        assert_eq!(child_name("d/", "d/.."), None);
        assert_eq!(child_name("d/", "e/a"), None);
    }
}
