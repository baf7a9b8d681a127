"""S3 ranged GETs (and HEADs) without botocore, for the block fetches that carry almost every byte pffs
reads, and the HEAD a read-write mount asks of every file it shows; and PUTs of local files (one PUT, or
the parts of a multipart upload), for the uploads that carry every byte pffs writes.

Through s3fs, every GET is built, signed, sent and parsed by aiobotocore and aiohttp in Python on s3fs's
event-loop thread, the body arriving as a list of chunks that are joined at the end: 1-3 ms of CPU per
request here, more than the transfer of a 128 KiB file. A block fetch needs much less: one GET of a known
key with a Range, pinned to a version, read into a buffer of known size. This client does just that: SigV4
signing in a few lines, one keep-alive HTTP/1.1 connection per thread (blocking sockets, no event loop),
and the body received straight into the caller's buffer (no chunks, no join). Over plain http the GET is
the native core's (native/core/src/backends/s3_get.rs: the same design in Rust, signed and received
without the GIL, a third of this module's CPU per small GET); over https it is this module's, with
Python's `ssl` (the core has no TLS yet).

An upload's body goes from the local file to the socket with `sendfile` (no copy through Python), its
Content-MD5 hashed from a memory map of the same bytes (the GIL released), so several parts
go out at once on several threads; the server refuses a part whose bytes do not match it.

It learns from the s3fs client it sits beside everything that decides where a request goes and who signs
it: the bucket's base URL (botocore's own addressing decision: path style for an IP endpoint, virtual-host
style on AWS, whatever the configuration says), the signing region and the credentials (refreshed through
botocore, so profiles, environment variables, web identity and instance roles all work). Anything it does
not handle (a bucket in another region, a proxy, a response without a length) raises `NotHandled`, and the
caller goes back to s3fs for good.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import errno
import hashlib
import hmac
import mmap
import os
import re
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit
from xml.sax.saxutils import escape, unescape

from pffs import _core
from pffs.backends.deadline import time_left, timeout_left
from pffs.backends.errors import ObjectChangedError

T = TypeVar("T")

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"  # a body the signature does not cover (its Content-MD5 does)
MAX_HEADER_BYTES = 64 << 10
MAX_ERROR_BODY = 64 << 10
MAX_LIST_BODY = 16 << 20  # a page of 1,000 keys of up to 1,024 bytes, escaped
CREDENTIALS_REFRESH_S = 60.0  # frozen credentials are asked of botocore again after this long


class NotHandled(Exception):
    """This request (and the rest) should go through s3fs instead."""


class S3ServerError(OSError):
    """An S3 error answer. `response` has the shape of botocore's, so the retry policy classifies it
    (5xx, 429 and SlowDown are temporary; the rest are not)."""

    def __init__(self, code_errno: int, message: str, status: int = 0, error_code: str = "") -> None:
        super().__init__(code_errno, message)
        self.code = error_code
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": error_code}}


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    token: str | None = None

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(access_key={self.access_key[:4]}…)"


@dataclass(frozen=True)
class BucketEndpoint:
    """Where a bucket's objects are: scheme, host and port to connect to, and the path prefix of a key."""

    scheme: str
    host: str  # as sent in the Host header (with the port if it is not the default)
    connect_host: str
    port: int
    path_prefix: str  # "/bucket/" (path style) or "/" (virtual-host style)

    @classmethod
    def from_url(cls, base_url: str) -> BucketEndpoint:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise NotHandled(f"unsupported endpoint {parts.scheme}://")
        default = 443 if parts.scheme == "https" else 80
        port = parts.port or default
        host = parts.hostname if port == default else f"{parts.hostname}:{port}"
        prefix = parts.path if parts.path.endswith("/") else parts.path + "/"
        return cls(parts.scheme, host, parts.hostname, port, prefix)


class SigV4:
    """AWS Signature Version 4 for S3 requests (headers only: a body is covered by its hash given as
    `payload`, or by its Content-MD5 with UNSIGNED_PAYLOAD)."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._keys: dict[tuple[str, str], bytes] = {}

    def _signing_key(self, secret: str, day: str) -> bytes:
        key = self._keys.get((secret, day))
        if key is None:
            key = ("AWS4" + secret).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, day): key}  # one day, one secret at a time
        return key

    def sign(
        self,
        creds: Credentials,
        host: str,
        path: str,
        query: str,
        headers: dict[str, str],
        now: float,
        method: str = "GET",
        payload: str = EMPTY_SHA256,
    ) -> dict[str, str]:
        """The headers to send for a request of `path?query` on `host` (`query` in canonical form: sorted,
        encoded): `headers` (lower-case names, all of them signed) plus x-amz-date, x-amz-content-sha256,
        the session token and Authorization."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        day = stamp[:8]
        signed = {**headers, "host": host, "x-amz-content-sha256": payload, "x-amz-date": stamp}
        if creds.token:
            signed["x-amz-security-token"] = creds.token
        names = sorted(signed)
        canonical = "\n".join(
            [method, path, query, *(f"{k}:{signed[k]}" for k in names), "", ";".join(names), payload]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256)
        signed["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope},SignedHeaders={';'.join(names)},"
            f"Signature={signature.hexdigest()}"
        )
        del signed["host"]  # sent as the first header by the caller
        return signed


class _Connection:
    """One keep-alive HTTP/1.1 connection, used by one thread at a time."""

    def __init__(self, endpoint: BucketEndpoint, connect_timeout: float, read_timeout: float) -> None:
        address = (endpoint.connect_host, endpoint.port)
        sock = socket.create_connection(address, timeout=timeout_left(connect_timeout))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.scheme == "https":
            context = ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or None)
            sock = context.wrap_socket(sock, server_hostname=endpoint.connect_host)
        sock.settimeout(read_timeout)
        self.sock = sock
        self.used = 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class _Response:
    status: int
    headers: dict[str, str]
    early_body: bytes  # body bytes that arrived with the headers


class NativeS3Getter:
    """Ranged GETs of one S3 service (one endpoint, region and set of credentials)."""

    def __init__(
        self,
        base_url_of: Callable[[str], str],
        region: str,
        credentials: Callable[[], Credentials | None],
        connect_timeout: float,
        read_timeout: float,
        native_http: bool = True,
    ) -> None:
        """`native_http`: GETs over http through the native core (False: this module's sockets, as over
        https; bench/native_s3_clients.py compares the two)."""
        self._base_url_of = base_url_of  # bucket -> its base URL (asks botocore, once per bucket)
        self.region = region
        self._signer = SigV4(region)
        self._native = _core.S3Client(region) if native_http else None
        self._credentials = credentials
        self._creds: Credentials | None = None
        self._creds_at = -CREDENTIALS_REFRESH_S
        self._endpoints: dict[str, BucketEndpoint] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pid = os.getpid()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout

    def _endpoint(self, bucket: str) -> BucketEndpoint:
        endpoint = self._endpoints.get(bucket)
        if endpoint is None:
            endpoint = BucketEndpoint.from_url(self._base_url_of(bucket))
            with self._lock:
                self._endpoints[bucket] = endpoint
        return endpoint

    def bucket_target(self, bucket: str) -> tuple[BucketEndpoint, Credentials | None]:
        """Where `bucket` is and who signs: for the native engine, which sends its own requests."""
        return self._endpoint(bucket), self._current_credentials()

    def _current_credentials(self) -> Credentials | None:
        now = time.monotonic()
        if now - self._creds_at >= CREDENTIALS_REFRESH_S:
            with self._lock:
                if now - self._creds_at >= CREDENTIALS_REFRESH_S:
                    self._creds = self._credentials()
                    self._creds_at = now
        return self._creds

    def get(
        self,
        bucket: str,
        key: str,
        start: int,
        into: memoryview,
        etag: str | None = None,
        version_id: str | None = None,
    ) -> None:
        """Fills `into` with bytes [start, start+len(into)) of the object, of the version given by
        `version_id` or `etag` (ObjectChangedError if it is gone)."""
        endpoint = self._endpoint(bucket)
        native = self._native
        if endpoint.scheme == "http" and native is not None:
            where = (endpoint.host, endpoint.connect_host, endpoint.port, endpoint.path_prefix)
            self._native_call(
                lambda creds, timeouts: native.get(where, key, start, into, etag, version_id, creds, timeouts)
            )
            return
        query = f"versionId={quote(version_id, safe='~')}" if version_id else ""
        headers = {"range": f"bytes={start}-{start + len(into) - 1}"}
        if etag and not version_id:
            headers["if-match"] = etag
        endpoint, connection, response = self._request("GET", bucket, key, query, headers)
        try:
            self._body(connection, response, into, etag, self.read_timeout)
        except _ErrorAnswer as answer:
            # An error answer read whole (a 503 SlowDown, a 404): the connection stays usable, and a retry
            # after throttling does not also open a new connection.
            self._keep_or_close(endpoint, connection, response)
            raise answer.error from None
        except BaseException:
            connection.close()
            self._forget(endpoint)
            raise
        self._keep_or_close(endpoint, connection, response)

    def get_bytes(
        self,
        bucket: str,
        key: str,
        start: int,
        length: int,
        etag: str | None = None,
        version_id: str | None = None,
    ) -> bytes | memoryview:
        """Bytes [start, start+length) of the object, as `get` reads them, in a buffer of their own: over
        http a bytes object the native core fills (never zeroed first, and a block that needs no copy
        to be returned whole)."""
        endpoint = self._endpoint(bucket)
        native = self._native
        if endpoint.scheme == "http" and native is not None:
            where = (endpoint.host, endpoint.connect_host, endpoint.port, endpoint.path_prefix)
            return self._native_call(
                lambda creds, timeouts: native.get_bytes(
                    where, key, start, length, etag, version_id, creds, timeouts
                )
            )
        into = memoryview(bytearray(length))
        self.get(bucket, key, start, into, etag, version_id)
        return into

    def _native_call(
        self,
        call: Callable[[tuple[str, str, str | None] | None, tuple[float, float, float | None]], T],
    ) -> T:
        """`call(credentials, timeouts)` into the native core, its errors named as this module names them."""
        creds = self._current_credentials()
        try:
            return call(
                (creds.access_key, creds.secret_key, creds.token) if creds is not None else None,
                (self.connect_timeout, self.read_timeout, time_left()),
            )
        except _core.S3ErrorAnswer as answer:
            status, body = answer.args
            _raise_for(status, body)
            raise  # (_raise_for always raises)
        except _core.S3NotHandled as exc:
            raise NotHandled(str(exc)) from None
        except _core.S3ObjectChanged:
            raise ObjectChangedError("") from None  # the caller names the URL

    def head(self, bucket: str, key: str) -> dict[str, Any]:
        """The object's HEAD, in the shape of botocore's head_object answer (ContentLength, ETag,
        VersionId, LastModified, ContentType, Metadata): what a read-write mount asks of every file it
        shows, at a fraction of botocore's CPU (FileNotFoundError if there is no such object)."""
        endpoint, connection, response = self._request("HEAD", bucket, key, "", {})
        # A HEAD answer has no body, whatever its Content-Length says; a server that sent one anyway
        # leaves the connection unusable for the next answer.
        if response.early_body:
            connection.close()
            self._forget(endpoint)
        else:
            self._keep_or_close(endpoint, connection, response)
        headers = response.headers
        if response.status != 200:
            if response.status in (301, 302, 307, 308, 400):
                raise NotHandled(f"HTTP {response.status} to a HEAD")
            _raise_for(response.status, b"")
        if "content-length" not in headers:
            raise NotHandled("a HEAD answer without a Content-Length")
        answer: dict[str, Any] = {
            "ContentLength": int(headers["content-length"]),
            "Metadata": {
                name[len("x-amz-meta-") :]: value
                for name, value in headers.items()
                if name.startswith("x-amz-meta-")
            },
        }
        for header, field in (
            ("etag", "ETag"),
            ("x-amz-version-id", "VersionId"),
            ("content-type", "ContentType"),
        ):
            if header in headers:
                answer[field] = headers[header]
        if "last-modified" in headers:
            answer["LastModified"] = email.utils.parsedate_to_datetime(headers["last-modified"])
        return answer

    def _request(
        self,
        method: str,
        bucket: str,
        key: str,
        query: str,
        headers: dict[str, str],
        body: FileRange | bytes | None = None,
    ) -> tuple[BucketEndpoint, _Connection, _Response]:
        """Sends one signed request (with its body) on this thread's connection to the bucket's endpoint
        and reads the answer's headers (once more on a new connection if a kept-alive one had been
        closed)."""
        endpoint = self._endpoint(bucket)
        path = endpoint.path_prefix + quote(key, safe="/~")
        payload = EMPTY_SHA256
        if body is not None:
            headers = {**headers, "content-length": str(len(body))}
            if isinstance(body, FileRange):
                headers["content-md5"] = body.md5()  # the server refuses the part if the bytes differ
                payload = UNSIGNED_PAYLOAD
            else:
                payload = hashlib.sha256(body).hexdigest()
        creds = self._current_credentials()
        if creds is not None:
            now = time.time()
            headers = self._signer.sign(creds, endpoint.host, path, query, headers, now, method, payload)
        target = path + ("?" + query if query else "")
        request = [f"{method} {target} HTTP/1.1", f"Host: {endpoint.host}", "Connection: keep-alive"]
        request += [f"{k}: {v}" for k, v in headers.items()]
        wire = ("\r\n".join(request) + "\r\n\r\n").encode()
        connection, reused = self._connection(endpoint)
        try:
            return endpoint, connection, self._exchange(connection, wire, self.read_timeout, body)
        except (ConnectionError, _EmptyAnswer):
            connection.close()
            self._forget(endpoint)
            if not reused:
                raise
            # A kept-alive connection the server had closed: one new connection, at once.
            connection, _ = self._connection(endpoint)
            try:
                return endpoint, connection, self._exchange(connection, wire, self.read_timeout, body)
            except BaseException:
                connection.close()
                self._forget(endpoint)
                raise
        except BaseException:
            connection.close()
            self._forget(endpoint)
            raise

    # Uploads. Each takes its body from a local file (FileRange) and returns what S3 answered.

    def put_object(self, bucket: str, key: str, body: FileRange, headers: dict[str, str]) -> dict[str, str]:
        """One PUT of the whole object (`headers`: x-amz-meta-* and the like); the answer's headers."""
        response, _ = self._small("PUT", bucket, key, "", headers, body)
        return response.headers

    def create_multipart_upload(self, bucket: str, key: str, headers: dict[str, str]) -> str:
        """A new multipart upload of `key` (its metadata in `headers`); its upload id."""
        _, answer = self._small("POST", bucket, key, _query({"uploads": ""}), headers)
        found = re.search(rb"<UploadId>([^<]+)</UploadId>", answer)
        if found is None:
            raise NotHandled("a CreateMultipartUpload answer without an UploadId")
        return unescape(found.group(1).decode())

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, body: FileRange) -> str:
        """Part `number` (from 1) of the upload; its ETag, for the completion."""
        query = _query({"partNumber": str(number), "uploadId": upload_id})
        try:
            response, _ = self._small("PUT", bucket, key, query, {}, body)
        except S3ServerError as exc:
            if exc.code == "BadDigest":  # the bytes changed on the way: send again
                raise ConnectionResetError(errno.EIO, f"part {number} arrived altered (BadDigest)") from exc
            raise
        etag = response.headers.get("etag")
        if not etag:
            raise NotHandled("an UploadPart answer without an ETag")
        return etag

    def complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, etags: list[str]
    ) -> dict[str, str]:
        """Puts the object in place from its parts (ETags in part order), in one step: until then, the
        object at `key` is whatever was there before. The answer's fields (ETag, ...)."""
        parts = "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(etag)}</ETag></Part>"
            for n, etag in enumerate(etags, start=1)
        )
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        _, answer = self._small("POST", bucket, key, _query({"uploadId": upload_id}), {}, body)
        return {name.decode(): unescape(value.decode()) for name, value in _FIELD.findall(answer)}

    def abort_multipart_upload(self, bucket: str, key: str, upload_id: str) -> None:
        """Drops the upload and the parts it holds (the object at `key` is untouched)."""
        self._small("DELETE", bucket, key, _query({"uploadId": upload_id}), {})

    def delete_object(self, bucket: str, key: str) -> None:
        """Deletes the object (S3 answers the same whether it was there or not)."""
        self._small("DELETE", bucket, key, "", {})

    def list_sizes(self, bucket: str, prefix: str, page: int = 1000) -> dict[str, int]:
        """Key -> size of the objects right under `prefix` (a folder: "a/b/"), a LIST per `page` keys."""
        found: dict[str, int] = {}
        token = ""
        while True:
            params = {"list-type": "2", "prefix": prefix, "delimiter": "/", "max-keys": str(page)}
            if token:
                params["continuation-token"] = token
            _, answer = self._small("GET", bucket, "", _query(params), {}, limit=MAX_LIST_BODY)
            for entry in _CONTENTS.findall(answer):
                fields = dict(_ENTRY_FIELD.findall(entry))
                if b"Key" not in fields or b"Size" not in fields:
                    raise NotHandled("a listing entry without a Key or a Size")
                found[unescape(fields[b"Key"].decode())] = int(fields[b"Size"])
            truncated = re.search(rb"<IsTruncated>true</IsTruncated>", answer)
            next_token = re.search(rb"<NextContinuationToken>([^<]+)</NextContinuationToken>", answer)
            if not truncated:
                return found
            if next_token is None:
                raise NotHandled("a truncated listing without a continuation token")
            token = unescape(next_token.group(1).decode())

    def _small(
        self,
        method: str,
        bucket: str,
        key: str,
        query: str,
        headers: dict[str, str],
        body: FileRange | bytes | None = None,
        limit: int = MAX_ERROR_BODY,
    ) -> tuple[_Response, bytes]:
        """A request whose answer is small (headers, an XML document): the answer and its body; an error
        answer raised as its exception. S3 may answer 200 with an error document (CompleteMultipartUpload
        that failed after it started): raised too."""
        endpoint, connection, response = self._request(method, bucket, key, query, headers, body)
        try:
            answer = self._small_body(connection, response, limit)
        except BaseException:
            connection.close()
            self._forget(endpoint)
            raise
        if response.headers.get("x-pffs-unread-body"):
            connection.close()  # the answer came before all the body was sent: the stream is out of step
            self._forget(endpoint)
        else:
            self._keep_or_close(endpoint, connection, response)
        if response.status in (301, 302, 307, 308, 400) and not answer:
            raise NotHandled(f"HTTP {response.status} to a {method}")
        if response.status not in (200, 204) or (response.status == 200 and b"<Error>" in answer[:512]):
            _raise_for(response.status, answer)
        return response, answer

    def _small_body(self, connection: _Connection, response: _Response, limit: int) -> bytes:
        headers = response.headers
        if "chunked" in headers.get("transfer-encoding", ""):
            return _receive_chunked(connection.sock, response.early_body, self.read_timeout, limit)
        length = int(headers.get("content-length", "0"))
        if length > limit:
            raise NotHandled("answer too long")
        return response.early_body + _receive(
            connection.sock, length - len(response.early_body), self.read_timeout
        )

    def _keep_or_close(self, endpoint: BucketEndpoint, connection: _Connection, response: _Response) -> None:
        if response.headers.get("connection", "").lower() == "close":
            connection.close()
            self._forget(endpoint)

    # Connections, one per thread and endpoint.

    def _connections(self) -> dict[BucketEndpoint, _Connection]:
        if self._pid != os.getpid():  # a forked child must not share its parent's sockets
            self._local = threading.local()
            self._pid = os.getpid()
        found: dict[BucketEndpoint, _Connection] | None = getattr(self._local, "connections", None)
        if found is None:
            found = self._local.connections = {}
        return found

    def _connection(self, endpoint: BucketEndpoint) -> tuple[_Connection, bool]:
        connections = self._connections()
        connection = connections.get(endpoint)
        if connection is not None:
            return connection, True
        connection = connections[endpoint] = _Connection(endpoint, self.connect_timeout, self.read_timeout)
        return connection, False

    def _forget(self, endpoint: BucketEndpoint) -> None:
        self._connections().pop(endpoint, None)

    # The wire.

    # Each wait on the socket gets the read timeout, or what is left of the call's deadline if less.

    @staticmethod
    def _exchange(
        connection: _Connection, wire: bytes, read_timeout: float, body: FileRange | bytes | None = None
    ) -> _Response:
        sock = connection.sock
        sock.settimeout(timeout_left(read_timeout))
        unsent = False
        if isinstance(body, bytes):
            sock.sendall(wire + body)
        else:
            sock.sendall(wire)
            if body is not None:
                try:
                    body.send(sock, read_timeout)
                except (BrokenPipeError, ConnectionResetError):
                    # The server answered (403, 404, ...) and closed before taking the whole body: read
                    # its answer, if it sent one, for what went wrong; else this is a lost connection.
                    unsent = True
        received = bytearray()
        while True:
            sock.settimeout(timeout_left(read_timeout))
            chunk = sock.recv(16384)
            if not chunk:
                if not received:
                    raise _EmptyAnswer
                raise ConnectionResetError(errno.ECONNRESET, "S3 closed the connection mid-answer")
            received += chunk
            end = received.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(received) > MAX_HEADER_BYTES:
                raise NotHandled("answer headers too long")
        connection.used += 1
        lines = bytes(received[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise NotHandled(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if unsent:
            headers["x-pffs-unread-body"] = "1"
        return _Response(int(parts[1]), headers, bytes(received[end + 4 :]))

    def _body(
        self,
        connection: _Connection,
        response: _Response,
        into: memoryview,
        etag: str | None,
        read_timeout: float,
    ) -> None:
        headers = response.headers
        if "content-length" not in headers or "chunked" in headers.get("transfer-encoding", ""):
            raise NotHandled("answer without a Content-Length")
        length = int(headers["content-length"])
        if response.status not in (200, 206):
            wanted = min(length, MAX_ERROR_BODY) - len(response.early_body)
            body = response.early_body + _receive(connection.sock, wanted, read_timeout)
            if length > MAX_ERROR_BODY:
                raise NotHandled("error answer too long")  # the connection is closed by the caller
            try:
                _raise_for(response.status, body)
            except OSError as exc:
                if len(body) == length:  # read to its end: the next answer on this connection is in step
                    raise _ErrorAnswer(exc) from None
                raise
        if response.status == 200 and length != len(into):
            raise NotHandled("the server ignored the Range header")
        if length != len(into):
            raise OSError(errno.EIO, f"short read: {length} of {len(into)} bytes")
        got = headers.get("etag")
        early = response.early_body
        into[: len(early)] = early
        filled = len(early)
        sock = connection.sock
        while filled < length:
            sock.settimeout(timeout_left(read_timeout))
            n = sock.recv_into(into[filled:], length - filled)
            if n == 0:
                raise ConnectionResetError(
                    errno.ECONNRESET, f"S3 closed the connection after {filled} of {length} bytes"
                )
            filled += n
        if etag and got is not None and got != etag:
            raise ObjectChangedError("")  # the caller names the URL


@dataclass(frozen=True)
class FileRange:
    """Bytes [offset, offset + length) of a local file: the body of an upload, sent from the file to the
    socket by the kernel (sendfile) and hashed from a memory map, never copied through Python."""

    path: str
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def md5(self) -> str:
        """Base64 of the bytes' MD5 (a Content-MD5 header)."""
        digest = hashlib.md5(usedforsecurity=False)
        if self.length:
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset + self.length:
                    raise OSError(errno.EIO, f"{self.path}: shorter than the {self.length} bytes to send")
                with mmap.mmap(
                    f.fileno(), self.offset + self.length - start, offset=start, access=mmap.ACCESS_READ
                ) as mapped:
                    view = memoryview(mapped)
                    try:
                        digest.update(view[self.offset - start :])  # hashlib releases the GIL
                    finally:
                        view.release()
        return base64.b64encode(digest.digest()).decode()

    def send(self, sock: socket.socket, read_timeout: float) -> None:
        with open(self.path, "rb") as f:
            sent = 0
            while sent < self.length:
                sock.settimeout(timeout_left(read_timeout))
                n = sock.sendfile(f, self.offset + sent, self.length - sent)
                if n == 0:
                    raise OSError(errno.EIO, f"{self.path}: shorter than the {self.length} bytes to send")
                sent += n


def _query(params: dict[str, str]) -> str:
    """A query string in SigV4's canonical form (sorted, encoded), sent as it is signed."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


_FIELD = re.compile(rb"<(ETag|Location|Bucket|Key|VersionId)>([^<]*)</\1>")
_CONTENTS = re.compile(rb"<Contents>(.*?)</Contents>", re.S)
_ENTRY_FIELD = re.compile(rb"<(Key|Size)>([^<]*)</\1>")


def _receive_chunked(sock: socket.socket, early: bytes, read_timeout: float, limit: int) -> bytes:
    """A small answer body sent with Transfer-Encoding: chunked (no trailers)."""
    buffer = bytearray(early)

    def fill(count: int) -> None:
        while len(buffer) < count:
            sock.settimeout(timeout_left(read_timeout))
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError(errno.ECONNRESET, "S3 closed the connection mid-answer")
            buffer.extend(chunk)

    body = bytearray()
    at = 0
    while True:
        while (end := buffer.find(b"\r\n", at)) < 0:
            fill(len(buffer) + 1)
        size = int(bytes(buffer[at:end]).split(b";")[0], 16)
        fill(end + 2 + size + 2)  # the chunk and the CRLF after it (after the last, empty one: the end)
        if size == 0:
            return bytes(body)
        body += buffer[end + 2 : end + 2 + size]
        if len(body) > limit:
            raise NotHandled("answer too long")
        at = end + 2 + size + 2


class _ErrorAnswer(Exception):
    """An error answer read to its end (the connection can be kept): `error` is what to raise."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _EmptyAnswer(Exception):
    """The connection was closed before a byte of the answer came (a stale keep-alive connection)."""


def _receive(sock: socket.socket, count: int, read_timeout: float) -> bytes:
    parts = []
    while count > 0:
        sock.settimeout(timeout_left(read_timeout))
        chunk = sock.recv(min(count, 65536))
        if not chunk:
            break
        parts.append(chunk)
        count -= len(chunk)
    return b"".join(parts)


_TAG = re.compile(r"<(Code|Message|Region)>([^<]*)</\1>")
# Answers that mean "this request should not have come here": the bucket is in another region, or the
# server wants something this client does not do. s3fs knows how to follow them.
REDIRECT_CODES = {
    "PermanentRedirect",
    "TemporaryRedirect",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
}


def _raise_for(status: int, body: bytes) -> None:
    fields = dict(_TAG.findall(body.decode("utf-8", "replace")))
    code, message = fields.get("Code", ""), fields.get("Message", "")
    if status in (301, 302, 307, 308) or code in REDIRECT_CODES:
        raise NotHandled(f"HTTP {status} {code}")
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, message or "no such key")
    if status == 403:
        raise PermissionError(errno.EACCES, f"{code}: {message}" if code else "access denied")
    if status in (412, 416):
        raise ObjectChangedError("")
    raise S3ServerError(errno.EIO, f"HTTP {status} {code}: {message}".strip(), status, code)


def plain_getter(
    endpoint_url: str | None,
    region: str | None,
    explicit: Credentials | None,
    anonymous: bool,
    connect_timeout: float,
    read_timeout: float,
) -> NativeS3Getter | None:
    """A native getter set up without botocore, where the setup leaves nothing for botocore to decide: an
    http endpoint on an IP address or localhost (path-style addressing, as botocore does there), keys
    given or in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (botocore's first choice), and no profile,
    config file or proxy that could change where a request goes or who signs it. None otherwise: then the
    getter is made from s3fs's client (native_getter_for), which costs importing botocore and aiohttp."""
    env = os.environ
    parts = urlsplit(endpoint_url or "")
    host = parts.hostname or ""
    if parts.scheme != "http" or not (host == "localhost" or _is_ip(host)) or parts.path.strip("/"):
        return None
    if any(env.get(name) for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE")):
        return None
    if os.path.exists(os.path.expanduser("~/.aws/config")):
        return None
    if "http" in urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
        return None
    creds: Credentials | None = None
    if not anonymous:
        creds = explicit
        if creds is None and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            creds = Credentials(
                env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN") or None
            )
        if creds is None:
            return None  # botocore's other sources (shared file, roles, instance metadata)
    base = f"{parts.scheme}://{parts.netloc}/"
    signing_region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    return NativeS3Getter(
        lambda bucket: f"{base}{quote(bucket)}/",
        signing_region,
        lambda: creds,
        connect_timeout,
        read_timeout,
    )


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


def native_getter_for(fs: Any) -> NativeS3Getter:
    """The native getter for the service an s3fs filesystem talks to, set up from its botocore client:
    the same endpoint, addressing style, region, timeouts and credentials."""
    import botocore
    from fsspec.asyn import sync

    client = sync(fs.loop, fs.set_session)
    config = client.meta.config
    if getattr(config, "proxies", None):
        raise NotHandled("a proxy is configured")
    if config.signature_version is botocore.UNSIGNED:
        credentials: Callable[[], Credentials | None] = lambda: None  # noqa: E731 (anonymous access)
    else:
        botocore_credentials = getattr(getattr(client, "_request_signer", None), "_credentials", None)
        if botocore_credentials is None:
            raise NotHandled("no credentials found")

        def credentials() -> Credentials | None:
            frozen = sync(fs.loop, botocore_credentials.get_frozen_credentials)
            return Credentials(frozen.access_key, frozen.secret_key, frozen.token or None)

    def base_url_of(bucket: str) -> str:
        url = sync(
            fs.loop,
            client.generate_presigned_url,
            "get_object",
            Params={"Bucket": bucket, "Key": "k"},
            ExpiresIn=60,
        )
        base = str(url).split("?", 1)[0]
        if not base.endswith("/k"):
            raise NotHandled("unexpected object URL form")
        host = urlsplit(base).hostname or ""
        scheme = urlsplit(base).scheme
        if scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
            raise NotHandled(f"{scheme} proxy set in the environment")
        return base[:-1]

    return NativeS3Getter(
        base_url_of,
        client.meta.region_name or "us-east-1",
        credentials,
        float(config.connect_timeout),
        float(config.read_timeout),
    )
