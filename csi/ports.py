"""Whether a TCP port can be bound now (the node plugin hands ports out to mounts it starts)."""

from __future__ import annotations

import socket


def can_bind(host: str, port: int, *, reuse_address: bool = False) -> bool:
    """True if `host:port` can be bound; `reuse_address` as the listener that will use it sets it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if reuse_address:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
