//! The native engine's door to the node's disk tier: the one pffs's Python code keeps
//! (cache/block_disk.py), in the same directory and format, so a mount, the SDK, `pffs warmup` and the CSI
//! plugin on a node share every block.
//!
//! A block's file name is a hash of its key (`blocks/abc/abc….blk`, BLAKE2b-128 of the key), so a read
//! needs no index: it opens the file, checks the header and the segment checksums, and serves the payload,
//! without Python. Blocks fetched here are written here too, by a writer thread, whole, under a temporary
//! name beside their place; the index (diskcache's SQLite: sizes, access times, eviction, the bound and the
//! free-space reserve) stays in Python for now, so a Python thread of the mount takes the written files and
//! publishes them (DiskTier.adopt: a row, then the rename), off the path of any request. The queue is
//! bounded; a block that finds no room within ROOM_WAIT is not written (counted).

use std::collections::VecDeque;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use blake2::Blake2b;
use blake2::digest::Digest;
use blake2::digest::consts::U16;

use super::block_file::{self, BlockError};
use super::memory::Block;
use crate::sync::lock;

#[derive(Default)]
pub struct DiskStats {
    pub hits: AtomicU64,
    pub bytes_read: AtomicU64,
    pub corrupt: AtomicU64,
    pub read_errors: AtomicU64,
    /// Blocks queued for writing, and those not written: no room in the queue within ROOM_WAIT, or the
    /// write failed.
    pub queued: AtomicU64,
    pub dropped: AtomicU64,
    pub write_errors: AtomicU64,
}

/// How long a fetch that queues its block waits for room before the block goes unwritten: the disk
/// slower than the network for that long.
const ROOM_WAIT: Duration = Duration::from_secs(1);

/// Blocks waiting for the writer thread.
struct WriteQueue {
    blocks: VecDeque<(String, Block)>,
    bytes: usize,
    closed: bool,
}

/// Block files written, waiting to be published by the index's owner: (key, temporary path, length).
#[derive(Default)]
struct Written {
    files: Vec<(String, PathBuf, usize)>,
    done: bool,
}

pub struct DiskTier {
    /// The disk tier's `blocks` folder: `<cache dir>/blocks`.
    blocks_dir: PathBuf,
    queue: Mutex<WriteQueue>,
    /// A block queued (for the writer), or room made (for those queueing).
    changed: Condvar,
    /// Bytes of blocks waiting to be written, at most (as the Python disk writer's WRITE_BEHIND_BYTES).
    queue_bound: usize,
    written: Mutex<Written>,
    published: Condvar,
    next_temporary: AtomicU64,
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
    /// The disk tier of `cache_dir`, with its writer thread started.
    pub fn start(cache_dir: &Path, queue_bound: usize) -> std::io::Result<Arc<Self>> {
        let tier = Arc::new(DiskTier {
            blocks_dir: cache_dir.join("blocks"),
            queue: Mutex::new(WriteQueue {
                blocks: VecDeque::new(),
                bytes: 0,
                closed: false,
            }),
            changed: Condvar::new(),
            queue_bound,
            written: Mutex::new(Written::default()),
            published: Condvar::new(),
            next_temporary: AtomicU64::new(0),
            stats: DiskStats::default(),
        });
        let writer = tier.clone();
        std::thread::Builder::new()
            .name("pffs-disk-writer".into())
            .spawn(move || writer.write_queued())?;
        Ok(tier)
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
            Err(err) => {
                self.failed_read(&path, err);
                None
            }
        }
    }

    /// Bytes [start, end) of the block of `length` bytes, only the segments they touch read and checked:
    /// a random read of a block not in memory takes what it needs, not the whole block. None if the
    /// block is not here (a damaged one is removed and counted, as in `read`).
    pub fn read_range(
        &self,
        key: &str,
        length: usize,
        start: usize,
        end: usize,
    ) -> Option<Vec<u8>> {
        let path = self.path(key);
        let mut buf = vec![0u8; block_file::range_room(start, end)];
        // SAFETY: `buf` is its own length of writable bytes, used by nothing else during the call.
        let read = unsafe {
            block_file::read_block_range_into_raw(
                &path,
                start,
                end,
                None,
                false,
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
        match read {
            Ok((_, _, header)) if header.length != length => {
                self.drop_damaged(
                    &path,
                    &format!("{} bytes where {length} were expected", header.length),
                );
                None
            }
            Ok((offset, count, _)) => {
                self.stats.hits.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_read
                    .fetch_add(count as u64, Ordering::Relaxed);
                buf.truncate(offset + count);
                buf.drain(..offset);
                Some(buf)
            }
            Err(err) => {
                self.failed_read(&path, err);
                None
            }
        }
    }

    /// A read that found no usable block: a damaged file is removed and counted, any other failure said.
    fn failed_read(&self, path: &Path, err: BlockError) {
        match err {
            BlockError::Io(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            BlockError::Corrupt(why) => self.drop_damaged(path, &why),
            BlockError::Io(err) => {
                self.stats.read_errors.fetch_add(1, Ordering::Relaxed);
                crate::log::warn(&format!(
                    "disk cache read of {} failed ({err}); reading from the backend",
                    path.display()
                ));
            }
        }
    }

    fn drop_damaged(&self, path: &Path, why: &str) {
        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
        crate::log::warn(&format!(
            "dropped a damaged disk-cache block {} ({why}); fetching it again",
            path.display()
        ));
        let _ = std::fs::remove_file(path);
    }

    /// Queues a fetched block for the writer thread, waiting up to ROOM_WAIT for room; false (counted)
    /// if there was none, or the tier is closed.
    pub fn queue_write(&self, key: String, block: Block) -> bool {
        let queue = lock(&self.queue);
        let (mut queue, _) = self
            .changed
            .wait_timeout_while(queue, ROOM_WAIT, |q| {
                !q.closed && q.bytes > 0 && q.bytes + block.len() > self.queue_bound
            })
            .unwrap_or_else(|e| e.into_inner());
        if queue.closed || (queue.bytes > 0 && queue.bytes + block.len() > self.queue_bound) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        queue.bytes += block.len();
        queue.blocks.push_back((key, block));
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.changed.notify_all();
        true
    }

    /// The writer thread: each queued block written whole under a temporary name beside its place,
    /// for the index's owner to publish; until closed and drained.
    fn write_queued(&self) {
        loop {
            let next = {
                let queue = lock(&self.queue);
                let mut queue = self
                    .changed
                    .wait_while(queue, |q| q.blocks.is_empty() && !q.closed)
                    .unwrap_or_else(|e| e.into_inner());
                queue.blocks.pop_front()
            };
            let Some((key, block)) = next else {
                break; // closed, and nothing left
            };
            let written = self.write_temporary(&key, &block);
            {
                let mut queue = lock(&self.queue);
                queue.bytes -= block.len();
                self.changed.notify_all();
            }
            if let Some(temporary) = written {
                let mut written = lock(&self.written);
                written.files.push((key, temporary, block.len()));
                self.published.notify_all();
            }
        }
        let mut written = lock(&self.written);
        written.done = true;
        self.published.notify_all();
    }

    /// The block file (header, then payload) under a temporary name beside where it goes.
    fn write_temporary(&self, key: &str, block: &[u8]) -> Option<PathBuf> {
        let path = self.path(key);
        let serial = self.next_temporary.fetch_add(1, Ordering::Relaxed);
        let temporary = PathBuf::from(format!(
            "{}.{}.n{serial}.tmp",
            path.display(),
            std::process::id()
        ));
        let result = (|| -> std::io::Result<()> {
            if let Some(folder) = path.parent() {
                std::fs::create_dir_all(folder)?;
            }
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(&block_file::block_header(block))?;
            file.write_all(block)
        })();
        match result {
            Ok(()) => Some(temporary),
            Err(err) => {
                self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                let _ = std::fs::remove_file(&temporary);
                crate::log::warn(&format!(
                    "could not write a block to the disk cache in {} ({err}); reads go on without it",
                    self.blocks_dir.display()
                ));
                None
            }
        }
    }

    /// The block files written since the last call, as (key, temporary path, payload length), for
    /// the index's owner to publish (pffs's Python DiskTier.adopt): waits up to `wait` for one. Empty
    /// once closed and everything was taken.
    pub fn take_written(&self, wait: Duration) -> Vec<(String, PathBuf, usize)> {
        let written = lock(&self.written);
        let (mut written, _) = self
            .published
            .wait_timeout_while(written, wait, |w| w.files.is_empty() && !w.done)
            .unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut written.files)
    }

    /// No more blocks are queued; the writer writes what is queued, then take_written says it is done.
    pub fn close(&self) {
        let mut queue = lock(&self.queue);
        queue.closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let tier = DiskTier::start(&dir, 1 << 20).unwrap();
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let path = tier.path("k-1");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut file = block_file::block_header(&payload);
        file.extend_from_slice(&payload);
        std::fs::write(&path, &file).unwrap();
        assert_eq!(tier.read("k-1", payload.len()).unwrap(), payload);
        assert!(tier.read("k-2", 10).is_none());
        for (start, end) in [(0, 1), (40_000, 72_000), (99_999, 100_000), (5, 100_000)] {
            let range = tier.read_range("k-1", payload.len(), start, end).unwrap();
            assert_eq!(range, payload[start..end], "{start}..{end}");
        }
        // A block of another length than its key says is damaged: dropped.
        assert!(tier.read_range("k-1", 99, 0, 10).is_none());
        assert!(!path.exists());
        std::fs::write(&path, &file).unwrap();
        let last = file.len() - 1;
        file[last] ^= 1;
        std::fs::write(&path, &file).unwrap();
        assert!(tier.read("k-1", payload.len()).is_none());
        assert!(!path.exists(), "a damaged block stays");
        assert_eq!(tier.stats.corrupt.load(Ordering::Relaxed), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn queued_blocks_are_written_whole_for_the_index_to_publish() {
        let dir = std::env::temp_dir().join(format!("pffs-disk-writes-{}", std::process::id()));
        let tier = DiskTier::start(&dir, 1 << 20).unwrap();
        let payload: Vec<u8> = (0..70_000u32).map(|i| (i * 13) as u8).collect();
        assert!(tier.queue_write("w-1".into(), Arc::new(payload.clone())));
        assert!(tier.queue_write("w-2".into(), Arc::new(vec![7; 10])));
        tier.close();
        let mut written = Vec::new();
        loop {
            let taken = tier.take_written(Duration::from_secs(5));
            if taken.is_empty() {
                break;
            }
            written.extend(taken);
        }
        let keys: Vec<_> = written.iter().map(|(k, _, _)| k.as_str()).collect();
        assert_eq!(keys, ["w-1", "w-2"]);
        // Published (renamed into place), the file is a block the reader accepts.
        let (_, temporary, length) = &written[0];
        std::fs::rename(temporary, tier.path("w-1")).unwrap();
        assert_eq!(tier.read("w-1", *length).unwrap(), payload);
        assert!(!tier.queue_write("late".into(), Arc::new(vec![1])));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
