"""`pffs extender` (the kube-scheduler extender that serves pffs's cache-locality score and filter) and
`pffs scheduler` (the secondary scheduler)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

EXTENDER_HELP = """\
Serves the cache-locality filter and score to the default kube-scheduler (an extender: see
deploy/scheduler/extender-config.yaml for the KubeSchedulerConfiguration). A pod that reads pffs datasets
(annotation pffs.io/datasets, or pffs CSI inline volumes) is kept off nodes where pffs does not run, and
nodes score 0-10 by the fraction of its datasets their pffs cache holds (annotation pffs.io/cache on the
Node, published by the pffs CSI node plugin). POST /filter and /prioritize take ExtenderArgs JSON; GET
/healthz answers 200. With nodeCacheCapable: true kube-scheduler sends node names only: give
--kubeconfig or --in-cluster so the extender reads the Nodes' reports itself (listed once, then watched:
a new report counts at once; an API server that cannot watch is listed every --node-refresh seconds).
Runs until SIGTERM or Ctrl-C.
"""


def add_parsers(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    """``verbosity``: the parent parser with -v (the servers touch no cache or backend, so they take none of
    the other global options)."""
    p = sub.add_parser(
        "extender",
        parents=[verbosity],
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
    api = p.add_mutually_exclusive_group()
    api.add_argument(
        "--kubeconfig",
        type=Path,
        help="read Nodes' cache reports from this cluster (needed with nodeCacheCapable: true)",
    )
    api.add_argument("--in-cluster", action="store_true", help="the same, with the pod's service account")
    p.add_argument("--context", help="kubeconfig context (default: current-context)")
    p.add_argument(
        "--node-refresh",
        type=float,
        default=10.0,
        help="seconds between Node listings if the API server cannot watch (default 10)",
    )
    p.set_defaults(run=extender)
    add_scheduler_parser(sub, verbosity)


def extender(args: argparse.Namespace) -> int:
    from pffs.cli.errors import UsageError
    from pffs.scheduler.kube.extender import Extender, NodeWatcher, make_server

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1-65535, not {args.port}")
    if not args.node_refresh > 0:
        raise UsageError(f"--node-refresh must be a positive number of seconds, not {args.node_refresh}")
    service = Extender()
    watcher = None
    if args.kubeconfig or args.in_cluster:
        from pffs.scheduler.kube.api_client import in_cluster_api, kubeconfig_api
        from pffs.scheduler.kube.json_fields import BadObject

        try:
            api = in_cluster_api() if args.in_cluster else kubeconfig_api(args.kubeconfig, args.context)
        except BadObject as exc:
            raise UsageError(str(exc)) from None
        watcher = NodeWatcher(service.reports, api, args.node_refresh)
        watcher.start()
    server = make_server(args.address, args.port, service)
    signal.signal(signal.SIGTERM, _stop)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    source = "Nodes watched on the API server" if watcher else "the Nodes in each request"
    print(f"pffs extender: serving on http://{host}:{port}/ (filter, prioritize, healthz)", flush=True)
    print(f"pffs extender: cache reports from {source}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if watcher:
            watcher.stopped.set()
    return 0


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)  # out of serve_forever, through the finally that closes the socket


SCHEDULER_HELP = """\
A secondary Kubernetes scheduler for pods with `schedulerName: pffs-scheduler`: gangs (the scheduler-plugins
label scheduling.x-k8s.io/pod-group, min member from the PodGroup or the pod annotation pffs.io/min-member),
queues with quotas (--queues FILE, pod label pffs.io/queue), GPU packing, NVLink/ToR topology and cache
locality. Every --interval seconds it lists Nodes, Pods and PodGroups, places whole gangs or nothing, binds
through the Binding API (GPU indexes in the pod annotation pffs.io/gpus), evicts preempted gangs through the
Eviction API, and marks waiting pods PodScheduled=False with the reason. Runs until SIGTERM or Ctrl-C.
"""


def add_scheduler_parser(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "scheduler",
        parents=[verbosity],
        help="run the pffs gang/GPU scheduler for pods with schedulerName: pffs-scheduler",
        description=SCHEDULER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  pffs scheduler --kubeconfig ~/.kube/config --queues deploy/scheduler/queues.yaml --once -v\n"
            "  pffs scheduler --in-cluster --queues /etc/pffs/queues.yaml --interval 2"
        ),
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--kubeconfig", type=Path, help="kubeconfig file (its current context)")
    where.add_argument("--in-cluster", action="store_true", help="use the pod's service account")
    p.add_argument("--context", help="kubeconfig context (default: current-context)")
    p.add_argument("--queues", type=Path, help="queues YAML (default: one queue 'default' without limits)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between cycles (default 2)")
    p.add_argument("--scheduler-name", default="pffs-scheduler", help="schedulerName to serve")
    p.add_argument("--once", action="store_true", help="run one cycle, print what it did, exit")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-address", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.set_defaults(run=scheduler)


def scheduler(args: argparse.Namespace) -> int:
    import json
    import threading

    from pffs.cli.errors import UsageError
    from pffs.scheduler.kube.api_client import ApiError, in_cluster_api, kubeconfig_api
    from pffs.scheduler.kube.json_fields import BadObject
    from pffs.scheduler.kube.loop import Scheduler
    from pffs.scheduler.kube.queues_config import QueuesConfigError, load_queues

    if not args.interval > 0:
        raise UsageError(f"--interval must be a positive number of seconds, not {args.interval}")
    try:
        queues, weights = load_queues(args.queues)
        api = in_cluster_api() if args.in_cluster else kubeconfig_api(args.kubeconfig, args.context)
    except (QueuesConfigError, BadObject) as exc:
        raise UsageError(str(exc)) from None
    session_weights = None
    if weights is not None:
        from pffs.scheduler.core.session import Weights

        session_weights = Weights(**weights)
    sched = Scheduler(api, queues, weights=session_weights, scheduler_name=args.scheduler_name)
    if args.once:
        try:
            report = sched.cycle()
        except ApiError as exc:
            print(f"pffs: error: {exc}", file=sys.stderr)
            return 1
        print(
            json.dumps(
                {
                    "bound": report.bound,
                    "evicted": report.evicted,
                    "pending": report.pending,
                    "errors": report.errors,
                },
                indent=2,
            )
        )
        return 1 if report.errors else 0
    if args.metrics_port is not None:
        from pffs.scheduler.kube.prometheus import start_metrics_server

        if not 0 < args.metrics_port < 65536:
            raise UsageError(f"--metrics-port must be 1-65535, not {args.metrics_port}")
        start_metrics_server(sched.stats, args.metrics_address, args.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    print(f"pffs scheduler: serving schedulerName {args.scheduler_name} on {api.server}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop as SIGTERM does
        sched.run(args.interval, stop)
    return 0
