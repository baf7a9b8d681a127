//! The extension module `pffs._core`: the PyO3 binding of `pffs-core`, exposing to Python only what Python
//! calls. Every call that may take long releases the GIL while the core works (STYLE.md §16).

use pyo3::prelude::*;

/// See pffs_core::SOURCE_DIGEST: this crate is rebuilt too when native/'s sources change.
const _SOURCE_DIGEST: Option<&str> = option_env!("PFFS_NATIVE_SOURCE");

#[pymodule]
mod _core {
    use pffs_core::cache::checksum::segment_digests;
    use pyo3::buffer::PyBuffer;
    use pyo3::exceptions::{PyBufferError, PyValueError};
    use pyo3::prelude::*;

    /// Below this many bytes, hashing (a few microseconds) costs less than giving the GIL up and waiting
    /// to get it back while other threads want it.
    const DETACH_MIN: usize = 64 << 10;

    /// The xxh3-64 digest (seed 0) of each `segment`-byte piece of `data` (any C-contiguous buffer of
    /// bytes), the last one possibly shorter: `xxhash.xxh3_64_intdigest` of each piece. The GIL is
    /// released while it hashes 64 KiB or more.
    #[pyfunction]
    fn xxh3_64_segments(py: Python<'_>, data: PyBuffer<u8>, segment: usize) -> PyResult<Vec<u64>> {
        if segment == 0 {
            return Err(PyValueError::new_err("segment size must be positive"));
        }
        let len = data.len_bytes();
        if len == 0 {
            return Ok(Vec::new());
        }
        let bytes = data
            .as_slice_ptr()
            .ok_or_else(|| PyBufferError::new_err("the buffer is not C-contiguous"))?;
        let address = bytes.cast::<u8>().as_ptr() as usize;
        let digest = move || {
            // SAFETY: `data` holds the exporter's buffer (PyObject_GetBuffer) until it is dropped after
            // this call returns, so the `len` bytes at `address` stay allocated and in place; they are
            // only read. As with hashlib, a Python thread writing into a mutable buffer meanwhile races
            // with the hash and gets a meaningless digest, never a wild access.
            let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
            segment_digests(bytes, segment)
        };
        Ok(if len >= DETACH_MIN {
            py.detach(digest)
        } else {
            digest()
        })
    }
}
