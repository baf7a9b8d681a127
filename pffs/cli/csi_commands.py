"""`pffs csi`: the Kubernetes CSI plugin (node, controller, or both)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pffs.cli.errors import UsageError

if TYPE_CHECKING:
    pass


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
        help="mounts started by this process (no --mounter) serve /metrics on ports of this range, which "
        "--metrics-port serves again with a `volume` label (e.g. 9820-9899)",
    )
    p.add_argument(
        "--kubelet-dir",
        type=Path,
        help="the kubelet's root dir, mounted here at the host's path with Bidirectional propagation: "
        "staging and target paths must be under it, inline volumes' mounts go there "
        "(e.g. /var/lib/kubelet); until a kubelet serves there the plugin is not ready and touches no mount",
    )
    p.add_argument(
        "--ready-file",
        type=Path,
        help="keep the plugin's readiness in this file: ok, or why it is not ready (for an exec "
        "readiness probe, which shows the reason in the pod's Events)",
    )
    p.add_argument(
        "--mounter",
        metavar="unix:///PATH",
        help="start mounts through `pffs csi-mounter` on this socket, so they outlive this process's "
        "container (the node DaemonSet's default); without it, mounts run in this container",
    )
    group = p.add_argument_group(
        "cache group",
        "volumes with cacheGroup: share or consume fetch each block once for all nodes (README: 'Cache "
        "groups'); the plugins find each other through the Nodes (needs --in-cluster or --kubeconfig)",
    )
    group.add_argument(
        "--cache-group-token-file",
        type=Path,
        metavar="FILE",
        help="the group's shared token (a Secret's key, at this same path in the mounter's container); "
        "without it, volumes asking for a cache group are refused",
    )
    group.add_argument(
        "--node-ip", help="the address other nodes reach this node's mounts on (default: $NODE_IP)"
    )
    group.add_argument(
        "--cache-group-ports",
        metavar="FIRST-LAST",
        default="9830-9869",
        help="ports the sharing volumes' mounts serve the group on, one each (default 9830-9869)",
    )
    group.add_argument(
        "--cache-group-tls-dir",
        type=Path,
        metavar="DIR",
        help="mutual TLS between the mounts of the group: ca.crt, tls.crt and tls.key (a TLS Secret's "
        "files, at this same path in the mounter's container)",
    )
    group.add_argument(
        "--cache-group-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long a member may take to answer before the block comes from the backend (default 2)",
    )
    p.add_argument(
        "--warmups",
        action="store_true",
        help="DatasetWarmup resources (pffs.io/v1alpha1): in node mode, warm this node's cache for the "
        "warm-ups that chose it; in controller mode, resolve them, roll their progress up and ungate the "
        "pods waiting for them (needs --in-cluster or --kubeconfig)",
    )
    p.add_argument(
        "--namespace",
        help="the plugin's own namespace: warm-ups' Secrets, the controller's Lease (default: "
        "$POD_NAMESPACE, else the pod's service account's)",
    )
    _log_format_option(p)
    p.set_defaults(run=run)

    m = sub.add_parser(
        "csi-mounter",
        parents=[verbosity],
        help="run the node's CSI mount processes (for `pffs csi --mounter`)",
        description=MOUNTER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pffs csi-mounter --socket /var/lib/pffs-csi/mounter.sock --metrics-port 9811",
    )
    m.add_argument(
        "--socket",
        type=Path,
        default=Path("/var/lib/pffs-csi/mounter.sock"),
        help="the unix socket the node plugin asks on (default /var/lib/pffs-csi/mounter.sock; 0600)",
    )
    m.add_argument(
        "--metrics-port", type=int, help="serve /metrics (every mount's, with a volume label) and /healthz"
    )
    m.add_argument("--metrics-address", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)")
    m.add_argument(
        "--mount-metrics-ports",
        metavar="FIRST-LAST",
        default="19820-19899",
        help="loopback ports the mounts serve their own /metrics on, for --metrics-port to gather "
        "(default 19820-19899)",
    )
    _log_format_option(m)
    m.set_defaults(run=run_mounter)

    c = sub.add_parser(
        "csi-preflight",
        parents=[verbosity],
        help="check that the kubelet is where the node plugin will look for it (a Helm hook runs it)",
        description="Exits 0 if a kubelet serves at --kubelet-dir on this host; else 1, printing the path "
        "the kubelet really uses when it can be found. The chart runs it before every install, upgrade and "
        "rollback (node.preflight), so a wrong node.kubeletPath stops `helm install` and `helm upgrade` "
        "before they change anything.",
        epilog="example:\n  pffs csi-preflight --kubelet-dir /var/lib/kubelet --host-root /proc/1/root",
    )
    c.add_argument("--kubelet-dir", type=Path, required=True, help="the node.kubeletPath to check")
    c.add_argument(
        "--host-root",
        default="",
        help="where the host's / is seen from here (/proc/1/root in a pod with hostPID; default: here)",
    )
    c.set_defaults(run=run_preflight)

    q = sub.add_parser(
        "csi-pods",
        parents=[verbosity],
        help="list, per node, the pods that hold pffs volumes (to drain before replacing a mounter)",
        description="Lists, node by node, every running pod that uses a pffs volume (inline, or a "
        "PersistentVolume of csi.pffs.io through its claim): the volume, its source, read-only or not, and "
        "whether the pod would read on after the node's mounter is replaced (files opened anew read again "
        "only in containers mounting it with mountPropagation: HostToContainer; files held open fail in "
        "every pod). Reads the API with your kubeconfig, as kubectl does.",
        epilog="examples:\n  pffs csi-pods\n  pffs csi-pods --node gpu-node-7 --json",
    )
    q.add_argument("--node", help="only this node's pods")
    q.add_argument("--json", action="store_true", help="one JSON list of pod volumes instead of the table")
    q.add_argument("--kubeconfig", type=Path, help="the kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    q.set_defaults(run=run_pods)


MOUNTER_HELP = """\
Runs the pffs mount processes of a node's CSI volumes, in a pod of their own (the DaemonSet
pffs-csi-mounter, updated only OnDelete), so that restarting, upgrading or rolling back the node plugin
never ends a mount: files pods hold open keep working through it. The node plugin (pffs csi --mounter)
asks it on a unix socket to start each mount; everything else (records, binds into pods, repairs) stays
with the plugin. Stopping the mounter (SIGTERM) stops every mount it runs, after their pending uploads.
"""


def _log_format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text lines, or one JSON object per line for log collectors (default text)",
    )


def run_preflight(args: argparse.Namespace) -> int:
    import sys

    from pffs.csi.kubelet import kubelet_problem

    if not args.kubelet_dir.is_absolute():
        raise UsageError(f"--kubelet-dir {args.kubelet_dir}: give an absolute path, e.g. /var/lib/kubelet")
    node = os.environ.get("NODE_ID")
    on = f" on node {node}" if node else ""
    problem = kubelet_problem(args.kubelet_dir, host_root=args.host_root.rstrip("/"))
    if problem is not None:
        print(f"pffs-csi preflight{on}: {problem}", file=sys.stderr, flush=True)
        return 1
    print(f"pffs-csi preflight{on}: the kubelet serves at {args.kubelet_dir} (node.kubeletPath)", flush=True)
    return 0


def run_pods(args: argparse.Namespace) -> int:
    import json
    import sys

    from kubernetes import client, config

    from pffs.csi.identity import DRIVER_NAME
    from pffs.csi.pods import held_volumes, held_volumes_table

    configuration = client.Configuration()
    path = str(args.kubeconfig) if args.kubeconfig else None
    try:
        config.load_kube_config(config_file=path, client_configuration=configuration)
    except Exception as exc:  # no kubeconfig, or one that does not load
        print(f"pffs csi-pods: no usable kubeconfig ({exc}); give --kubeconfig", file=sys.stderr)
        return 1
    configuration.retries = 0  # one clear line, not urllib3's warning per retry
    core = client.CoreV1Api(client.ApiClient(configuration))
    try:
        held = held_volumes(core, DRIVER_NAME, args.node)
    except client.ApiException as exc:
        reason = " ".join(str(exc.reason).split())
        print(f"pffs csi-pods: the API server answered HTTP {exc.status} {reason}", file=sys.stderr)
        return 1
    except Exception as exc:  # unreachable, refused, timed out, a certificate refused
        reason = " ".join(str(exc).split())[:300]
        print(f"pffs csi-pods: could not read the API at {configuration.host}: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([h.model_dump() for h in held], indent=1))
    else:
        sys.stdout.write(held_volumes_table(held))
    return 0


def run_mounter(args: argparse.Namespace) -> int:
    from pffs.csi.mounter import serve_mounter

    if not args.socket.is_absolute():
        raise UsageError(f"--socket {args.socket}: give an absolute path")
    ports = _port_range(args.mount_metrics_ports, "--mount-metrics-ports")
    return serve_mounter(args.socket, args.metrics_address, args.metrics_port, ports)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from pffs.backends.errors import BadOptionError
    from pffs.config import CacheSettings, settings_error
    from pffs.csi.server import PluginOptions, serve
    from pffs.csi.warmups import own_namespace

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
    ports = None
    if args.mount_metrics_ports:
        ports = _port_range(args.mount_metrics_ports, "--mount-metrics-ports")
    mounter = _unix_socket(args.mounter, "--mounter") if args.mounter else None
    if args.kubelet_dir is not None and not args.kubelet_dir.is_absolute():
        raise UsageError(f"--kubelet-dir {args.kubelet_dir}: give an absolute path, e.g. /var/lib/kubelet")
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
        kubelet_dir=args.kubelet_dir,
        ready_file=args.ready_file,
        mounter=mounter,
        cache_group=_cache_group(args),
        warmups=args.warmups,
        namespace=args.namespace or os.environ.get("POD_NAMESPACE") or own_namespace(),
    )
    try:
        from pffs.csi.server import Plugin  # noqa: F401  (import errors surface here, before serving)
    except ImportError as exc:
        raise UsageError(f"the CSI plugin cannot load: {exc}") from None
    try:
        return serve(options)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _cache_group(args: argparse.Namespace) -> Any:
    from pffs.csi.cache_group import GroupConfig

    if args.cache_group_token_file is None:
        return None
    node_ip = args.node_ip or os.environ.get("NODE_IP")
    if not node_ip:
        raise UsageError(
            "--cache-group-token-file needs --node-ip (or NODE_IP, e.g. from the pod's status.hostIP)"
        )
    if not args.cache_group_token_file.is_absolute():
        raise UsageError(f"--cache-group-token-file {args.cache_group_token_file}: give an absolute path")
    if not 0 < args.cache_group_timeout <= 60:
        raise UsageError("--cache-group-timeout: seconds, more than 0 and at most 60")
    return GroupConfig(
        node_ip=node_ip,
        ports=_port_range(args.cache_group_ports, "--cache-group-ports"),
        token_file=args.cache_group_token_file,
        timeout_s=args.cache_group_timeout,
        tls_dir=args.cache_group_tls_dir,
    )


def _port_range(text: str, option: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    try:
        low, high = int(first), int(last or first)
    except ValueError:
        raise UsageError(f"{option} {text!r}: use FIRST-LAST, e.g. 9820-9899") from None
    if not (1 <= low <= high <= 65535):
        raise UsageError(f"{option} {text!r}: ports between 1 and 65535, first <= last")
    return low, high


def _unix_socket(text: str, option: str) -> Path:
    path = text.removeprefix("unix://") if text.startswith("unix://") else text.removeprefix("unix:")
    if not path.startswith("/"):
        raise UsageError(f"{option} {text!r}: use unix:///absolute/path.sock")
    return Path(path)
