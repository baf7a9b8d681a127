"""The client side of a cache group: which member owns a block, asking it, and when not to.

`fetch` answers True with the block's verified bytes in the caller's buffer, or False: this process owns the
block, its owner is resting after a failure, or the owner did not give exactly the block asked for within the
deadline. The caller then reads from the backend, so a peer can cost time (one deadline, then REST_S of not
being asked) but never bytes, and never a read the backend alone would have served.
"""

from __future__ import annotations

import http.client
import logging
import os
import ssl
import threading
import time

from pffs.backends.backend import ObjectInfo
from pffs.backends.deadline import timeout_left
from pffs.cache.block_format import CorruptBlockError, check_segments, header_size, parse_header
from pffs.peers.protocol import BlockRequest, owner_of, signed_headers
from pffs.peers.settings import PeerSettings, read_members_file, split_address
from pffs.peers.tls import tls_contexts

log = logging.getLogger(__name__)

REST_S = 10.0  # a member that failed is not asked again for this long
RECHECK_S = 1.0  # how often a members file is read again (whole: a coarse mtime misses quick edits)
COUNTERS = (
    "fetched_blocks",  # blocks this process got from a member
    "fetched_bytes",
    "failures",  # a member that did not answer, answered wrongly or too late (each then from the backend)
    "refused",  # requests this process refused: not signed with the group's token
    "served_blocks",  # blocks this process served to members
    "served_bytes",
)


class PeerCounts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


class PeerGroup:
    def __init__(self, settings: PeerSettings, origin: str) -> None:
        self.settings = settings
        self.origin = origin
        self.token = settings.token_bytes()
        self.tls_server: ssl.SSLContext | None = None
        self.tls_client: ssl.SSLContext | None = None
        if settings.tls_dir is not None:
            self.tls_server, self.tls_client = tls_contexts(settings.tls_dir)
        self.me = settings.listen
        self.counts = PeerCounts()
        self._resting: dict[str, float] = {}  # member -> until when it is not asked
        self._local = threading.local()
        self._pid = os.getpid()
        self._members = settings.members
        self._file_failing = False  # the last look at the members file failed (said once, not per look)
        self._file_checked = float("-inf")
        self._file_lock = threading.Lock()
        if settings.members_file is not None:  # at the start, a file that cannot be used is an error
            try:
                read_members_file(settings.members_file)
            except OSError as exc:
                raise ValueError(
                    f"cannot read the members file {settings.members_file}: {exc.strerror}"
                ) from None
            self._reread_members_file()

    def members(self) -> tuple[str, ...]:
        """The members now: the static ones and, with a members file, the ones it lists (looked at again
        at most every RECHECK_S; a file that cannot be read or holds a bad line keeps the last list)."""
        due = self.settings.members_file is not None and time.monotonic() - self._file_checked >= RECHECK_S
        if due and self._file_lock.acquire(blocking=False):  # one reader checks; the others use the last list
            try:
                self._reread_members_file()
            finally:
                self._file_lock.release()
        return self._members

    def _reread_members_file(self) -> None:
        # Read whole each time (a small file, once a second at most): a file's times can miss a change
        # (coarse timestamps, a same-sized file renamed over it within one tick).
        path = self.settings.members_file
        assert path is not None
        self._file_checked = time.monotonic()
        try:
            listed = read_members_file(path)
        except (OSError, ValueError) as exc:
            if not self._file_failing:
                log.warning("cache group: cannot use the members file (%s); keeping the last members", exc)
                self._file_failing = True
            return
        self._file_failing = False
        members = tuple(dict.fromkeys((*self.settings.members, *listed)))
        if members != self._members:
            log.info("cache group: %d members from %s: %s", len(members), path, ", ".join(members))
        self._members = members

    def request(self, key: str, info: ObjectInfo, start: int, end: int) -> BlockRequest:
        return BlockRequest(
            origin=self.origin,
            key=key,
            path=info.path,
            size=info.size,
            identity=info.identity,
            etag=info.etag,
            version_id=info.version_id,
            start=start,
            end=end,
        )

    def owner(self, key: str) -> str | None:
        return owner_of(key, self.members())

    def fetch(self, request: BlockRequest, into: memoryview) -> bool:
        """The block into `into` (exactly end - start bytes) from its owner, verified; False if not."""
        owner = self.owner(request.key)
        if owner is None or owner == self.me or time.monotonic() < self._resting.get(owner, 0.0):
            return False
        try:
            self._get(owner, request, into)
        except (OSError, http.client.HTTPException, CorruptBlockError, TimeoutError, ValueError) as exc:
            # (ssl.SSLError is an OSError: a member whose certificate the group's CA did not sign)
            self._drop_connection(owner)
            self._resting[owner] = time.monotonic() + REST_S
            self.counts.add("failures")
            log.warning(
                "cache group member %s did not serve %s (%s): reading it from the backend, and not asking "
                "that member for %.0f s",
                owner,
                request.path,
                exc,
                REST_S,
            )
            return False
        self.counts.add("fetched_blocks")
        self.counts.add("fetched_bytes", len(into))
        return True

    def _get(self, owner: str, request: BlockRequest, into: memoryview) -> None:
        target = request.target()
        connection = self._connection(owner)
        connection.timeout = timeout_left(self.settings.timeout_s)
        if connection.sock is not None:
            connection.sock.settimeout(connection.timeout)
        reused = connection.sock is not None
        try:
            connection.request("GET", target, headers=signed_headers(self.token, target))
            response = connection.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError):
            if not reused:
                raise
            connection.close()  # a kept-alive connection the member had closed: once more, on a new one
            connection.request("GET", target, headers=signed_headers(self.token, target))
            response = connection.getresponse()
        if response.status != 200:
            response.read()  # the connection stays usable
            raise OSError(f"answered {response.status} {response.reason}")
        length = len(into)
        size = header_size(length)
        if response.length != size + length:
            raise CorruptBlockError(f"{response.length} bytes where {size + length} were expected")
        header = response.read(size)
        got, digests = parse_header(header)
        if got != length:
            raise CorruptBlockError(f"a block of {got} bytes where {length} were asked for")
        filled = 0
        while filled < length:
            n = response.readinto(into[filled:])
            if not n:
                raise CorruptBlockError(f"the answer ended after {filled} of {length} bytes")
            filled += n
        check_segments(digests, 0, into)  # before the bytes are used or kept

    # One keep-alive connection per thread and member.

    def _connections(self) -> dict[str, http.client.HTTPConnection]:
        if self._pid != os.getpid():  # a forked child must not share its parent's sockets
            self._local = threading.local()
            self._pid = os.getpid()
        found: dict[str, http.client.HTTPConnection] | None = getattr(self._local, "connections", None)
        if found is None:
            found = self._local.connections = {}
        return found

    def _connection(self, member: str) -> http.client.HTTPConnection:
        connections = self._connections()
        connection = connections.get(member)
        if connection is None:
            host, port = split_address(member)
            if self.tls_client is not None:
                connection = http.client.HTTPSConnection(
                    host, port, timeout=self.settings.timeout_s, context=self.tls_client
                )
            else:
                connection = http.client.HTTPConnection(host, port, timeout=self.settings.timeout_s)
            connections[member] = connection
        return connection

    def _drop_connection(self, member: str) -> None:
        connection = self._connections().pop(member, None)
        if connection is not None:
            connection.close()
