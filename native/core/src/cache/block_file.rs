//! The block file format of the disk tier, and reading it: a header with the payload's length and one
//! checksum per 32 KiB segment, padded with zeros to a multiple of 4 KiB, then the payload.
//!
//! ```text
//! "PFB3" | length: u64 LE | segments: u32 LE | xxh3-64 of each segment: u64 LE ... | zeros to 4 KiB | payload
//! ```
//!
//! The padding puts the payload on a page boundary of the file, so a page-aligned buffer can be read (and
//! written) with O_DIRECT. A block that is truncated, longer than its header says, bit-flipped, or not in
//! this layout fails its check and is never served. `cache/block_format.py` writes the same layout and
//! calls these readers; block files written before the native core stay valid.

use std::alloc::{Layout, alloc, dealloc};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use super::checksum::segment_digests;

pub const MAGIC: [u8; 4] = *b"PFB3";
pub const SEGMENT: usize = 32 << 10;
pub const HEADER_ALIGN: usize = 4096;
const FIXED: usize = 4 + 8 + 4; // magic, payload length, segment count
const DIGEST: usize = 8;
/// One read gets the header of any block up to 32 MiB.
const FIRST_READ: usize = 8192;
const PAGE: usize = 4096;
/// No block is this long (blocks are MiBs): a header that says more is damaged, not read.
const MAX_LENGTH: usize = 1 << 40;

/// Why a block cannot be served: the file could not be read, or it is not a block of ours, whole.
#[derive(Debug)]
pub enum BlockError {
    Io(io::Error),
    Corrupt(String),
}

impl fmt::Display for BlockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockError::Io(err) => err.fmt(f),
            BlockError::Corrupt(why) => f.write_str(why),
        }
    }
}

impl From<io::Error> for BlockError {
    fn from(err: io::Error) -> Self {
        BlockError::Io(err)
    }
}

fn corrupt(why: impl Into<String>) -> BlockError {
    BlockError::Corrupt(why.into())
}

pub fn segments(length: usize) -> usize {
    length.div_ceil(SEGMENT)
}

/// Where the payload starts: the header, padded to a multiple of HEADER_ALIGN.
pub fn header_size(length: usize) -> usize {
    (FIXED + DIGEST * segments(length)).div_ceil(HEADER_ALIGN) * HEADER_ALIGN
}

/// The header of a block file holding `payload` (padding included).
pub fn block_header(payload: &[u8]) -> Vec<u8> {
    let digests = segment_digests(payload, SEGMENT);
    let mut header = Vec::with_capacity(header_size(payload.len()));
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    header.extend_from_slice(&(digests.len() as u32).to_le_bytes());
    for digest in digests {
        header.extend_from_slice(&digest.to_le_bytes());
    }
    header.resize(header_size(payload.len()), 0);
    header
}

/// A parsed header: the payload's length, its segments' digests, and where the payload starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub length: usize,
    pub digests: Vec<u64>,
    pub size: usize,
}

/// The header at the start of `bytes` (which may go on past it).
pub fn parse_header(bytes: &[u8]) -> Result<Header, BlockError> {
    if bytes.len() < FIXED {
        return Err(corrupt(format!(
            "block shorter than its header ({} bytes)",
            bytes.len()
        )));
    }
    let magic = &bytes[..4];
    let length = u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    let length = usize::try_from(length).map_err(|_| corrupt("bad block header"))?;
    if magic != MAGIC || count != segments(length) {
        return Err(corrupt("bad block header"));
    }
    let size = header_size(length);
    if bytes.len() < size {
        return Err(corrupt("block header truncated"));
    }
    let digests = bytes[FIXED..FIXED + DIGEST * count]
        .chunks_exact(DIGEST)
        .map(|d| u64::from_le_bytes(d.try_into().expect("8 bytes")))
        .collect();
    Ok(Header {
        length,
        digests,
        size,
    })
}

/// Checks `data`, which holds whole segments (the last one possibly short) from segment `first` on.
pub fn check_segments(digests: &[u64], first: usize, data: &[u8]) -> Result<(), BlockError> {
    let got = segment_digests(data, SEGMENT);
    if digests.get(first..first + got.len()) != Some(&got[..]) {
        return Err(corrupt("block checksum mismatch"));
    }
    Ok(())
}

/// A page-aligned buffer of bytes (O_DIRECT reads into it), for a block file's header. Not zeroed: only the
/// bytes a read filled are ever looked at.
struct AlignedBuf {
    ptr: NonNull<u8>,
    capacity: usize,
    filled: usize,
}

// SAFETY: the buffer is owned memory with no interior mutability; moving or sharing it between threads is
// as safe as for a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Room for `capacity` bytes (rounded up to a page), starting on a page boundary, none filled yet.
    fn with_capacity(capacity: usize) -> AlignedBuf {
        let capacity = capacity.max(1).div_ceil(PAGE) * PAGE;
        let layout = Layout::from_size_align(capacity, PAGE).expect("a valid layout");
        // SAFETY: the layout has a non-zero size; `dealloc` in Drop uses the same layout.
        let raw = unsafe { alloc(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf {
            ptr,
            capacity,
            filled: 0,
        }
    }

    /// Fills the buffer from the start of `file` until it is full or the file ends; returns the bytes
    /// read.
    fn fill_from(&mut self, file: &File) -> io::Result<usize> {
        // SAFETY: `capacity` bytes are allocated at `ptr`; a slice is formed only over the bytes pread
        // wrote (as_slice).
        self.filled = unsafe { read_full_raw(file, self.ptr.as_ptr(), self.capacity, 0)? };
        Ok(self.filled)
    }

    /// The bytes read.
    fn as_slice(&self) -> &[u8] {
        // SAFETY: the first `filled` bytes are those pread wrote.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.filled) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.capacity, PAGE).expect("a valid layout");
        // SAFETY: allocated in `with_capacity` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// O_DIRECT goes off for good (for this process) once a file system refuses it (tmpfs).
static DIRECT_SUPPORTED: AtomicBool = AtomicBool::new(true);

fn open_for_read(path: &Path, direct: bool, random: bool) -> io::Result<File> {
    if direct && DIRECT_SUPPORTED.load(Ordering::Relaxed) {
        match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => return Ok(file),
            Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
                DIRECT_SUPPORTED.store(false, Ordering::Relaxed)
            }
            Err(err) => return Err(err),
        }
    }
    let file = File::open(path)?;
    if random {
        // A range read must not make the kernel read ahead up to the disk's read-ahead (8 MiB here).
        // SAFETY: a plain syscall on an open descriptor; a failure only costs speed.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    }
    Ok(file)
}

/// The header of an open block file. Reads whole pages into an aligned buffer: works with O_DIRECT.
fn read_header(file: &File) -> Result<Header, BlockError> {
    let mut head = AlignedBuf::with_capacity(FIRST_READ);
    let got = head.fill_from(file)?;
    let mut bytes = head.as_slice();
    let length = if got >= FIXED {
        u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes")) as usize
    } else {
        0
    };
    if length > MAX_LENGTH {
        return Err(corrupt("bad block header"));
    }
    let size = header_size(length);
    let mut longer;
    if size > got && got == FIRST_READ {
        longer = AlignedBuf::with_capacity(size);
        longer.fill_from(file)?;
        bytes = longer.as_slice();
    }
    parse_header(&bytes[..bytes.len().min(size)])
}

/// The payload length of the block file at `path`, from its header.
pub fn payload_length(path: &Path) -> Result<usize, BlockError> {
    Ok(read_header(&open_for_read(path, false, false)?)?.length)
}

/// The verified payload of the block file at `path`, which holds `expected` bytes, in a buffer of its
/// own: the header read first, then the payload straight into place (two reads, no copy to move it).
pub fn read_payload(path: &Path, expected: usize) -> Result<Vec<u8>, BlockError> {
    let file = open_for_read(path, false, false)?;
    let header = read_header(&file)?;
    if header.length != expected {
        return Err(corrupt(format!(
            "block of {} bytes where {} were expected",
            header.length, expected
        )));
    }
    let stored = file.metadata()?.len();
    if stored != (header.size + expected) as u64 {
        return Err(corrupt(format!(
            "block truncated or too long: {} bytes, header says {}",
            stored.saturating_sub(header.size as u64),
            expected
        )));
    }
    let mut payload = Vec::with_capacity(expected);
    // SAFETY: `payload` has room for `expected` bytes; only those pread wrote are made visible.
    unsafe {
        let got = read_full_raw(&file, payload.as_mut_ptr(), expected, header.size as u64)?;
        payload.set_len(got);
    }
    if payload.len() != expected {
        return Err(corrupt("block truncated while read".to_string()));
    }
    check_segments(&header.digests, 0, &payload)?;
    Ok(payload)
}

/// Reads the block file at `path`, whose payload is `expected` bytes, into `buf` as it is stored (header,
/// then the payload from header_size(expected) on) and verifies it: one read. `buf` needs room for more
/// than the file should hold (a longer file is corrupt too). `direct`: O_DIRECT, around the page cache,
/// when `buf` starts on a page boundary and is whole pages long.
pub fn read_block_into(
    path: &Path,
    buf: &mut [u8],
    expected: usize,
    direct: bool,
) -> Result<(), BlockError> {
    // SAFETY: `buf` is `buf.len()` writable bytes.
    unsafe { read_block_into_raw(path, buf.as_mut_ptr(), buf.len(), expected, direct) }
}

/// read_block_into for `len` bytes at `ptr` that need not be initialised: only those the read wrote are
/// looked at.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes, and nothing else may use them during the call.
pub unsafe fn read_block_into_raw(
    path: &Path,
    ptr: *mut u8,
    len: usize,
    expected: usize,
    direct: bool,
) -> Result<(), BlockError> {
    let size = header_size(expected);
    if len <= size + expected {
        return Err(BlockError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the buffer has no room past the block",
        )));
    }
    let direct = direct && (ptr as usize) % PAGE == 0 && len % PAGE == 0;
    let file = open_for_read(path, direct, false)?;
    // SAFETY: the caller's promise; the slice covers only the bytes pread wrote.
    let stored = unsafe {
        let got = read_full_raw(&file, ptr, len, 0)?;
        std::slice::from_raw_parts(ptr, got)
    };
    let header = parse_header(&stored[..stored.len().min(size)])?;
    if header.length != expected {
        return Err(corrupt(format!(
            "block of {} bytes where {} were expected",
            header.length, expected
        )));
    }
    if stored.len() != size + expected {
        return Err(corrupt(format!(
            "block truncated or too long: {} bytes, header says {}",
            stored.len().saturating_sub(size),
            expected
        )));
    }
    check_segments(&header.digests, 0, &stored[size..])
}

/// Reads from `offset` of `file` into the `len` bytes at `ptr` until they are full or the file ends;
/// returns the bytes read.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes.
unsafe fn read_full_raw(file: &File, ptr: *mut u8, len: usize, offset: u64) -> io::Result<usize> {
    let mut filled = 0;
    while filled < len {
        let at = libc::off_t::try_from(offset + filled as u64)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: at most len - filled bytes past `filled`, within the caller's `len`.
        let n = unsafe { libc::pread(file.as_raw_fd(), ptr.add(filled).cast(), len - filled, at) };
        match n {
            0 => break,
            n if n > 0 => filled += n as usize,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(filled)
}

/// The bytes of a block file's payload a range read needs in its buffer: the segments [start, end) lies in,
/// in whole pages (so O_DIRECT can read them); a buffer of this size serves any header.
pub fn range_room(start: usize, end: usize) -> usize {
    if start >= end {
        return 0;
    }
    ((end - 1) / SEGMENT + 1 - start / SEGMENT) * SEGMENT
}

/// Bytes [start, end) of a block file's payload (fewer past its end), reading and verifying only the
/// segments they lie in, into the `len` bytes at `ptr` (at least range_room(start, end)): returns where in
/// them the bytes start, how many there are, and the file's header (pass it back next time to skip reading
/// it: a random read then costs one disk read, not two). `direct`: O_DIRECT, when `ptr` is page-aligned.
/// The caller's buffer, not one of ours: a range read allocates nothing here but a header's first read.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes, and nothing else may use them during the call.
pub unsafe fn read_block_range_into_raw(
    path: &Path,
    start: usize,
    end: usize,
    header: Option<Header>,
    direct: bool,
    ptr: *mut u8,
    len: usize,
) -> Result<(usize, usize, Header), BlockError> {
    let direct = direct && (ptr as usize) % PAGE == 0;
    let file = open_for_read(path, direct, true)?;
    let header = match header {
        Some(header) => header,
        None => read_header(&file)?,
    };
    let end = end.min(header.length);
    if start >= end {
        return Ok((0, 0, header));
    }
    let (first, last) = (start / SEGMENT, (end - 1) / SEGMENT);
    let want = header.length.min((last + 1) * SEGMENT) - first * SEGMENT;
    let room = range_room(start, end);
    if len < room {
        return Err(BlockError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the buffer is smaller than the segments to read",
        )));
    }
    // SAFETY: the caller's promise for `len` >= `room` bytes; the slice covers only bytes pread wrote.
    let data = unsafe {
        let got = read_full_raw(&file, ptr, room, (header.size + first * SEGMENT) as u64)?;
        if got < want {
            return Err(corrupt(format!("block truncated: {got} of {want} bytes")));
        }
        std::slice::from_raw_parts(ptr, want)
    };
    check_segments(&header.digests, first, data)?;
    Ok((start - first * SEGMENT, end - start, header))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// read_block_range_into_raw into a Vec of its own: the bytes, and the header.
    fn read_block_range(
        path: &Path,
        start: usize,
        end: usize,
        header: Option<Header>,
    ) -> Result<(Vec<u8>, Header), BlockError> {
        let mut buf = vec![0u8; range_room(start, end)];
        // SAFETY: `buf` is its own length of writable bytes.
        let (offset, count, header) = unsafe {
            read_block_range_into_raw(path, start, end, header, false, buf.as_mut_ptr(), buf.len())?
        };
        Ok((buf[offset..offset + count].to_vec(), header))
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 % 251) as u8).collect()
    }

    fn block_file(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = dir.join(name);
        File::create(&path).unwrap().write_all(bytes).unwrap();
        path
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("pffs-core-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_block_reads_back_whole_and_in_ranges() {
        let dir = temp_dir("roundtrip");
        for len in [
            0,
            1,
            SEGMENT - 1,
            SEGMENT,
            SEGMENT + 1,
            3 * SEGMENT + 7,
            1 << 20,
        ] {
            let data = payload(len);
            let mut stored = block_header(&data);
            assert_eq!(stored.len(), header_size(len));
            assert_eq!(stored.len() % HEADER_ALIGN, 0);
            stored.extend_from_slice(&data);
            let path = block_file(&dir, &format!("b{len}"), &stored);
            assert_eq!(payload_length(&path).unwrap(), len);
            let mut buf = vec![0; stored.len() + 1];
            read_block_into(&path, &mut buf, len, false).unwrap();
            assert_eq!(&buf[header_size(len)..stored.len()], &data[..]);
            let (part, header) = read_block_range(&path, len / 3, len / 2 + 1, None).unwrap();
            assert_eq!(part, &data[len / 3..(len / 2 + 1).min(len)]);
            let (again, _) = read_block_range(&path, 0, len, Some(header)).unwrap();
            assert_eq!(again, data);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn damaged_blocks_are_refused() {
        let dir = temp_dir("damaged");
        let data = payload(100_000);
        let mut stored = block_header(&data);
        stored.extend_from_slice(&data);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("truncated", stored[..stored.len() - 1].to_vec()),
            ("longer", [&stored[..], b"x"].concat()),
            ("flipped", {
                let mut s = stored.clone();
                let at = s.len() - 5;
                s[at] ^= 1;
                s
            }),
            ("magic", {
                let mut s = stored.clone();
                s[0] = b'X';
                s
            }),
            ("empty", Vec::new()),
        ];
        for (name, bytes) in cases {
            let path = block_file(&dir, name, &bytes);
            let mut buf = vec![0; stored.len() + 4096];
            let got = read_block_into(&path, &mut buf, data.len(), false);
            assert!(matches!(got, Err(BlockError::Corrupt(_))), "{name}");
        }
        let path = block_file(&dir, "ok", &stored);
        let mut buf = vec![0; stored.len() + 4096];
        let shorter = read_block_into(&path, &mut buf, data.len() - 1, false);
        assert!(matches!(shorter, Err(BlockError::Corrupt(_))));
        let missing = read_block_into(&dir.join("missing"), &mut buf, data.len(), false);
        assert!(matches!(missing, Err(BlockError::Io(e)) if e.kind() == io::ErrorKind::NotFound));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
