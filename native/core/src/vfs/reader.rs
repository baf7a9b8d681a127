//! Reads of one open file: the version pinned at open (its ETag; a GET of a changed object fails with
//! ESTALE rather than mix versions), served block by block from the memory tier, each missing block
//! fetched once however many readers want it, and the blocks after a sequential reader fetched ahead of
//! it in the background.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::backends::bucket::{describe, errno_of};
use crate::cache::disk::{self, DiskTier};
use crate::cache::memory::{Block, BlockKey, FetchError, MemoryTier, Served};
use crate::sync::lock;
use crate::vfs::namespace::{Errno, Namespace, Node};

#[derive(Clone, Debug)]
pub struct ReaderConfig {
    pub block_size: usize,
    /// Blocks fetched ahead of one sequential reader.
    pub ahead_blocks: u64,
    /// Block fetches in the background at once, for every reader together (each holds a block buffer).
    pub max_background: usize,
    /// The backend's path of the mount's bucket ("bucket/"): a key's path in the disk tier's keys.
    pub bucket_path: String,
}

#[derive(Default)]
pub struct ReaderStats {
    pub reads: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Bytes of reads served by blocks held before the read (hits and prefetch hits).
    pub bytes_from_memory: AtomicU64,
    pub fetches: AtomicU64,
    pub fetched_bytes: AtomicU64,
    /// Blocks fetched from the backend for a reader waiting on them, and ahead of their reader.
    pub misses: AtomicU64,
    pub prefetches: AtomicU64,
    /// Blocks read from the disk tier for a reader waiting on them, and ahead of their reader.
    pub disk_hits: AtomicU64,
    pub disk_ahead: AtomicU64,
    pub bytes_from_disk: AtomicU64,
    pub fetch_errors: AtomicU64,
    pub ahead_started: AtomicU64,
    /// Files open now (a gauge).
    pub open_files: AtomicU64,
}

/// The data side of the engine: the memory tier and the fetches into it.
pub struct Blocks {
    /// The disk tier's size, its --cache-size, the bound in force (the free-space reserve) in bytes, and
    /// its evictions, as the Python side that writes it last said.
    disk_usage: Mutex<DiskUsage>,
    pub namespace: Arc<Namespace>,
    pub tier: MemoryTier,
    /// The node's disk tier, if the mount has a cache directory.
    pub disk: Option<Arc<DiskTier>>,
    pub config: ReaderConfig,
    pub stats: ReaderStats,
    background: AtomicUsize,
}

/// One open file.
pub struct OpenFile {
    pub node: Node,
    /// Where the last read ended: a read starting there is sequential.
    next_offset: Mutex<u64>,
}

impl OpenFile {
    pub fn new(node: Node) -> Self {
        OpenFile {
            node,
            next_offset: Mutex::new(0),
        }
    }
}

/// The disk tier as its writer (pffs's Python code) last reported it.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiskUsage {
    pub bytes: u64,
    pub capacity: u64,
    pub bound: u64,
    pub evictions: u64,
}

/// Where a block a reader got came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    Memory,
    Disk,
    Backend,
}

/// What a read answers: one block's bytes (no copy), or several blocks' joined.
pub enum ReadOut {
    Slice(Block, usize, usize),
    Joined(Vec<u8>),
}

impl ReadOut {
    pub fn bytes(&self) -> &[u8] {
        match self {
            ReadOut::Slice(block, start, end) => &block[*start..*end],
            ReadOut::Joined(bytes) => bytes,
        }
    }
}

impl Blocks {
    pub fn new(
        namespace: Arc<Namespace>,
        capacity: usize,
        disk: Option<Arc<DiskTier>>,
        config: ReaderConfig,
    ) -> Self {
        Blocks {
            disk_usage: Mutex::new(DiskUsage::default()),
            namespace,
            tier: MemoryTier::new(capacity),
            disk,
            config,
            stats: ReaderStats::default(),
            background: AtomicUsize::new(0),
        }
    }

    pub fn disk_usage(&self) -> DiskUsage {
        *lock(&self.disk_usage)
    }

    pub fn set_disk_usage(&self, usage: DiskUsage) {
        *lock(&self.disk_usage) = usage;
    }

    /// Up to `size` bytes of `file` from `offset` (fewer at its end).
    pub fn read(
        self: &Arc<Self>,
        file: &OpenFile,
        offset: u64,
        size: usize,
    ) -> Result<ReadOut, Errno> {
        let length = file.node.size;
        let end = length.min(offset.saturating_add(size as u64));
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        if offset >= end {
            return Ok(ReadOut::Joined(Vec::new()));
        }
        let sequential = {
            let mut next = lock(&file.next_offset);
            let was = *next == offset;
            *next = end;
            was
        };
        let bs = self.config.block_size as u64;
        let (first, last) = (offset / bs, (end - 1) / bs);
        if sequential || offset == 0 {
            self.fetch_ahead(&file.node, last + 1);
        }
        self.stats
            .bytes_read
            .fetch_add(end - offset, Ordering::Relaxed);
        if !sequential
            && offset != 0
            && let Some(bytes) = self.range_from_disk(&file.node, first, last, offset, end)
        {
            return Ok(ReadOut::Joined(bytes)); // a random read: the segments it needs
        }
        if first == last {
            let block = self.block_for(&file.node, first, end - offset)?;
            let start = (offset - first * bs) as usize;
            return Ok(ReadOut::Slice(block, start, (end - first * bs) as usize));
        }
        let mut joined = Vec::with_capacity((end - offset) as usize);
        for index in first..=last {
            let from = offset.max(index * bs) - index * bs;
            let to = end.min((index + 1) * bs) - index * bs;
            let block = self.block_for(&file.node, index, to - from)?;
            joined.extend_from_slice(&block[from as usize..to as usize]);
        }
        Ok(ReadOut::Joined(joined))
    }

    /// Bytes [offset, end) of blocks `first` to `last` from the disk tier, each read only where the
    /// range covers it, if the memory tier neither holds nor fetches any of them and the disk tier
    /// holds them all.
    fn range_from_disk(
        &self,
        node: &Node,
        first: u64,
        last: u64,
        offset: u64,
        end: u64,
    ) -> Option<Vec<u8>> {
        let disk = self.disk.as_ref()?;
        if (first..=last).any(|index| self.tier.holds(&Self::key(node, index))) {
            return None;
        }
        let bs = self.config.block_size as u64;
        let mut bytes = Vec::with_capacity((end - offset) as usize);
        for index in first..=last {
            let length = bs.min(node.size.saturating_sub(index * bs)) as usize;
            let start = (offset.max(index * bs) - index * bs) as usize;
            let stop = (end.min((index + 1) * bs) - index * bs) as usize;
            let piece = disk.read_range(&self.disk_key(node, index), length, start, stop)?;
            bytes.extend_from_slice(&piece);
            self.stats.disk_hits.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .bytes_from_disk
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Some(bytes)
    }

    /// Block `index` for a reader taking `bytes` of it, counted by where it came from.
    fn block_for(&self, node: &Node, index: u64, bytes: u64) -> Result<Block, Errno> {
        let (block, origin) = self.block(node, index, false)?;
        let counter = match origin {
            Origin::Memory => &self.stats.bytes_from_memory,
            Origin::Disk => &self.stats.bytes_from_disk,
            Origin::Backend => return Ok(block),
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
        Ok(block)
    }

    fn key(node: &Node, index: u64) -> BlockKey {
        BlockKey {
            key: node.key.clone(),
            etag: node.etag.clone(),
            index,
        }
    }

    /// Block `index` of the node's pinned version (`ahead`: for a reader still to come), and where it
    /// came from: the memory tier, or the disk tier or the backend (a block from the backend is queued
    /// for the disk tier).
    fn block(&self, node: &Node, index: u64, ahead: bool) -> Result<(Block, Origin), Errno> {
        let key = Self::key(node, index);
        let fetched: Cell<Option<Origin>> = Cell::new(None);
        let (block, served) = self
            .tier
            .get_or_fetch(&key, ahead, || self.fetch(node, index, ahead, &fetched))
            .map_err(|err| err.errno)?;
        let origin = match (served, fetched.get()) {
            (Served::Fetched, Some(origin)) => origin,
            (Served::Fetched, None) => Origin::Backend, // another reader's fetch, waited for
            _ => Origin::Memory,
        };
        if let (Some(Origin::Backend), Some(disk)) = (fetched.get(), &self.disk) {
            disk.queue_write(self.disk_key(node, index), block.clone());
        }
        Ok((block, origin))
    }

    /// The block's key in the node's disk tier (shared with pffs's Python code: pffs.vfs.reader).
    fn disk_key(&self, node: &Node, index: u64) -> String {
        let path = format!("{}{}", self.config.bucket_path, node.key);
        let identity = format!("etag:{}", node.etag.trim_matches('"'));
        let id = disk::cache_id(&path, &identity, node.size);
        disk::block_key(&id, self.config.block_size, index)
    }

    /// The share of the node's blocks (of its version now) the memory or disk tier holds, 0 to 1.
    pub fn cached_fraction(&self, node: &Node) -> f64 {
        let bs = self.config.block_size as u64;
        let blocks = node.size.div_ceil(bs);
        if blocks == 0 {
            return 1.0;
        }
        let held = (0..blocks)
            .filter(|&index| {
                self.tier.contains(&Self::key(node, index))
                    || self
                        .disk
                        .as_ref()
                        .is_some_and(|disk| disk.holds(&self.disk_key(node, index)))
            })
            .count();
        held as f64 / blocks as f64
    }

    /// The block from the disk tier, or else from the backend; `origin` says which.
    fn fetch(
        &self,
        node: &Node,
        index: u64,
        ahead: bool,
        origin: &Cell<Option<Origin>>,
    ) -> Result<Vec<u8>, FetchError> {
        let bs = self.config.block_size as u64;
        let start = index * bs;
        let length = bs.min(node.size.saturating_sub(start)) as usize;
        if let Some(bytes) = self
            .disk
            .as_ref()
            .and_then(|disk| disk.read(&self.disk_key(node, index), length))
        {
            let counter = if ahead {
                &self.stats.disk_ahead
            } else {
                &self.stats.disk_hits
            };
            counter.fetch_add(1, Ordering::Relaxed);
            origin.set(Some(Origin::Disk));
            return Ok(bytes);
        }
        origin.set(Some(Origin::Backend));
        let counter = if ahead {
            &self.stats.prefetches
        } else {
            &self.stats.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.stats.fetches.fetch_add(1, Ordering::Relaxed);
        match self
            .namespace
            .bucket()
            .get(&node.key, &node.etag, start, length)
        {
            Ok(bytes) => {
                self.stats
                    .fetched_bytes
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                Ok(bytes)
            }
            Err(err) => {
                self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
                let message = describe(&err);
                if errno_of(&err) == libc::ESTALE {
                    self.namespace.changed(node);
                }
                crate::log::warn(&format!(
                    "reading {:?} (block {index}) failed: {message}",
                    node.key
                ));
                Err(FetchError {
                    errno: errno_of(&err),
                    message,
                })
            }
        }
    }

    /// Starts background fetches of the `ahead_blocks` blocks from `from`, those not held or in flight,
    /// within `max_background` for the whole engine.
    fn fetch_ahead(self: &Arc<Self>, node: &Node, from: u64) {
        let bs = self.config.block_size as u64;
        let blocks = node.size.div_ceil(bs);
        for index in from..blocks.min(from + self.config.ahead_blocks) {
            if self.tier.holds(&Self::key(node, index)) {
                continue;
            }
            let taken = self.background.fetch_add(1, Ordering::AcqRel);
            if taken >= self.config.max_background {
                self.background.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            self.stats.ahead_started.fetch_add(1, Ordering::Relaxed);
            let (blocks, node) = (self.clone(), node.clone());
            let spawned = std::thread::Builder::new()
                .name("pffs-ahead".into())
                .spawn(move || {
                    let _ = blocks.block(&node, index, true); // a failure is the reader's to meet, later
                    blocks.background.fetch_sub(1, Ordering::AcqRel);
                });
            if spawned.is_err() {
                self.background.fetch_sub(1, Ordering::AcqRel);
                return;
            }
        }
    }
}
