"""Pods bound per second against a real API server: `pffs scheduler` (pods in gangs of 1-8, placed whole)
versus kube-scheduler v1.37.2 (the same pods, no gangs), on plain Node objects (no kubelets), each in a
fresh control plane (pffs.testing.kube_cluster), with the API server's CPU time while it schedules.

    .venv/bin/python bench/kube_throughput.py [--nodes 500] [--pods 1000]

Writes bench/results/kube_throughput.json and .png. The clock starts when the scheduler starts (all pods and
nodes already exist) and stops when the last pod has a node.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pffs.testing.kube_cluster import (  # noqa: E402
    KubeControlPlane,
    add_node,
    missing_binaries,
    pffs_scheduler_command,
)
from pffs.testing.s3_server import free_ports  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def make_nodes(api: Any, count: int) -> None:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}

    def one(i: int) -> None:
        add_node(api, f"node-{i:04d}", resources, labels={"pffs.io/tor": f"tor-{i // 32}"})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(count)))


def make_pods(api: Any, count: int, scheduler_name: str, gangs: bool, seed: int = 7) -> None:
    """`count` one-GPU pods; with gangs, in groups of 1-8 (min member = the group's size)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    rng = random.Random(seed)
    pods: list[dict[str, Any]] = []
    group = 0
    while len(pods) < count:
        size = min(rng.randint(1, 8), count - len(pods))
        for member in range(size):
            metadata: dict[str, Any] = {"name": f"g{group:04d}-{member}"}
            if gangs:
                metadata["labels"] = {"scheduling.x-k8s.io/pod-group": f"g{group:04d}"}
                metadata["annotations"] = {"pffs.io/min-member": str(size)}
            pods.append(
                {
                    "metadata": metadata,
                    "spec": {
                        "schedulerName": scheduler_name,
                        "containers": [
                            {
                                "name": "c",
                                "image": "busybox:1.36",
                                "resources": {
                                    "limits": {"nvidia.com/gpu": "1"},
                                    "requests": {"cpu": "2", "memory": "8Gi"},
                                },
                            }
                        ],
                    },
                }
            )
        group += 1
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda pod: core.create_namespaced_pod("default", pod), pods))


def all_bound(api: Any) -> bool:
    """No pod without a node: one small request (the API server filters; at most one pod comes back),
    so the polling adds little to the API server's CPU time measured meanwhile."""
    from kubernetes import client

    return (
        not client.CoreV1Api(api)
        .list_namespaced_pod("default", field_selector="spec.nodeName=", limit=1)
        .items
    )


def bound_count(api: Any) -> int:
    from kubernetes import client

    pods = client.CoreV1Api(api).list_namespaced_pod("default", limit=5000).items
    return sum(1 for pod in pods if pod.spec.node_name)


def run(kind: str, nodes: int, pods: int, workdir: Path) -> dict[str, Any]:
    with KubeControlPlane(workdir / kind, start_scheduler=False) as cluster:
        api = cluster.api()
        make_nodes(api, nodes)
        make_pods(
            api, pods, "pffs-scheduler" if kind == "pffs" else "default-scheduler", gangs=kind == "pffs"
        )
        apiserver = cluster.processes["kube-apiserver"].pid
        cpu_before = cpu_seconds(apiserver)
        log = open(workdir / f"{kind}-scheduler.log", "ab")  # noqa: SIM115 (closed below)
        if kind == "pffs":
            queues = workdir / "queues.yaml"
            queues.write_text("queues:\n  - name: default\n    weight: 1\n")
            args = pffs_scheduler_command(cluster.kubeconfig, queues, "0.2")
        else:
            # kube-scheduler's client is rate-limited (50 requests/s by default, one Binding per pod);
            # the "unthrottled" run lifts that limit, as operators of large clusters do.
            connection: dict[str, Any] = {"kubeconfig": str(cluster.kubeconfig)}
            if kind == "kube-scheduler-unthrottled":
                connection |= {"qps": 5000, "burst": 10000}
            config = workdir / f"{kind}.yaml"
            config.write_text(
                json.dumps(
                    {
                        "apiVersion": "kubescheduler.config.k8s.io/v1",
                        "kind": "KubeSchedulerConfiguration",
                        "clientConnection": connection,
                        "leaderElection": {"leaderElect": False},
                    }
                )
            )
            port = str(free_ports(1)[0])
            args = [
                str(cluster.bin / "kube-scheduler"),
                "--config",
                str(config),
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                port,
            ]
        started = time.monotonic()
        scheduler = subprocess.Popen(args, stdout=log, stderr=log)
        try:
            while time.monotonic() - started < 600:
                time.sleep(0.5)
                if all_bound(api):
                    break
            elapsed = time.monotonic() - started
            apiserver_cpu = cpu_seconds(apiserver) - cpu_before
            scheduler_cpu = cpu_seconds(scheduler.pid)
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=30)
            log.close()
        done = bound_count(api)
        return {
            "bound": done,
            "seconds": round(elapsed, 2),
            "pods_per_second": round(done / elapsed, 1),
            "apiserver_cpu_seconds": round(apiserver_cpu, 2),
            "scheduler_cpu_seconds": round(scheduler_cpu, 2),
        }


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].bar(
        names, [results["runs"][n]["pods_per_second"] for n in names], color=["#1f77b4", "#999999", "#666666"]
    )
    axes[0].set_title("pods bound per second")
    axes[1].bar(
        names,
        [results["runs"][n]["apiserver_cpu_seconds"] for n in names],
        color=["#1f77b4", "#999999", "#666666"],
    )
    axes[1].set_title("kube-apiserver CPU seconds")
    fig.suptitle(f"{results['pods']} one-GPU pods on {results['nodes']} nodes (pffs: gangs of 1-8)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=1000)
    args = parser.parse_args()
    if missing := missing_binaries():
        sys.exit(f"needs {', '.join(missing)}: run `make setup`")
    workdir = Path(tempfile.mkdtemp(prefix="pffs-kube-bench-"))
    kinds = ("pffs", "kube-scheduler", "kube-scheduler-unthrottled")
    runs = {kind: run(kind, args.nodes, args.pods, workdir) for kind in kinds}
    if any(r["bound"] < args.pods for r in runs.values()):
        print(f"not every pod was bound: see the logs in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {
        "nodes": args.nodes,
        "pods": args.pods,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "pffs_over_kube_scheduler": round(
            runs["pffs"]["pods_per_second"] / runs["kube-scheduler"]["pods_per_second"], 2
        ),
        "pffs_over_unthrottled_kube_scheduler": round(
            runs["pffs"]["pods_per_second"] / runs["kube-scheduler-unthrottled"]["pods_per_second"], 2
        ),
    }
    out = REPO / "bench" / "results"
    (out / "kube_throughput.json").write_text(json.dumps(results, indent=1) + "\n")
    chart(results, out / "kube_throughput.png")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
