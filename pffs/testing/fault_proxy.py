"""A fault-injecting HTTP proxy for tests: in front of an S3 server (the test SeaweedFS), on 127.0.0.1 at a
free port, it forwards each request as it came (the Host header untouched, so signatures still hold) and
answers a configurable share of them with faults:

- throttle: a 503 SlowDown with S3's XML error body, as AWS sends when a prefix is over its request rate;
- stall: the server's answer is forwarded with its headers and part of its body, then nothing more (an
  answer without a body, a HEAD's, is never begun); the connection stays open until the proxy is closed or
  `release()` is called;
- stall_all (`stall_everything()`): every request is held without an answer while it lasts.

Point a client at `endpoint_url` instead of the server's. `counts` says what was done to how many requests.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>pffs-fault-proxy</RequestId></Error>"
)
MAX_HEAD = 64 << 10


@dataclass
class Faults:
    throttle: float = 0.0  # share of requests answered 503 SlowDown
    stall: float = 0.0  # share of requests whose answer stalls mid-body
    stall_all: bool = False  # every request held without an answer


class FaultProxy:
    def __init__(self, upstream: str, faults: Faults | None = None, seed: int | None = None) -> None:
        parts = urlsplit(upstream)
        if not parts.hostname or not parts.port:
            raise ValueError(f"{upstream!r}: the upstream must be http://HOST:PORT")
        self.upstream = (parts.hostname, parts.port)
        self.faults = faults or Faults()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "forwarded": 0, "throttled": 0, "stalled": 0, "held": 0}
        self._released = threading.Event()  # set: stalled answers and held requests end
        self._stall_until = 0.0  # held requests are dropped at this time.monotonic() (stall_everything)
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    # Control

    def set(self, throttle: float | None = None, stall: float | None = None) -> None:
        with self._lock:
            if throttle is not None:
                self.faults.throttle = throttle
            if stall is not None:
                self.faults.stall = stall

    @contextlib.contextmanager
    def stall_everything(self, seconds: float = 3600.0) -> Iterator[None]:
        """Every request meanwhile is held without an answer, for at most `seconds` from now (then its
        connection is closed, as a gateway that gave up would); on leaving, those still held are dropped."""
        with self._lock:
            self.faults.stall_all = True
            self._released.clear()
            self._stall_until = time.monotonic() + seconds
        try:
            yield
        finally:
            with self._lock:
                self.faults.stall_all = False
            self.release()

    def release(self) -> None:
        """Ends every stall now: their connections are closed."""
        self._released.set()
        with self._lock:
            self._released = threading.Event()

    def close(self) -> None:
        self._closed = True
        self._released.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Serving

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True).start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _serve(self, client: socket.socket) -> None:
        self._track(client)
        upstream: socket.socket | None = None
        try:
            reader = _Reader(client)
            while not self._closed:
                request = _read_message(reader, request=True)
                if request is None:
                    return
                head, body, method = request
                with self._lock:
                    self.counts["requests"] += 1
                    faults = self.faults
                    released = self._released
                    hold = faults.stall_all
                    throttle = not hold and self._random.random() < faults.throttle
                    stall = not hold and not throttle and self._random.random() < faults.stall
                if hold:
                    with self._lock:
                        self.counts["held"] += 1
                    released.wait(max(0.0, self._stall_until - time.monotonic()))
                    return  # the connection is closed: the client sees it end without an answer
                if throttle:
                    with self._lock:
                        self.counts["throttled"] += 1
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"x-amz-request-id: pffs-fault-proxy\r\n"
                        + f"Content-Length: {len(SLOW_DOWN_BODY)}\r\n\r\n".encode()
                        + (b"" if method == "HEAD" else SLOW_DOWN_BODY)  # a HEAD's answer has no body
                    )
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=60)
                    self._track(upstream)
                upstream.sendall(head + body)
                answer = _read_message(_Reader(upstream), request=False, method=method)
                if answer is None:
                    return
                answer_head, answer_body, _ = answer
                if stall:
                    with self._lock:
                        self.counts["stalled"] += 1
                    client.sendall(answer_head + answer_body[: len(answer_body) // 2])
                    released.wait()
                    return
                with self._lock:
                    self.counts["forwarded"] += 1
                client.sendall(answer_head + answer_body)
                if b"\r\nconnection: close" in answer_head.lower():
                    return
        except OSError:
            return
        finally:
            self._untrack(client)
            if upstream is not None:
                self._untrack(upstream)


class _Reader:
    """Buffered reads from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            return False
        self.buffer += chunk
        return True

    def until(self, marker: bytes) -> bytes | None:
        while (end := self.buffer.find(marker)) < 0:
            if len(self.buffer) > MAX_HEAD or not self._fill():
                return None
        out = bytes(self.buffer[: end + len(marker)])
        del self.buffer[: end + len(marker)]
        return out

    def exactly(self, count: int) -> bytes | None:
        while len(self.buffer) < count:
            if not self._fill():
                return None
        out = bytes(self.buffer[:count])
        del self.buffer[:count]
        return out


def _read_message(reader: _Reader, *, request: bool, method: str = "") -> tuple[bytes, bytes, str] | None:
    """One HTTP/1.1 message: (its head, its body as sent, the request's method); None at the end of the
    stream. The body is kept as it came (chunked stays chunked)."""
    head = reader.until(b"\r\n\r\n")
    if head is None:
        return None
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0].split(" ")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if request:
        method = first[0]
    else:
        status = int(first[1])
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return head, b"", method
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size_line = reader.until(b"\r\n")
            if size_line is None:
                return None
            body += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            rest = reader.exactly(size + 2)
            if rest is None:
                return None
            body += rest
            if size == 0:
                return head, bytes(body), method
    length = int(headers.get("content-length", "0"))
    body_bytes = reader.exactly(length) if length else b""
    if body_bytes is None:
        return None
    return head, body_bytes, method
