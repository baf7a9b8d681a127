"""Mutual TLS between a cache group's members (optional: --peer-tls-dir).

A folder holds `ca.crt`, `tls.crt` and `tls.key`, as a Kubernetes TLS Secret (cert-manager's, say) mounts
them. Members then talk TLS (1.3 only) and each side must show a certificate the group's CA signed: a
process without one gets no connection at all, before any request is read. Members are addressed by IP,
so the certificate's names are not checked; the CA's signature is what makes a member. The token's
signature on every request stays (a second key, and what binds a request to its block and time).
"""

from __future__ import annotations

import ssl
from pathlib import Path

FILES = ("ca.crt", "tls.crt", "tls.key")


def tls_contexts(folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the listener's context, the client's context) from `folder`; ValueError naming what is wrong."""
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"the peer TLS folder {folder} lacks {', '.join(missing)} (it needs {', '.join(FILES)})"
        )
    ca, cert, key = (str(folder / name) for name in FILES)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # members are addressed by IP: the CA's signature is what counts
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_cert_chain(cert, key)
            context.load_verify_locations(ca)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"the peer TLS files in {folder} cannot be used: {exc}") from None
    return server, client
