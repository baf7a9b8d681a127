//! The extension module `pffs._core`: the PyO3 binding of `pffs-core`, exposing to Python only what Python
//! calls. Every call that may take long releases the GIL while the core works (STYLE.md §16).

use pyo3::prelude::*;

/// See pffs_core::SOURCE_DIGEST: this crate is rebuilt too when native/'s sources change.
const _SOURCE_DIGEST: Option<&str> = option_env!("PFFS_NATIVE_SOURCE");

// A block file that is not one of ours, whole (`cache.block_format.CorruptBlockError` is this class).
pyo3::create_exception!(
    _core,
    CorruptBlockError,
    pyo3::exceptions::PyValueError,
    "A block file that is truncated, too long, bit-flipped or not in pffs's layout: never served."
);

// What an S3 GET can end in besides the network's OSErrors (pffs/backends/s3_native.py names them).
pyo3::create_exception!(
    _core,
    S3NotHandled,
    pyo3::exceptions::PyException,
    "Something the native S3 client does not do: the caller goes through another client."
);
pyo3::create_exception!(
    _core,
    S3ErrorAnswer,
    pyo3::exceptions::PyException,
    "An S3 error answer: args (status, body)."
);
pyo3::create_exception!(
    _core,
    S3ObjectChanged,
    pyo3::exceptions::PyException,
    "The object's ETag is no longer the one asked for."
);

#[pymodule]
mod _core {
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use pffs_core::backends::bucket::{Bucket, BucketConfig};
    use pffs_core::cache::disk::DiskTier;
    use pffs_core::fuse;
    use pffs_core::sync::lock;
    use pffs_core::vfs::namespace::{Namespace, NamespaceConfig};
    use pffs_core::vfs::reader::{Blocks, DiskUsage, ReaderConfig};

    use pffs_core::backends::s3_get::{self, GetError};
    use pffs_core::cache::block_file::{self, BlockError, Header};
    use pffs_core::cache::checksum::segment_digests;
    use pyo3::buffer::PyBuffer;
    use pyo3::exceptions::{PyBufferError, PyOSError, PyValueError};
    use pyo3::ffi;
    use pyo3::prelude::*;
    use pyo3::types::PyBytes;

    #[pymodule_export]
    use super::CorruptBlockError;
    #[pymodule_export]
    use super::{S3ErrorAnswer, S3NotHandled, S3ObjectChanged};

    /// Below this many bytes, hashing (a few microseconds) costs less than giving the GIL up and waiting
    /// to get it back while other threads want it.
    const DETACH_MIN: usize = 64 << 10;

    /// Runs `work` on the bytes of `data` (any C-contiguous buffer), without the GIL when they are
    /// DETACH_MIN or more.
    fn with_bytes<T: Send>(
        py: Python<'_>,
        data: &PyBuffer<u8>,
        work: impl FnOnce(&[u8]) -> T + Send,
    ) -> PyResult<T> {
        let len = data.len_bytes();
        if len == 0 {
            return Ok(work(&[]));
        }
        let bytes = data
            .as_slice_ptr()
            .ok_or_else(|| PyBufferError::new_err("the buffer is not C-contiguous"))?;
        let address = bytes.cast::<u8>().as_ptr() as usize;
        let run = move || {
            // SAFETY: `data` holds the exporter's buffer (PyObject_GetBuffer) until it is dropped after
            // this call returns, so the `len` bytes at `address` stay allocated and in place; they are
            // only read. As with hashlib, a Python thread writing into a mutable buffer meanwhile races
            // with the reader and gets a meaningless result, never a wild access.
            let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
            work(bytes)
        };
        Ok(if len >= DETACH_MIN {
            py.detach(run)
        } else {
            run()
        })
    }

    /// The address and length of a writable C-contiguous buffer, to read into without the GIL.
    fn writable(into: &PyBuffer<u8>) -> PyResult<(usize, usize)> {
        if into.readonly() {
            return Err(PyBufferError::new_err(
                "the buffer to read into is read-only",
            ));
        }
        if !into.is_c_contiguous() {
            return Err(PyBufferError::new_err("the buffer is not C-contiguous"));
        }
        Ok((into.buf_ptr() as usize, into.len_bytes()))
    }

    fn block_error(err: BlockError) -> PyErr {
        match err {
            BlockError::Io(err) => err.into(), // FileNotFoundError and the rest, as Python's own
            BlockError::Corrupt(why) => CorruptBlockError::new_err(why),
        }
    }

    /// The xxh3-64 digest (seed 0) of each `segment`-byte piece of `data` (any C-contiguous buffer of
    /// bytes), the last one possibly shorter: `xxhash.xxh3_64_intdigest` of each piece. The GIL is
    /// released while it hashes 64 KiB or more.
    #[pyfunction]
    fn xxh3_64_segments(py: Python<'_>, data: PyBuffer<u8>, segment: usize) -> PyResult<Vec<u64>> {
        if segment == 0 {
            return Err(PyValueError::new_err("segment size must be positive"));
        }
        with_bytes(py, &data, |bytes| segment_digests(bytes, segment))
    }

    /// Where a block file's payload of `length` bytes starts: its header's size, padding included.
    #[pyfunction]
    fn block_header_size(length: usize) -> usize {
        block_file::header_size(length)
    }

    /// The header of a block file holding `payload` (padded to its page boundary).
    #[pyfunction]
    fn block_header<'py>(py: Python<'py>, payload: PyBuffer<u8>) -> PyResult<Bound<'py, PyBytes>> {
        let header = with_bytes(py, &payload, block_file::block_header)?;
        Ok(PyBytes::new(py, &header))
    }

    /// (payload length, segment digests) of the header at the start of `data`; CorruptBlockError if it
    /// is not one of ours.
    #[pyfunction]
    fn parse_block_header(data: &[u8]) -> PyResult<(usize, Vec<u64>)> {
        let header = block_file::parse_header(data).map_err(block_error)?;
        Ok((header.length, header.digests))
    }

    /// Checks `data`, whole segments from segment number `first` on, against `digests`.
    #[pyfunction]
    fn check_block_segments(
        py: Python<'_>,
        digests: Vec<u64>,
        first: usize,
        data: PyBuffer<u8>,
    ) -> PyResult<()> {
        with_bytes(py, &data, |bytes| {
            block_file::check_segments(&digests, first, bytes)
        })?
        .map_err(block_error)
    }

    /// A block file's parsed header, kept by the caller to skip reading it again.
    #[pyclass(frozen, name = "BlockHeader")]
    struct BlockHeader {
        header: Header,
    }

    #[pymethods]
    impl BlockHeader {
        #[getter]
        fn length(&self) -> usize {
            self.header.length
        }
    }

    /// The payload length of the block file at `path`, from its header (CorruptBlockError if damaged,
    /// FileNotFoundError if absent).
    #[pyfunction]
    fn block_payload_length(py: Python<'_>, path: PathBuf) -> PyResult<usize> {
        py.detach(|| block_file::payload_length(&path))
            .map_err(block_error)
    }

    /// Reads the block file at `path`, whose payload is `expected_length` bytes, into `into` (a writable
    /// C-contiguous buffer with room for more than the file should hold) as stored, and verifies it
    /// (CorruptBlockError if damaged, FileNotFoundError if absent). `direct`: O_DIRECT, when `into` is
    /// page-aligned whole pages. Without the GIL. The caller allocates: the bytes stay Python's memory.
    #[pyfunction]
    #[pyo3(signature = (path, into, expected_length, direct=false))]
    fn read_block_into(
        py: Python<'_>,
        path: PathBuf,
        into: PyBuffer<u8>,
        expected_length: usize,
        direct: bool,
    ) -> PyResult<()> {
        let (address, len) = writable(&into)?;
        py.detach(move || {
            // SAFETY: `into` holds the exporter's writable buffer until it is dropped after this call
            // returns, so the `len` bytes at `address` stay allocated and in place. A Python thread using
            // them meanwhile races with the read, as with readinto: it sees meaningless bytes, never a
            // wild access.
            let buf = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) };
            block_file::read_block_into(&path, buf, expected_length, direct)
        })
        .map_err(block_error)
    }

    /// The block file at `path`, whose payload is `expected_length` bytes, as stored (the payload from
    /// block_header_size(expected_length) on, one byte of room after it), verified, in a new bytes
    /// object: the buffer the read went into, never zeroed first (os.pread's way). Without the GIL.
    #[pyfunction]
    fn read_block_bytes(
        py: Python<'_>,
        path: PathBuf,
        expected_length: usize,
    ) -> PyResult<Bound<'_, PyBytes>> {
        let len = block_file::header_size(expected_length) + expected_length + 1;
        let (bytes, address) = uninitialised_bytes(py, len)?;
        py.detach(move || {
            // SAFETY: the object above owns these `len` bytes, and nothing else refers to it until it
            // returns; only the bytes the read wrote are looked at.
            unsafe {
                block_file::read_block_into_raw(
                    &path,
                    address as *mut u8,
                    len,
                    expected_length,
                    false,
                )
            }
        })
        .map_err(block_error)?;
        Ok(bytes)
    }

    /// A new bytes object of `len` bytes, left uninitialised, and the address of its bytes: it must be
    /// filled (or dropped) before any Python code sees it.
    fn uninitialised_bytes(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyBytes>, usize)> {
        let size = ffi::Py_ssize_t::try_from(len).map_err(|_| PyValueError::new_err("too long"))?;
        // SAFETY: a NULL source makes a bytes object of `len` bytes left uninitialised, ours alone until
        // the caller returns it.
        let bytes = unsafe {
            let raw = ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
            Bound::from_owned_ptr_or_err(py, raw)?.cast_into_unchecked::<PyBytes>()
        };
        // SAFETY: PyBytes_AsString of a bytes object points at its `len` bytes (and a trailing NUL).
        let address = unsafe { ffi::PyBytes_AsString(bytes.as_ptr()) } as usize;
        Ok((bytes, address))
    }

    /// The buffer a range read of [start, end) needs: the segments it lies in, in whole pages.
    #[pyfunction]
    fn block_range_room(start: usize, end: usize) -> usize {
        block_file::range_room(start, end)
    }

    /// Bytes [start, end) of a block file's payload read into `into` (a writable C-contiguous buffer of at
    /// least block_range_room(start, end) bytes; page-aligned for `direct`), verifying only the segments
    /// they lie in: (where in `into` they start, how many, the file's header). Pass the header back next
    /// time: one disk read instead of two. Without the GIL.
    #[pyfunction]
    #[pyo3(signature = (path, start, end, into, header=None, direct=false))]
    fn read_block_range_into<'py>(
        py: Python<'py>,
        path: PathBuf,
        start: usize,
        end: usize,
        into: PyBuffer<u8>,
        header: Option<Bound<'py, BlockHeader>>,
        direct: bool,
    ) -> PyResult<(usize, usize, Bound<'py, BlockHeader>)> {
        let (address, len) = writable(&into)?;
        let known = header.as_ref().map(|h| h.get().header.clone());
        let (offset, count, read) = py
            .detach(move || {
                // SAFETY: `into` holds the exporter's writable buffer until it is dropped after this call
                // returns, so the `len` bytes at `address` stay allocated and in place.
                unsafe {
                    block_file::read_block_range_into_raw(
                        &path,
                        start,
                        end,
                        known,
                        direct,
                        address as *mut u8,
                        len,
                    )
                }
            })
            .map_err(block_error)?;
        let header = match header {
            Some(header) => header,
            None => Bound::new(py, BlockHeader { header: read })?,
        };
        Ok((offset, count, header))
    }

    /// S3 ranged GETs (pffs_core::backends::s3_get) for one region: signing keys are kept, connections
    /// are per OS thread.
    #[pyclass(frozen)]
    struct S3Client {
        signer: s3_get::Signer,
    }

    #[pymethods]
    impl S3Client {
        #[new]
        fn new(region: &str) -> Self {
            S3Client {
                signer: s3_get::Signer::new(region),
            }
        }

        /// Fills `into` (a writable C-contiguous buffer) with bytes [start, start + len(into)) of `key`,
        /// without the GIL. `endpoint`: (Host header, host to connect to, port, path prefix);
        /// `credentials`: (access key, secret key, session token) or None (unsigned); `timeouts`: (connect,
        /// read: the longest wait each, seconds; what is left of the call's deadline, seconds, or None).
        /// Raises S3NotHandled, S3ErrorAnswer(status, body), S3ObjectChanged or an OSError (ETIMEDOUT,
        /// ECONNRESET, ECONNREFUSED, EIO, ...).
        #[pyo3(signature = (endpoint, key, start, into, etag, version_id, credentials, timeouts))]
        #[allow(clippy::too_many_arguments)]
        fn get(
            &self,
            py: Python<'_>,
            endpoint: Endpoint,
            key: &str,
            start: u64,
            into: PyBuffer<u8>,
            etag: Option<&str>,
            version_id: Option<&str>,
            credentials: Option<Credentials>,
            timeouts: (f64, f64, Option<f64>),
        ) -> PyResult<()> {
            let (address, len) = writable(&into)?;
            let request = (
                &endpoint,
                key,
                start,
                etag,
                version_id,
                &credentials,
                timeouts,
            );
            // SAFETY: `into` holds the exporter's writable buffer until it is dropped after this call
            // returns, so the `len` bytes at `address` stay allocated and in place; a Python thread using
            // them meanwhile races with the read (as with recv_into), never a wild access.
            unsafe { self.get_raw(py, request, address, len) }
        }

        /// As get, into a new bytes object of `length` bytes (never zeroed first: every byte is received
        /// before it is returned), so a block needs neither a zeroed buffer nor a copy.
        #[pyo3(signature = (endpoint, key, start, length, etag, version_id, credentials, timeouts))]
        #[allow(clippy::too_many_arguments)]
        fn get_bytes<'py>(
            &self,
            py: Python<'py>,
            endpoint: Endpoint,
            key: &str,
            start: u64,
            length: usize,
            etag: Option<&str>,
            version_id: Option<&str>,
            credentials: Option<Credentials>,
            timeouts: (f64, f64, Option<f64>),
        ) -> PyResult<Bound<'py, PyBytes>> {
            let (bytes, address) = uninitialised_bytes(py, length)?;
            let request = (
                &endpoint,
                key,
                start,
                etag,
                version_id,
                &credentials,
                timeouts,
            );
            // SAFETY: the bytes object owns these `length` bytes, and nothing else refers to it until it
            // is returned, filled.
            unsafe { self.get_raw(py, request, address, length)? };
            Ok(bytes)
        }
    }

    type Endpoint = (String, String, u16, String);
    type Credentials = (String, String, Option<String>);
    type Request<'a> = (
        &'a Endpoint,
        &'a str,
        u64,
        Option<&'a str>,
        Option<&'a str>,
        &'a Option<Credentials>,
        (f64, f64, Option<f64>),
    );

    impl S3Client {
        /// The GET into the `len` bytes at `address`, without the GIL.
        ///
        /// # Safety
        /// The `len` bytes at `address` must stay allocated, and written by nothing else, until it returns.
        unsafe fn get_raw(
            &self,
            py: Python<'_>,
            request: Request<'_>,
            address: usize,
            len: usize,
        ) -> PyResult<()> {
            let (endpoint, key, start, etag, version_id, credentials, timeouts) = request;
            let (connect, read, left) = timeouts;
            let now = Instant::now();
            let get = s3_get::Get {
                endpoint: s3_get::Endpoint {
                    host: &endpoint.0,
                    connect_host: &endpoint.1,
                    port: endpoint.2,
                    path_prefix: &endpoint.3,
                },
                key,
                start,
                etag,
                version_id,
                credentials: credentials.as_ref().map(|(a, s, t)| s3_get::Credentials {
                    access_key: a,
                    secret_key: s,
                    token: t.as_deref(),
                }),
                timeouts: s3_get::Timeouts {
                    connect: seconds(connect),
                    read: seconds(read),
                    deadline: left.map(|l| now + seconds(l)),
                },
            };
            let outcome = py.detach(|| {
                // SAFETY: the caller keeps the `len` bytes at `address` allocated and ours alone.
                let buf = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len) };
                s3_get::get(&self.signer, &get, buf)
            });
            outcome.map_err(|err| match err {
                GetError::NotHandled(why) => S3NotHandled::new_err(why),
                GetError::Answer { status, body } => {
                    S3ErrorAnswer::new_err((status, PyBytes::new(py, &body).unbind()))
                }
                GetError::Changed => S3ObjectChanged::new_err(()),
                GetError::Io { errno, message } => os_error(errno, message),
            })
        }
    }

    /// A read-only mount served by the native engine (pffs_core::fuse): several threads read the FUSE
    /// connection and answer every request without Python. Made mounted; `wait` polls for its end (so
    /// Python's signal handlers run between polls), `unmount` ends it.
    #[pyclass(frozen)]
    struct NativeMount {
        /// (Behind a lock, not PyO3's borrow flag: the disk-writes thread is in take_writes while the
        /// main thread unmounts.)
        mounted: Mutex<fuse::Mounted>,
        blocks: Arc<Blocks>,
        served: fuse::ServeConfig,
    }

    #[pymethods]
    impl NativeMount {
        /// `bucket`: (Host header, host to connect to, port, path prefix, region, credentials or None,
        /// (connect, read, deadline) seconds); `root`: (the bucket's name, the mount root's key prefix:
        /// "" or ending in "/"); `cache`: (memory bytes, block size, blocks read ahead, background fetches); `names`:
        /// (dir TTL, stale-if-error, attr TTL) seconds; `shown`: (uid, gid, file mode, dir mode, allow
        /// other, threads, fsname, source URL, root URL); `disk`: (the cache directory whose disk tier
        /// is read, the bytes of fetched blocks queued for `take_writes` at most), or None (memory only).
        /// Raises OSError if the mount cannot be made.
        #[new]
        #[allow(clippy::type_complexity, clippy::too_many_arguments)]
        fn new(
            py: Python<'_>,
            mountpoint: PathBuf,
            bucket: (
                String,
                String,
                u16,
                String,
                String,
                Option<Credentials>,
                (f64, f64, f64),
            ),
            root: (String, String),
            cache: (usize, usize, u64, usize),
            names: (f64, f64, f64),
            shown: (u32, u32, u16, u16, bool, usize, String, String, String),
            disk: Option<(PathBuf, usize)>,
        ) -> PyResult<Self> {
            let (
                host,
                connect_host,
                port,
                path_prefix,
                region,
                credentials,
                (connect, read, deadline),
            ) = bucket;
            let config = BucketConfig {
                host,
                connect_host,
                port,
                path_prefix,
                region,
                credentials,
                connect_timeout: seconds(connect),
                read_timeout: seconds(read),
                deadline: seconds(deadline),
            };
            let (memory, block_size, ahead_blocks, max_background) = cache;
            if block_size == 0 {
                return Err(PyValueError::new_err("block size must be positive"));
            }
            let (dir_ttl, stale_if_error, attr_ttl) = names;
            let (bucket_name, prefix) = root;
            let namespace = Arc::new(Namespace::new(
                Arc::new(Bucket::new(config)),
                &prefix,
                NamespaceConfig {
                    dir_ttl: seconds(dir_ttl),
                    stale_if_error: seconds(stale_if_error),
                },
            ));
            let reader = ReaderConfig {
                block_size,
                ahead_blocks,
                max_background,
                bucket_path: format!("{bucket_name}/"),
            };
            let disk = match disk {
                Some((dir, bound)) => Some(DiskTier::start(&dir, bound)?),
                None => None,
            };
            let blocks = Arc::new(Blocks::new(namespace, memory, disk, reader));
            let (uid, gid, file_mode, dir_mode, allow_other, threads, fsname, source, root_url) =
                shown;
            let served = fuse::ServeConfig {
                attr_ttl: seconds(attr_ttl),
                uid,
                gid,
                file_mode,
                dir_mode,
                threads,
                allow_other,
                fsname,
                source,
                mountpoint: mountpoint.display().to_string(),
                root_url,
            };
            let fs = fuse::PffsFs::new(blocks.clone(), served.clone());
            let mounted = py.detach(|| fuse::mount(fs, &mountpoint))?;
            Ok(NativeMount {
                mounted: Mutex::new(mounted),
                blocks,
                served,
            })
        }

        /// Waits up to `timeout` seconds for serving to end (unmounted, or the connection aborted);
        /// whether it has.
        fn wait(&self, py: Python<'_>, timeout: f64) -> bool {
            let until = Instant::now() + seconds(timeout);
            let ended = || lock(&self.mounted).ended();
            py.detach(|| {
                while !ended() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
            ended()
        }

        /// Unmounts (if still mounted) and waits for the serving threads.
        fn unmount(&self, py: Python<'_>) -> PyResult<()> {
            py.detach(|| lock(&self.mounted).unmount())?;
            Ok(())
        }

        /// The mount's report as JSON, in the shape of the Python engine's (`pffs stats`).
        fn report(&self) -> String {
            fuse::report_json(&self.blocks, &self.served)
        }

        /// The block files the engine wrote since the last call, under temporary names, as (disk-tier
        /// key, temporary path, payload length), for the disk tier's index to publish (DiskTier.adopt):
        /// waits up to `timeout` seconds for one, without the GIL. Empty once `close_writes` was called
        /// and everything was taken (or the mount has no disk tier).
        fn take_written(&self, py: Python<'_>, timeout: f64) -> Vec<(String, PathBuf, usize)> {
            match &self.blocks.disk {
                Some(disk) => py.detach(|| disk.take_written(seconds(timeout))),
                None => Vec::new(),
            }
        }

        /// No more blocks are queued for the disk tier: those queued are written, then `take_written`
        /// returns empty.
        fn close_writes(&self) {
            if let Some(disk) = &self.blocks.disk {
                disk.close();
            }
        }

        /// From now on, requests are signed with `credentials` ((access key, secret key, session token),
        /// or None: unsigned): temporary credentials are renewed while the mount runs.
        fn set_credentials(&self, credentials: Option<Credentials>) {
            self.blocks.namespace.bucket().set_credentials(credentials);
        }

        /// The disk tier's bytes, its --cache-size, the bound in force and its evictions, for the report.
        fn set_disk_usage(&self, bytes: u64, capacity: u64, bound: u64, evictions: u64) {
            self.blocks.set_disk_usage(DiskUsage {
                bytes,
                capacity,
                bound,
                evictions,
            });
        }
    }

    /// Seconds from Python as a Duration: negative ones as zero, too large or NaN ones as forever.
    fn seconds(s: f64) -> Duration {
        Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
    }

    /// An OSError of the subclass its errno names (OSError's constructor picks it: ETIMEDOUT makes a
    /// TimeoutError, ECONNRESET a ConnectionResetError), as Python's own socket calls raise.
    fn os_error(errno: i32, message: String) -> PyErr {
        PyOSError::new_err((errno, message))
    }
}
