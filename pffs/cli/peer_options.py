"""The cache-group options of `pffs mount` and `pffs warmup` (pffs.peers), and the settings they make."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


def add_peer_options(parser: argparse.ArgumentParser, serving: bool) -> None:
    """`serving`: the command may serve the group (a mount); otherwise it only reads from it (warm-up)."""
    group = parser.add_argument_group(
        "cache group",
        "share blocks with pffs on other nodes: each block is fetched from the backend by its owner among "
        "the members, once, and served to the others (see the README's 'Cache groups')",
    )
    group.add_argument(
        "--peers",
        metavar="HOST:PORT,...",
        help="every member that serves blocks" + (" (this mount too, if it does)" if serving else ""),
    )
    group.add_argument(
        "--peers-file",
        metavar="FILE",
        help="a file of members, one HOST:PORT per line, read again when it changes (with or instead of "
        "--peers; the CSI node plugin writes one from the Nodes it watches)",
    )
    if serving:
        group.add_argument(
            "--peer-listen",
            metavar="HOST:PORT",
            help="serve this mount's blocks to the members on this address, as it appears in --peers; "
            "without it the mount only reads from the group",
        )
        group.add_argument(
            "--no-share",
            action="store_true",
            help="read from the group but serve nothing (what a mount without --peer-listen does; an "
            "ephemeral pod's mount, say)",
        )
    group.add_argument(
        "--peer-token-file",
        metavar="FILE",
        help="a file holding the group's shared token (at least 16 characters, e.g. openssl rand -hex 32)",
    )
    group.add_argument(
        "--peer-tls-dir",
        metavar="DIR",
        help="mutual TLS between members: a folder holding ca.crt, tls.crt and tls.key (a Kubernetes TLS "
        "Secret's files); each member must show a certificate that CA signed",
    )
    group.add_argument(
        "--peer-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a member may take to answer before the block comes from the backend (default 2)",
    )


def peer_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The cache group's settings (PeerSettings' fields) from the options above; None without members."""
    from pffs.backends.errors import BadOptionError

    listen, no_share = getattr(args, "peer_listen", None), getattr(args, "no_share", False)
    if no_share and listen:
        raise BadOptionError("--no-share serves nothing: leave out --peer-listen")
    if not args.peers and not args.peers_file:
        if listen or args.peer_token_file or no_share:
            raise BadOptionError(
                "--peer-listen, --no-share and --peer-token-file need --peers or --peers-file (the group's "
                "members)"
            )
        return None
    if args.peer_token_file is None:
        raise BadOptionError("--peers needs --peer-token-file: a file holding the group's shared token")
    given = {
        "members": args.peers,
        "members_file": args.peers_file and Path(args.peers_file).expanduser().resolve(),
        "listen": listen,
        "token_file": Path(args.peer_token_file).expanduser().resolve(),
        "timeout_s": args.peer_timeout,
        "tls_dir": args.peer_tls_dir and Path(args.peer_tls_dir).expanduser().resolve(),
    }
    return {k: v for k, v in given.items() if v is not None}
