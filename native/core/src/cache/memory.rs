//! The memory tier of the native engine: blocks of one object version each, under a hard byte bound,
//! least recently used out first; and single flight: readers of a block being fetched wait for that
//! fetch instead of starting their own (the kernel sends a file's pages again, one by one, when a read
//! fails or several processes read one file at once).
//!
//! A block is keyed by the object's key, its ETag (the version the reader pinned at open) and its
//! index: a changed object's blocks are other keys, so old and new bytes never mix; the old ones age out.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex};

use crate::sync::lock;

/// One block of one version of one object.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub key: Arc<str>,
    pub etag: Arc<str>,
    pub index: u64,
}

pub type Block = Arc<Vec<u8>>;

/// A fetch's failure, shared by everyone who waited for it: an errno and what happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchError {
    pub errno: i32,
    pub message: String,
}

/// One fetch in progress: its result, once there is one, for the readers waiting on it.
struct Flight {
    result: Mutex<Option<Result<Block, FetchError>>>,
    done: Condvar,
}

struct Entry {
    block: Block,
    used: u64, // the tick of its last use: its place in `State::order`
    /// Fetched ahead of its reader and not read yet: its first read is a prefetch hit, not a hit.
    ahead: bool,
}

/// Where a block a reader got came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// Held, and read before (or fetched for a reader).
    Hit,
    /// Held, fetched ahead for this reader.
    PrefetchHit,
    /// Fetched for this reader (or by another reader's fetch it waited for).
    Fetched,
}

#[derive(Default)]
struct State {
    blocks: HashMap<BlockKey, Entry>,
    order: BTreeMap<u64, BlockKey>, // least recently used first
    bytes: usize,
    tick: u64,
    flights: HashMap<BlockKey, Arc<Flight>>,
}

/// Counters of the tier, for `stats` (all since the engine started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub hits: u64,
    pub prefetch_hits: u64,
    pub misses: u64,
    pub prefetches: u64,
    pub shared_waits: u64,
    pub evictions: u64,
    pub bytes: u64,
    pub blocks: u64,
}

pub struct MemoryTier {
    capacity: usize,
    state: Mutex<State>,
    stats: Mutex<MemoryStats>,
}

impl MemoryTier {
    /// A tier holding at most `capacity` bytes of blocks (a block larger than that is served, not kept).
    pub fn new(capacity: usize) -> Self {
        MemoryTier {
            capacity,
            state: Mutex::new(State::default()),
            stats: Mutex::new(MemoryStats::default()),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The block if the tier holds it (and it becomes the most recently used).
    pub fn get(&self, key: &BlockKey) -> Option<(Block, Served)> {
        let found = lock(&self.state).touch(key);
        if let Some((_, served)) = found {
            self.count_hit(served);
        }
        found
    }

    fn count_hit(&self, served: Served) {
        let mut stats = lock(&self.stats);
        match served {
            Served::PrefetchHit => stats.prefetch_hits += 1,
            _ => stats.hits += 1,
        }
    }

    /// Whether the block is held (no use counted).
    pub fn contains(&self, key: &BlockKey) -> bool {
        lock(&self.state).blocks.contains_key(key)
    }

    /// Whether the block is held or being fetched (no use counted: for read-ahead to skip it).
    pub fn holds(&self, key: &BlockKey) -> bool {
        let state = lock(&self.state);
        state.blocks.contains_key(key) || state.flights.contains_key(key)
    }

    /// The block: from the tier, or from the fetch another reader has in progress, or from `fetch` run
    /// here (its block kept in the tier). Every reader of one missing block waits for one fetch, and
    /// gets its failure too. `ahead`: fetched for a reader still to come (read-ahead), which counts
    /// it as a prefetch, and its first read as a prefetch hit.
    pub fn get_or_fetch(
        &self,
        key: &BlockKey,
        ahead: bool,
        fetch: impl FnOnce() -> Result<Vec<u8>, FetchError>,
    ) -> Result<(Block, Served), FetchError> {
        let (flight, mine) = {
            let mut state = lock(&self.state);
            if let Some((block, served)) = state.touch(key) {
                drop(state);
                self.count_hit(served);
                return Ok((block, served));
            }
            match state.flights.get(key) {
                Some(flight) => (flight.clone(), false),
                None => {
                    let flight = Arc::new(Flight {
                        result: Mutex::new(None),
                        done: Condvar::new(),
                    });
                    state.flights.insert(key.clone(), flight.clone());
                    (flight, true)
                }
            }
        };
        if !mine {
            lock(&self.stats).shared_waits += 1;
            let mut result = lock(&flight.result);
            while result.is_none() {
                result = flight.done.wait(result).unwrap_or_else(|e| e.into_inner());
            }
            let result = result.clone().unwrap_or_else(|| unreachable!());
            return result.map(|block| (block, Served::Fetched));
        }
        if ahead {
            lock(&self.stats).prefetches += 1;
        } else {
            lock(&self.stats).misses += 1;
        }
        // The flight is ended whatever happens, a panic included: its waiters never wait forever.
        let mut ending = FlightEnding {
            tier: self,
            key,
            flight: &flight,
            ahead,
            result: None,
        };
        let result = fetch().map(Arc::new);
        ending.result = Some(result.clone());
        drop(ending);
        result.map(|block| (block, Served::Fetched))
    }

    /// Keeps `block` (evicting the least recently used to make room), unless it alone exceeds the bound.
    fn insert(&self, key: &BlockKey, block: &Block, ahead: bool) {
        if block.len() > self.capacity {
            return;
        }
        let mut state = lock(&self.state);
        let mut evicted = 0;
        while state.bytes + block.len() > self.capacity {
            let Some((_, oldest)) = state.order.pop_first() else {
                break;
            };
            if let Some(entry) = state.blocks.remove(&oldest) {
                state.bytes -= entry.block.len();
                evicted += 1;
            }
        }
        state.tick += 1;
        let tick = state.tick;
        if let Some(previous) = state.blocks.insert(
            key.clone(),
            Entry {
                block: block.clone(),
                used: tick,
                ahead,
            },
        ) {
            state.order.remove(&previous.used);
            state.bytes -= previous.block.len();
        }
        state.order.insert(tick, key.clone());
        state.bytes += block.len();
        let (bytes, blocks) = (state.bytes as u64, state.blocks.len() as u64);
        drop(state);
        let mut stats = lock(&self.stats);
        stats.evictions += evicted;
        stats.bytes = bytes;
        stats.blocks = blocks;
    }

    pub fn stats(&self) -> MemoryStats {
        *lock(&self.stats)
    }
}

impl State {
    fn touch(&mut self, key: &BlockKey) -> Option<(Block, Served)> {
        self.tick += 1;
        let tick = self.tick;
        let entry = self.blocks.get_mut(key)?;
        let before = std::mem::replace(&mut entry.used, tick);
        let served = if std::mem::take(&mut entry.ahead) {
            Served::PrefetchHit
        } else {
            Served::Hit
        };
        let block = entry.block.clone();
        self.order.remove(&before);
        self.order.insert(tick, key.clone());
        Some((block, served))
    }
}

/// Ends a flight when dropped: keeps its block, hands the result to its waiters (a failure if the fetch
/// panicked) and removes it, so the next reader of a failed block tries again.
struct FlightEnding<'a> {
    tier: &'a MemoryTier,
    key: &'a BlockKey,
    flight: &'a Arc<Flight>,
    ahead: bool,
    result: Option<Result<Block, FetchError>>,
}

impl Drop for FlightEnding<'_> {
    fn drop(&mut self) {
        let result = self.result.take().unwrap_or_else(|| {
            Err(FetchError {
                errno: libc::EIO,
                message: "the fetch of this block failed unexpectedly".into(),
            })
        });
        if let Ok(block) = &result {
            self.tier.insert(self.key, block, self.ahead);
        }
        lock(&self.tier.state).flights.remove(self.key);
        *lock(&self.flight.result) = Some(result);
        self.flight.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;
    use std::time::Duration;

    fn key(name: &str, index: u64) -> BlockKey {
        BlockKey {
            key: name.into(),
            etag: "\"e\"".into(),
            index,
        }
    }

    #[test]
    fn keeps_blocks_within_its_bound_least_recently_used_out_first() {
        let tier = MemoryTier::new(30);
        for i in 0..3 {
            tier.get_or_fetch(&key("a", i), false, || Ok(vec![i as u8; 10]))
                .unwrap();
        }
        assert!(tier.get(&key("a", 0)).is_some()); // now the most recent: block 1 is the oldest
        tier.get_or_fetch(&key("a", 3), false, || Ok(vec![3; 10]))
            .unwrap();
        assert!(tier.get(&key("a", 1)).is_none());
        assert_eq!(*tier.get(&key("a", 0)).unwrap().0, vec![0; 10]);
        let stats = tier.stats();
        assert_eq!((stats.bytes, stats.blocks, stats.evictions), (30, 3, 1));
    }

    #[test]
    fn a_block_fetched_ahead_is_a_prefetch_hit_once_then_a_hit() {
        let tier = MemoryTier::new(100);
        tier.get_or_fetch(&key("a", 1), true, || Ok(vec![1; 4]))
            .unwrap();
        assert_eq!(tier.get(&key("a", 1)).unwrap().1, Served::PrefetchHit);
        assert_eq!(tier.get(&key("a", 1)).unwrap().1, Served::Hit);
        let stats = tier.stats();
        assert_eq!(
            (
                stats.prefetches,
                stats.prefetch_hits,
                stats.hits,
                stats.misses
            ),
            (1, 1, 1, 0)
        );
    }

    #[test]
    fn a_block_larger_than_the_bound_is_served_not_kept() {
        let tier = MemoryTier::new(8);
        let (block, _) = tier
            .get_or_fetch(&key("big", 0), false, || Ok(vec![1; 9]))
            .unwrap();
        assert_eq!(block.len(), 9);
        assert_eq!(tier.stats().bytes, 0);
    }

    #[test]
    fn other_versions_are_other_blocks() {
        let tier = MemoryTier::new(100);
        tier.get_or_fetch(&key("a", 0), false, || Ok(vec![1; 4]))
            .unwrap();
        let mut changed = key("a", 0);
        changed.etag = "\"f\"".into();
        let (block, _) = tier
            .get_or_fetch(&changed, false, || Ok(vec![2; 4]))
            .unwrap();
        assert_eq!(*block, vec![2; 4]);
    }

    #[test]
    fn readers_of_one_missing_block_share_one_fetch_and_its_failure() {
        let tier = Arc::new(MemoryTier::new(1 << 20));
        let fetches = Arc::new(AtomicUsize::new(0));
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let (tier, fetches) = (tier.clone(), fetches.clone());
                thread::spawn(move || {
                    tier.get_or_fetch(&key("slow", 0), false, || {
                        fetches.fetch_add(1, Ordering::SeqCst);
                        thread::sleep(Duration::from_millis(100));
                        Err(FetchError {
                            errno: libc::ETIMEDOUT,
                            message: "timed out".into(),
                        })
                    })
                })
            })
            .collect();
        for reader in readers {
            assert_eq!(reader.join().unwrap().unwrap_err().errno, libc::ETIMEDOUT);
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        // A failure is not kept: the next reader fetches again.
        let (block, _) = tier
            .get_or_fetch(&key("slow", 0), false, || Ok(vec![7; 3]))
            .unwrap();
        assert_eq!(*block, vec![7; 3]);
    }

    #[test]
    fn a_fetch_that_panics_fails_its_waiters_instead_of_holding_them() {
        let tier = Arc::new(MemoryTier::new(1 << 20));
        let waiter = {
            let tier = tier.clone();
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(50));
                tier.get_or_fetch(&key("p", 0), false, || Ok(vec![1]))
            })
        };
        let panicking = {
            let tier = tier.clone();
            thread::spawn(move || {
                let _ = tier.get_or_fetch(&key("p", 0), false, || {
                    thread::sleep(Duration::from_millis(150));
                    panic!("fetch bug")
                });
            })
        };
        assert!(panicking.join().is_err());
        // The waiter either shared the failed flight or fetched anew after it: never stuck.
        match waiter.join().unwrap() {
            Ok((block, _)) => assert_eq!(*block, vec![1]),
            Err(err) => assert_eq!(err.errno, libc::EIO),
        }
    }
}
