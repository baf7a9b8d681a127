//! The checksum of the block format (`cache/block_format.py`): one xxh3-64 (seed 0) per segment of a block,
//! so a range read verifies only the segments it reads. The same function as the `xxhash` package's
//! `xxh3_64_intdigest`: block files written before the native core stay valid.

use xxhash_rust::xxh3::xxh3_64;

/// The xxh3-64 digest of each `segment`-byte piece of `data`, the last one possibly shorter; none for empty
/// `data`. `segment` must not be 0.
pub fn segment_digests(data: &[u8], segment: usize) -> Vec<u64> {
    assert!(segment > 0, "segment size 0");
    data.chunks(segment).map(xxh3_64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values from the xxHash project's `xxhsum -H3` (XXH3_64bits, seed 0).
    #[test]
    fn known_digests() {
        assert_eq!(xxh3_64(b""), 0x2d06800538d394c2);
        assert_eq!(xxh3_64(b"a"), 0xe6c632b61e964e1f);
        assert_eq!(xxh3_64(b"abc"), 0x78af5f94892f3950);
    }

    #[test]
    fn one_digest_per_segment_the_last_one_short() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let digests = segment_digests(&data, 32 << 10);
        assert_eq!(digests.len(), 4);
        assert_eq!(digests[0], xxh3_64(&data[..32 << 10]));
        assert_eq!(digests[3], xxh3_64(&data[3 * (32 << 10)..]));
        assert!(segment_digests(&[], 32 << 10).is_empty());
        assert_eq!(segment_digests(&data, data.len()), vec![xxh3_64(&data)]);
    }
}
