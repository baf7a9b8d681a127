"""`pffs extender`: the kube-scheduler extender that serves pffs's cache-locality score and filter."""

from __future__ import annotations

import argparse
import signal
from typing import Any

EXTENDER_HELP = """\
Serves the cache-locality filter and score to the default kube-scheduler (an extender: see
deploy/scheduler/extender-config.yaml for the KubeSchedulerConfiguration). A pod that reads pffs datasets
(annotation pffs.io/datasets, or pffs CSI inline volumes) is kept off nodes where pffs does not run, and
nodes score 0-10 by the fraction of its datasets their pffs cache holds (annotation pffs.io/cache on the
Node, published by the pffs CSI node plugin). POST /filter and /prioritize take ExtenderArgs JSON; GET
/healthz answers 200. Runs until SIGTERM or Ctrl-C.
"""


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "extender",
        parents=[common],
        help="serve the cache-locality score to kube-scheduler (scheduler extender)",
        description=EXTENDER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pffs extender --port 8888   # urlPrefix: http://127.0.0.1:8888/",
    )
    p.add_argument("--port", type=int, default=8888, help="TCP port (default 8888)")
    p.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, beside kube-scheduler; 0.0.0.0 behind a Service)",
    )
    p.set_defaults(run=extender)


def extender(args: argparse.Namespace) -> int:
    from pffs.cli.errors import UsageError
    from pffs.scheduler.extender import make_server

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1-65535, not {args.port}")
    server = make_server(args.address, args.port)
    signal.signal(signal.SIGTERM, _stop)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(f"pffs extender: serving on http://{host}:{port}/ (filter, prioritize, healthz)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)  # out of serve_forever, through the finally that closes the socket
