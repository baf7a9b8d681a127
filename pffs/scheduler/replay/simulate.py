"""Replaying an openb GPU trace with one placement policy, by the FGD paper's protocol (SCHED_PROTOCOL.md).

Pods arrive one by one in the seed's order (``traces.replay_order``) and never leave; each goes to the
feasible node its policy scores highest (a tie goes to the node the seed ranks first) or fails for good.
After every pod event the replay records the GPU demand that has arrived and the GPU milli allocated, from
which ``metrics`` computes "alloc at X% arrived".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pffs.scheduler.replay import metrics
from pffs.scheduler.replay.model import Cluster, IntArray, PodList
from pffs.scheduler.replay.policies import make_policy
from pffs.scheduler.replay.traces import DEFAULT_RATIO, replay_order

REPORT_LEVELS = (100, 130)


@dataclass
class ReplayResult:
    policy: str
    seed: int
    pods: int
    placed: int
    failed: int
    seconds: float
    capacity_milli: int
    arrived: IntArray = field(repr=False)  # per pod event: GPU milli requested so far
    used: IntArray = field(repr=False)  # per pod event: GPU milli allocated after it
    cluster: Cluster | None = field(default=None, repr=False)  # the nodes as the replay left them

    @property
    def pods_per_second(self) -> float:
        return self.pods / self.seconds if self.seconds > 0 else float("inf")

    def alloc_at(self, level: int) -> float | None:
        return metrics.alloc_at(self.arrived, self.used, self.capacity_milli, level)

    def curve(self) -> dict[int, float]:
        return metrics.alloc_curve(self.arrived, self.used, self.capacity_milli)

    def summary(self) -> dict[str, Any]:
        """The figures a person or a script wants, JSON-ready."""
        return {
            "policy": self.policy,
            "seed": self.seed,
            "pods": self.pods,
            "placed": self.placed,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "pods_per_second": round(self.pods_per_second, 1),
            "alloc_at": {str(level): self.alloc_at(level) for level in REPORT_LEVELS},
        }


def replay(
    cluster: Cluster,
    trace: PodList,
    policy_name: str,
    seed: int,
    ratio: float = DEFAULT_RATIO,
    stop_at: float | None = None,
) -> ReplayResult:
    """Place the seed's pod sequence on an empty copy of ``cluster`` with the named policy. With
    ``stop_at`` (a fraction of the GPU capacity), stop before the first pod whose demand would take the
    arrived total past it: ``cluster`` of the result is then the cluster at that point."""
    cluster = cluster.copy()
    order = replay_order(trace, cluster, seed, ratio)
    policy = make_policy(policy_name, cluster, trace, order.rng)
    rank = order.node_rank
    model_bits = cluster.model_bits()
    n = len(order.pods)
    limit = None if stop_at is None else stop_at * cluster.gpu_capacity_milli
    arrived = np.empty(n, np.int64)
    used = np.empty(n, np.int64)
    demand = allocated = placed = 0
    start = time.perf_counter()
    for event, index in enumerate(order.pods.tolist()):
        pod = trace.pod(index, cluster)
        if limit is not None and demand + pod.gpu_milli > limit:
            n = event
            break
        demand += pod.gpu_milli
        nodes = np.flatnonzero(cluster.feasible(pod, model_bits))
        if len(nodes):
            scores = policy.scores(cluster, pod, nodes)
            best = nodes[scores == scores.max()]
            node = int(best[rank[best].argmin()])
            cluster.place(node, pod, policy.choose_gpus(cluster, pod, node))
            policy.node_changed(cluster, node)
            allocated += pod.gpu_milli
            placed += 1
        arrived[event] = demand
        used[event] = allocated
    seconds = time.perf_counter() - start
    return ReplayResult(
        policy_name,
        seed,
        n,
        placed,
        n - placed,
        seconds,
        cluster.gpu_capacity_milli,
        arrived[:n],
        used[:n],
        cluster,
    )
