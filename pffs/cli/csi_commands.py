"""`pffs csi`: the Kubernetes CSI plugin (node, controller, or both)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pffs.backends.errors import BadOptionError
from pffs.cli.errors import UsageError
from pffs.config import CacheSettings, settings_error

CSI_HELP = """\
Serves the CSI plugin of pffs (driver name csi.pffs.io) on a unix socket, as the node DaemonSet and the
controller Deployment in deploy/csi run it. Node mode: NodeStageVolume starts one pffs mount per volume at
its staging path and NodePublishVolume binds it into each pod, so the pods of a node share one mount and
one disk cache; inline volumes naming the same source share a mount too. Mounts run in their own
session: stopping the plugin (SIGTERM) leaves them serving, and the next plugin process adopts them; a
mount that dies is mounted again in place within seconds and its pods' bind mounts re-bound (pods see it
with mountPropagation: HostToContainer). With --in-cluster or --kubeconfig, the node publishes what its
cache holds as the Node annotation pffs.io/cache for pffs's schedulers. Controller mode: CreateVolume
makes a volume as a new prefix under the StorageClass's source URL; DeleteVolume removes it only with
onDelete: delete. Credentials come only from CSI secrets (accessKeyId, secretAccessKey, sessionToken).
"""


def add_parsers(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    p = sub.add_parser(
        "csi",
        parents=[verbosity],
        help="serve the Kubernetes CSI plugin (node and/or controller)",
        description=CSI_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pffs csi --endpoint unix:///csi/csi.sock --node-id $NODE_ID --mode node "
        "--cache-size 100G --in-cluster",
    )
    p.add_argument("--endpoint", help="unix:///path/csi.sock (default: $CSI_ENDPOINT)")
    p.add_argument("--node-id", help="this node's name (default: $NODE_ID)")
    p.add_argument(
        "--mode", choices=("node", "controller", "all"), default="all", help="services (default all)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/pffs-csi"),
        help="records of staged volumes, credentials files (0600), mount logs (default /var/lib/pffs-csi)",
    )
    p.add_argument(
        "--cache-dir", type=Path, default=s, help="the node's disk cache (default STATE_DIR/cache)"
    )
    p.add_argument("--cache-size", default=s, help="the node's disk cache bound, all volumes (default 10G)")
    p.add_argument("--memory-cache-size", default=s, help="memory cache per mount (default 512M)")
    p.add_argument("--zone", help="topology zone (default: the Node's topology.kubernetes.io/zone label)")
    p.add_argument("--tor", help="top-of-rack switch (default: the Node's pffs.io/tor label)")
    api = p.add_mutually_exclusive_group()
    api.add_argument("--in-cluster", action="store_true", help="reach the API server with the pod's account")
    api.add_argument("--kubeconfig", type=Path, help="reach the API server with this kubeconfig")
    p.add_argument(
        "--report-interval", type=float, default=30.0, help="seconds between cache reports (default 30)"
    )
    p.add_argument(
        "--check-interval", type=float, default=1.0, help="seconds between mount health checks (default 1)"
    )
    p.add_argument(
        "--kubelet-registration-dir",
        type=Path,
        help="register the driver with the kubelet through this plugins_registry folder (what the "
        "node-driver-registrar sidecar does; e.g. /var/lib/kubelet/plugins_registry)",
    )
    p.add_argument(
        "--kubelet-registration-path",
        help="the CSI socket's path as the kubelet sees it (default: --endpoint's path)",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument(
        "--metrics-address", default="127.0.0.1", help="address of every /metrics (default 127.0.0.1)"
    )
    p.add_argument(
        "--mount-metrics-ports",
        metavar="FIRST-LAST",
        help="give each volume's mount its own Prometheus /metrics on a port of this range (e.g. 9820-9899)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pffs.csi.server import PluginOptions, serve

    endpoint = args.endpoint or os.environ.get("CSI_ENDPOINT")
    node_id = args.node_id or os.environ.get("NODE_ID")
    if not endpoint:
        raise UsageError("--endpoint is required (or CSI_ENDPOINT), e.g. unix:///csi/csi.sock")
    if not node_id:
        raise UsageError("--node-id is required (or NODE_ID), e.g. the Node's name from spec.nodeName")
    if args.report_interval <= 0 or args.check_interval <= 0:
        raise UsageError("--report-interval and --check-interval must be positive")
    values: dict[str, Any] = {"cache_dir": getattr(args, "cache_dir", args.state_dir / "cache")}
    for name in ("cache_size", "memory_cache_size"):
        if hasattr(args, name):
            values[name] = getattr(args, name)
    try:
        cache = CacheSettings(**values)
    except ValidationError as exc:
        raise BadOptionError(settings_error(exc).replace("_", "-")) from None
    ports = _port_range(args.mount_metrics_ports) if args.mount_metrics_ports else None
    options = PluginOptions(
        endpoint=endpoint,
        node_id=node_id,
        mode=args.mode,
        state_dir=args.state_dir,
        cache=cache,
        zone=args.zone,
        tor=args.tor,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        check_interval_s=args.check_interval,
        report_interval_s=args.report_interval,
        kubeconfig=args.kubeconfig,
        in_cluster=args.in_cluster,
        mount_metrics_ports=ports,
        kubelet_registration_dir=args.kubelet_registration_dir,
        kubelet_registration_path=args.kubelet_registration_path,
    )
    try:
        from pffs.csi.server import Plugin  # noqa: F401  (import errors surface here, before serving)
    except ImportError as exc:
        raise UsageError(f"the CSI plugin cannot load: {exc}") from None
    try:
        return serve(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _port_range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise UsageError(f"--mount-metrics-ports {text!r}: use FIRST-LAST, e.g. 9820-9899") from None
    if not (1 <= low <= high <= 65535):
        raise UsageError(f"--mount-metrics-ports {text!r}: ports between 1 and 65535, first <= last")
    return low, high
