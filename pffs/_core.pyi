"""pffs._core: the native core (native/python, a PyO3 binding of native/core), built by setuptools-rust."""

from typing_extensions import Buffer

def xxh3_64_segments(data: Buffer, segment: int) -> list[int]:
    """The xxh3-64 digest (seed 0) of each `segment`-byte piece of `data` (any C-contiguous buffer of
    bytes), the last one possibly shorter: `xxhash.xxh3_64_intdigest` of each piece; [] for no bytes.
    The GIL is released while it hashes 64 KiB or more."""

class CorruptBlockError(ValueError):
    """A block file that is truncated, too long, bit-flipped or not in pffs's layout: never served."""

class BlockHeader:
    """A block file's parsed header, kept by the caller to skip reading it again."""

    @property
    def length(self) -> int: ...

def block_header_size(length: int) -> int:
    """Where a block file's payload of `length` bytes starts: its header's size, padding included."""

def block_header(payload: Buffer) -> bytes:
    """The header of a block file holding `payload` (padded to its page boundary)."""

def parse_block_header(data: bytes) -> tuple[int, list[int]]:
    """(payload length, segment digests) of the header at the start of `data`; CorruptBlockError if it
    is not one of ours."""

def check_block_segments(digests: list[int], first: int, data: Buffer) -> None:
    """Checks `data`, whole segments from segment number `first` on, against `digests`."""

def block_payload_length(path: str) -> int:
    """The payload length of the block file at `path`, from its header."""

def read_block_into(path: str, into: Buffer, expected_length: int, direct: bool = False) -> None:
    """Reads the block file at `path`, whose payload is `expected_length` bytes, into the writable buffer
    `into` (room for more than the file should hold) as stored, and verifies it. Without the GIL."""

def read_block_bytes(path: str, expected_length: int) -> bytes:
    """The block file at `path`, whose payload is `expected_length` bytes, as stored (the payload from
    block_header_size(expected_length) on, one byte of room after it), verified. Without the GIL."""

def block_range_room(start: int, end: int) -> int:
    """The buffer a range read of [start, end) needs: the segments it lies in, in whole pages."""

def read_block_range_into(
    path: str, start: int, end: int, into: Buffer, header: BlockHeader | None = None, direct: bool = False
) -> tuple[int, int, BlockHeader]:
    """Bytes [start, end) of a block file's payload read into `into` (at least block_range_room(start,
    end) bytes), verifying only the segments they lie in: (where in `into` they start, how many, the
    file's header). Without the GIL."""

class S3NotHandled(Exception):
    """Something the native S3 client does not do: the caller goes through another client."""

class S3ErrorAnswer(Exception):
    """An S3 error answer: args (status, body)."""

class S3ObjectChanged(Exception):
    """The object's ETag is no longer the one asked for."""

class S3Client:
    """S3 ranged GETs (native/core/src/backends/s3_get.rs) for one region: signing keys are kept,
    keep-alive connections are per OS thread (and made anew in a forked child)."""

    def __init__(self, region: str) -> None: ...
    def get(
        self,
        endpoint: tuple[str, str, int, str],
        key: str,
        start: int,
        into: Buffer,
        etag: str | None,
        version_id: str | None,
        credentials: tuple[str, str, str | None] | None,
        timeouts: tuple[float, float, float | None],
    ) -> None:
        """Fills `into` with bytes [start, start + len(into)) of `key`, without the GIL. `endpoint`: (Host
        header, host to connect to, port, path prefix); `credentials`: (access key, secret key, session
        token) or None (unsigned); `timeouts`: (connect, read: the longest wait each, seconds; what is left
        of the call's deadline, or None). Raises S3NotHandled, S3ErrorAnswer(status, body),
        S3ObjectChanged or an OSError (ETIMEDOUT, ECONNRESET, ECONNREFUSED, EIO, ...)."""
    def get_bytes(
        self,
        endpoint: tuple[str, str, int, str],
        key: str,
        start: int,
        length: int,
        etag: str | None,
        version_id: str | None,
        credentials: tuple[str, str, str | None] | None,
        timeouts: tuple[float, float, float | None],
    ) -> bytes:
        """As get, into a new bytes object of `length` bytes (never zeroed first: every byte is received
        before it is returned)."""

class NativeMount:
    """A read-only mount served by the native engine (native/core/src/fuse): several threads read the FUSE
    connection and answer every request without Python. Made mounted."""

    def __init__(
        self,
        mountpoint: str,
        bucket: tuple[
            str, str, int, str, str, tuple[str, str, str | None] | None, tuple[float, float, float]
        ],
        root: tuple[str, str],
        cache: tuple[int, int, int, int],
        names: tuple[float, float, float],
        shown: tuple[int, int, int, int, bool, int, str, str, str],
        disk: tuple[str, int] | None,
    ) -> None:
        """`bucket`: (Host header, host to connect to, port, path prefix, region, credentials or None,
        (connect, read, deadline) seconds); `root`: (the bucket's name, the root's key prefix: "" or ending
        in "/"); `cache`: (memory bytes, block size, blocks read ahead, background fetches); `names`: (dir
        TTL, stale-if-error, attr TTL) seconds; `shown`: (uid, gid, file mode, dir mode, allow other,
        threads, fsname, source URL, root URL); `disk`: (the cache directory whose disk tier is read, the
        bytes of fetched blocks queued for its writer at most) or None. Raises OSError if the mount cannot
        be made."""
    def wait(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for serving to end; whether it has."""
    def unmount(self) -> None:
        """Unmounts (if still mounted) and waits for the serving threads."""
    def report(self) -> str:
        """The mount's report as JSON, in the shape of the Python engine's (`pffs stats`)."""
    def take_written(self, timeout: float) -> list[tuple[str, str, int]]:
        """The block files the engine wrote since the last call under temporary names, as (disk-tier key,
        temporary path, payload length), for DiskTier.adopt: waits up to `timeout` seconds for one, without
        the GIL; empty once close_writes was called and everything was taken."""
    def close_writes(self) -> None:
        """No more blocks are queued: those queued are written, then take_written returns empty."""
    def set_credentials(self, credentials: tuple[str, str, str | None] | None) -> None:
        """From now on, requests are signed with `credentials` (None: unsigned)."""
    def set_disk_usage(self, bytes: int, capacity: int, bound: int, evictions: int) -> None:
        """The disk tier's bytes, its --cache-size, the bound in force and its evictions, for the report."""
