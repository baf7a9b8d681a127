//! Reads of one open file: the version pinned at open (its ETag; a GET of a changed object fails with
//! ESTALE rather than mix versions), served block by block from the memory tier, each missing block
//! fetched once however many readers want it, and the blocks after a sequential reader fetched ahead of
//! it in the background.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::backends::bucket::{describe, errno_of};
use crate::cache::memory::{Block, BlockKey, FetchError, MemoryTier, Served};
use crate::vfs::namespace::{Errno, Namespace, Node};

#[derive(Clone, Copy, Debug)]
pub struct ReaderConfig {
    pub block_size: usize,
    /// Blocks fetched ahead of one sequential reader.
    pub ahead_blocks: u64,
    /// Block fetches in the background at once, for every reader together (each holds a block buffer).
    pub max_background: usize,
}

#[derive(Default)]
pub struct ReaderStats {
    pub reads: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Bytes of reads served by blocks held before the read (hits and prefetch hits).
    pub bytes_from_memory: AtomicU64,
    pub fetches: AtomicU64,
    pub fetched_bytes: AtomicU64,
    pub fetch_errors: AtomicU64,
    pub ahead_started: AtomicU64,
    /// Files open now (a gauge).
    pub open_files: AtomicU64,
}

/// The data side of the engine: the memory tier and the fetches into it.
pub struct Blocks {
    pub namespace: Arc<Namespace>,
    pub tier: MemoryTier,
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
    pub fn new(namespace: Arc<Namespace>, capacity: usize, config: ReaderConfig) -> Self {
        Blocks {
            namespace,
            tier: MemoryTier::new(capacity),
            config,
            stats: ReaderStats::default(),
            background: AtomicUsize::new(0),
        }
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
            let mut next = file.next_offset.lock().unwrap_or_else(|e| e.into_inner());
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

    /// Block `index` for a reader taking `bytes` of it, counted by where it came from.
    fn block_for(&self, node: &Node, index: u64, bytes: u64) -> Result<Block, Errno> {
        let (block, served) = self.block(node, index, false)?;
        if served != Served::Fetched {
            self.stats
                .bytes_from_memory
                .fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(block)
    }

    fn key(node: &Node, index: u64) -> BlockKey {
        BlockKey {
            key: node.key.clone(),
            etag: node.etag.clone(),
            index,
        }
    }

    /// Block `index` of the node's pinned version (`ahead`: for a reader still to come).
    fn block(&self, node: &Node, index: u64, ahead: bool) -> Result<(Block, Served), Errno> {
        let key = Self::key(node, index);
        self.tier
            .get_or_fetch(&key, ahead, || self.fetch(node, index))
            .map_err(|err| err.errno)
    }

    /// The share of the node's blocks (of its version now) the memory tier holds, 0 to 1.
    pub fn cached_fraction(&self, node: &Node) -> f64 {
        let bs = self.config.block_size as u64;
        let blocks = node.size.div_ceil(bs);
        if blocks == 0 {
            return 1.0;
        }
        let held = (0..blocks)
            .filter(|&index| self.tier.contains(&Self::key(node, index)))
            .count();
        held as f64 / blocks as f64
    }

    fn fetch(&self, node: &Node, index: u64) -> Result<Vec<u8>, FetchError> {
        let bs = self.config.block_size as u64;
        let start = index * bs;
        let length = bs.min(node.size.saturating_sub(start)) as usize;
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
