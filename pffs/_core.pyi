"""pffs._core: the native core (native/python, a PyO3 binding of native/core), built by setuptools-rust."""

from typing_extensions import Buffer

def xxh3_64_segments(data: Buffer, segment: int) -> list[int]:
    """The xxh3-64 digest (seed 0) of each `segment`-byte piece of `data` (any C-contiguous buffer of
    bytes), the last one possibly shorter: `xxhash.xxh3_64_intdigest` of each piece; [] for no bytes.
    The GIL is released while it hashes 64 KiB or more."""
