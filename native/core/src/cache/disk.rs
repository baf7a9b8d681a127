//! The native engine's door to the node's disk tier: the one pffs's Python code keeps
//! (cache/block_disk.py), in the same directory and format, so a mount, the SDK, `pffs warmup` and the CSI
//! plugin on a node share every block.
//!
//! A block's file name is a hash of its key (`blocks/abc/abc….blk`, BLAKE2b-128 of the key), so a read
//! needs no index: it opens the file, checks the header and the segment checksums, and serves the payload,
//! without Python. Writing needs the index (diskcache's SQLite: sizes, access times, eviction, the bound and
//! the free-space reserve), which stays in Python for now: blocks fetched here are queued, and a Python
//! thread of the mount takes them off the queue and hands them to the disk tier's writer, off the path of
//! any request. The queue is bounded; a block that finds it full is not written (counted), never waited for.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use blake2::Blake2b;
use blake2::digest::Digest;
use blake2::digest::consts::U16;

use super::block_file::{self, BlockError};
use super::memory::Block;

#[derive(Default)]
pub struct DiskStats {
    pub hits: AtomicU64,
    pub bytes_read: AtomicU64,
    pub corrupt: AtomicU64,
    pub read_errors: AtomicU64,
    pub queued: AtomicU64,
    pub dropped: AtomicU64,
}

struct WriteQueue {
    blocks: VecDeque<(String, Block)>,
    bytes: usize,
    closed: bool,
}

pub struct DiskTier {
    /// The disk tier's `blocks` folder: `<cache dir>/blocks`.
    blocks_dir: PathBuf,
    queue: Mutex<WriteQueue>,
    queued: Condvar,
    /// Bytes of blocks waiting to be written, at most (as the Python disk writer's WRITE_BEHIND_BYTES).
    queue_bound: usize,
    pub stats: DiskStats,
}

/// BLAKE2b with a 16-byte digest: Python's `hashlib.blake2b(data, digest_size=16)`.
fn blake2b_128_hex(data: &[u8]) -> String {
    Blake2b::<U16>::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Where a block lives under the `blocks` folder (cache/block_disk.py's `block_filename`).
pub fn block_filename(key: &str) -> String {
    let digest = blake2b_128_hex(key.as_bytes());
    format!("{}/{digest}.blk", &digest[..3])
}

/// The prefix of every cache key of one version of one object (pffs.backends.backend.ObjectInfo.cache_id):
/// `path` is the backend's ("bucket/key"), `identity` what changes with its bytes ("etag:…").
pub fn cache_id(path: &str, identity: &str, size: u64) -> String {
    blake2b_128_hex(format!("{path}\0{identity}\0{size}").as_bytes())
}

/// A block's cache key (pffs.vfs.reader.BlockReader.key).
pub fn block_key(cache_id: &str, block_size: usize, index: u64) -> String {
    format!("{cache_id}-{block_size}-{index}")
}

impl DiskTier {
    pub fn new(cache_dir: &Path, queue_bound: usize) -> Self {
        DiskTier {
            blocks_dir: cache_dir.join("blocks"),
            queue: Mutex::new(WriteQueue {
                blocks: VecDeque::new(),
                bytes: 0,
                closed: false,
            }),
            queued: Condvar::new(),
            queue_bound,
            stats: DiskStats::default(),
        }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.blocks_dir.join(block_filename(key))
    }

    /// Whether the block's file is there (not read: for `user.pffs.cached`).
    pub fn holds(&self, key: &str) -> bool {
        self.path(key).exists()
    }

    /// The block's payload of `length` bytes, checked, if the disk tier holds it whole. A damaged file
    /// is removed (the block is fetched again) and counted; any other failure is a miss.
    pub fn read(&self, key: &str, length: usize) -> Option<Vec<u8>> {
        let path = self.path(key);
        match block_file::read_payload(&path, length) {
            Ok(payload) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_read
                    .fetch_add(length as u64, Ordering::Relaxed);
                Some(payload)
            }
            Err(BlockError::Io(err)) if err.kind() == std::io::ErrorKind::NotFound => None,
            Err(BlockError::Corrupt(why)) => {
                self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                crate::log::warn(&format!(
                    "dropped a damaged disk-cache block {} ({why}); fetching it again",
                    path.display()
                ));
                let _ = std::fs::remove_file(&path);
                None
            }
            Err(BlockError::Io(err)) => {
                self.stats.read_errors.fetch_add(1, Ordering::Relaxed);
                crate::log::warn(&format!(
                    "disk cache read of {} failed ({err}); reading from the backend",
                    path.display()
                ));
                None
            }
        }
    }

    /// Queues a fetched block for the disk tier's writer; false (counted) if the queue is full.
    pub fn queue_write(&self, key: String, block: Block) -> bool {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if queue.closed || queue.bytes + block.len() > self.queue_bound {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        queue.bytes += block.len();
        queue.blocks.push_back((key, block));
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.queued.notify_one();
        true
    }

    /// The blocks queued, waiting up to `wait` for one; empty once closed and drained.
    pub fn take_writes(&self, wait: Duration) -> Vec<(String, Block)> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let (mut queue, _) = self
            .queued
            .wait_timeout_while(queue, wait, |q| q.blocks.is_empty() && !q.closed)
            .unwrap_or_else(|e| e.into_inner());
        queue.bytes = 0;
        queue.blocks.drain(..).collect()
    }

    /// No more writes are queued; a waiting taker returns.
    pub fn close(&self) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.closed = true;
        self.queued.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn names_are_pythons() {
        // hashlib.blake2b(b"abc", digest_size=16).hexdigest()
        assert_eq!(blake2b_128_hex(b"abc"), "cf4ab791c62b8d2b2109c90275287816");
        let id = cache_id("bucket/a/b.bin", "etag:0123abc", 12345);
        assert_eq!(id, "e892d4cd8414ca9e966efd544aeb91c4");
        let key = block_key(&id, 65536, 3);
        assert_eq!(key, "e892d4cd8414ca9e966efd544aeb91c4-65536-3");
        assert_eq!(
            block_filename(&key),
            "b84/b84066f0ca605deaaa235f9700bea91f.blk"
        );
    }

    #[test]
    fn reads_what_the_block_format_wrote_and_drops_what_is_damaged() {
        let dir = std::env::temp_dir().join(format!("pffs-disk-test-{}", std::process::id()));
        let tier = DiskTier::new(&dir, 1 << 20);
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let path = tier.path("k-1");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut file = block_file::block_header(&payload);
        file.extend_from_slice(&payload);
        std::fs::write(&path, &file).unwrap();
        assert_eq!(tier.read("k-1", payload.len()).unwrap(), payload);
        assert!(tier.read("k-2", 10).is_none());
        let last = file.len() - 1;
        file[last] ^= 1;
        std::fs::write(&path, &file).unwrap();
        assert!(tier.read("k-1", payload.len()).is_none());
        assert!(!path.exists(), "a damaged block stays");
        assert_eq!(tier.stats.corrupt.load(Ordering::Relaxed), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_write_queue_is_bounded_and_drained_in_order() {
        let tier = DiskTier::new(Path::new("/nonexistent"), 10);
        assert!(tier.queue_write("a".into(), Arc::new(vec![0; 6])));
        assert!(!tier.queue_write("b".into(), Arc::new(vec![0; 6])));
        assert!(tier.queue_write("c".into(), Arc::new(vec![0; 4])));
        let taken = tier.take_writes(Duration::from_millis(1));
        let keys: Vec<_> = taken.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", "c"]);
        assert_eq!(tier.stats.dropped.load(Ordering::Relaxed), 1);
        tier.close();
        assert!(tier.take_writes(Duration::from_secs(5)).is_empty());
    }
}
