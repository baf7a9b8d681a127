"""The listener that serves this process's blocks to the group's members (HTTP/1.1, keep-alive, a thread
per connection). Every request must be signed with the group's token; a block is served only by way of
`serve`, which decides whether this process may serve it and gets it from its cache or its backend."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pffs.cache import Block
from pffs.cache.block_format import block_header
from pffs.peers.protocol import BLOCK_PATH, BlockRequest, is_signed

log = logging.getLogger(__name__)

# The block for a request, None if this process does not serve it (404); raises if fetching it failed.
Serve = Callable[[BlockRequest], Block | None]


IDLE_S = 60.0  # a connection silent this long (or a TLS handshake this slow) is closed


class _TlsServer(ThreadingHTTPServer):
    """Each connection's TLS handshake in its own thread, so a slow or silent client holds up no other."""

    def __init__(self, address: tuple[str, int], handler: Any, context: ssl.SSLContext, counts: Any) -> None:
        super().__init__(address, handler)
        self.context = context
        self.counts = counts

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(IDLE_S)
        try:
            connection = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:  # no certificate the group's CA signed: not a member
            self.counts.add("refused")
            log.warning("refused a connection from %s: %s", client_address[0], exc)
            return
        handler: Any = self.RequestHandlerClass  # (typeshed wants the server's own Self here)
        try:
            handler(connection, client_address, self)
        finally:
            connection.close()

    def shutdown_request(self, request: Any) -> None:
        if isinstance(request, socket.socket) and request.fileno() != -1:  # not handed to TLS
            super().shutdown_request(request)


class PeerServer:
    def __init__(
        self,
        address: tuple[str, int],
        token: bytes,
        serve: Serve,
        counts: Any,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.token = token
        self.serve = serve
        self.counts = counts  # PeerCounts
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = IDLE_S

            def do_GET(self) -> None:
                server.answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("peer %s: " + format, self.client_address[0], *args)

        self._http = (
            ThreadingHTTPServer(address, Handler)
            if tls is None
            else _TlsServer(address, Handler, tls, counts)
        )
        self._http.daemon_threads = True
        self.address = self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="pffs-peer-server", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        log.info("serving blocks to the cache group on %s:%s", *self.address)
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path, _, query = handler.path.partition("?")
        if not is_signed(self.token, handler.path, handler.headers):
            self.counts.add("refused")
            log.warning(
                "refused a block request from %s: not signed with this group's token (or its clock is "
                "more than 5 minutes off)",
                handler.client_address[0],
            )
            return _reply(handler, 401, b"not a member of this cache group\n")
        if path != BLOCK_PATH:
            return _reply(handler, 404, b"no such endpoint\n")
        try:
            request = BlockRequest.parse(query)
        except ValueError as exc:
            return _reply(handler, 400, f"bad block request: {exc}\n".encode())
        try:
            block = self.serve(request)
        except Exception as exc:  # its own fetch failed: the member fetches from its backend instead
            log.info("could not serve %s to %s: %s", request.path, handler.client_address[0], exc)
            return _reply(handler, 503, b"fetch failed\n")
        if block is None:
            return _reply(handler, 404, b"not served here\n")
        header = block_header(block)
        # Counted before the write: the member may use the block (and a test read the counts) before
        # this thread runs again after the last byte went out.
        self.counts.add("served_blocks")
        self.counts.add("served_bytes", len(block))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(header) + len(block)))
        handler.end_headers()
        handler.wfile.write(header)
        handler.wfile.write(block)


def _reply(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
