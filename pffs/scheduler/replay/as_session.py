"""A trace's cluster and pods as the gang core's objects, to run ``run_session`` where the replay runs (the
session's speed and placements on the openb traces: bench/scheduler.py, bench/scheduler_session.py)."""

from __future__ import annotations

import numpy as np

from pffs.scheduler.core.objects import Gpu, Node, Pod, PodGroup
from pffs.scheduler.replay.model import Cluster, IntArray, PodList


def session_nodes(cluster: Cluster, names: list[str] | None = None) -> list[Node]:
    """The trace cluster as the gang core's nodes (NVLink groups of 4 GPUs, 16 nodes per ToR), named
    ``names`` (default: the trace's node names)."""
    return [
        Node(
            name,
            int(cluster.cpu_capacity[i]),
            int(cluster.mem_capacity[i]),
            tuple(Gpu(g, g // 4, g // 4) for g in range(int(cluster.gpu_count[i]))),
            cluster.model_names[cluster.gpu_model[i]] if cluster.gpu_model[i] >= 0 else "",
            f"tor{i // 16}",
        )
        for i, name in enumerate(names or cluster.names)
    ]


def ranked_names(node_rank: IntArray) -> list[str]:
    """Node names whose order is the seed's node order (``replay_order``): the session's score ties go to
    the lowest name, the replay's to the seed's first node."""
    return [f"n{int(r):05d}" for r in np.asarray(node_rank).tolist()]


def session_group(trace: PodList, i: int, name: str, created: float) -> PodGroup:
    """Trace pod ``i`` as a group of its own (``load_pods`` clipped shares and made 0-milli pods CPU-only)."""
    models = frozenset(m for m in trace.specs[i].split("|") if m)
    pod = Pod(
        trace.names[i],
        name,
        int(trace.cpu[i]),
        int(trace.mem[i]),
        int(trace.count[i]),
        int(trace.share[i]),
        models,
    )
    return PodGroup(name, "default", [pod], 1, 0, created)
