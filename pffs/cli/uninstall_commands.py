"""`pffs csi-uninstall`: what `helm uninstall` leaves of the driver's own writing, removed (csi/uninstall.py).
The chart runs it as a post-delete hook (uninstall.cleanup)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pffs.cli.errors import UsageError


def add_parsers(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    u = sub.add_parser(
        "csi-uninstall",
        parents=[verbosity],
        help="remove what the CSI driver wrote at run time (a Helm post-delete hook runs it)",
        description="Once the node plugin pods of NAMESPACE are gone (waiting up to --wait seconds), removes "
        "the Node annotations pffs.io/cache and pffs.io/cache-group from every Node and the Leases "
        "csi-pffs-io and pffs-warmup-controller from NAMESPACE. Idempotent. The chart runs it after "
        "`helm uninstall` (uninstall.cleanup); the CRD and each node's state dir stay (docs/operations.md).",
        epilog="example:\n  pffs csi-uninstall --namespace pffs-system --in-cluster",
    )
    u.add_argument("--namespace", required=True, help="the release's namespace (where its Leases are)")
    where = u.add_mutually_exclusive_group()
    where.add_argument("--in-cluster", action="store_true", help="use the pod's service account")
    where.add_argument(
        "--kubeconfig", type=Path, help="the kubeconfig (default: $KUBECONFIG, ~/.kube/config)"
    )
    u.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the node plugin pods to go (default 120)",
    )
    u.add_argument(
        "--delete-crd",
        action="store_true",
        help="also delete the CRD datasetwarmups.pffs.io, and with it every DatasetWarmup of the cluster",
    )
    u.set_defaults(run=run_uninstall)


def run_uninstall(args: argparse.Namespace) -> int:
    from kubernetes import client, config

    from pffs.csi.uninstall import clean_up

    if args.wait < 0:
        raise UsageError(f"--wait {args.wait:g}: give seconds, 0 or more")
    configuration = client.Configuration()
    try:
        if args.in_cluster:
            config.load_incluster_config(client_configuration=configuration)
        else:
            path = str(args.kubeconfig) if args.kubeconfig else None
            config.load_kube_config(config_file=path, client_configuration=configuration)
    except Exception as exc:  # no kubeconfig, or not in a pod
        raise UsageError(f"cannot reach the cluster: {exc}") from None
    done = clean_up(
        client.ApiClient(configuration), args.namespace, wait_s=args.wait, delete_crd=args.delete_crd
    )
    nodes = ", ".join(done.nodes) or "none"
    leases = ", ".join(done.leases) or "none"
    crd = "; CRD datasetwarmups.pffs.io deleted" if done.crd else ""
    print(f"pffs csi-uninstall: cache annotations removed from nodes: {nodes}; Leases deleted: {leases}{crd}")
    return 0
