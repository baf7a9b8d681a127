"""Workload mixes of the openb family that the published traces do not cover, sampled from a base trace.

The published variants were made from ``default`` by sampling its own pods: ``multigpu20/30`` append
multi-GPU pods drawn from default's until they make 20% / 30% of the GPU demand; ``gpushare20..100`` draw
the same number of pods, CPU-only ones as often as in default, GPU pods from default's sharing and
whole-GPU pods in the proportion that gives the sharing pods that share of the GPU demand. The same four
dials make mixes a policy was not tuned on (``make_mix("multigpu40", ...)``):

- ``multigpuX``: default plus multi-GPU pods drawn from its own until they are X% of the GPU demand.
- ``gpushareX``: as the published gpushare traces, sharing pods X% of the GPU demand.
- ``gpuspecX``: default with X% of its GPU pods constrained to one GPU model, drawn GPU by GPU from the
  cluster's GPUs on nodes that could ever host the pod (enough GPUs and CPU), so no pod is made impossible.
- ``nongpuX``: default's GPU pods plus CPU-only pods drawn from its own until they are X% of the pods.

Draws come from the mix's own seed (``seed``); the result is a ``PodList`` in memory (the traces are
research-use data, read in place and never written elsewhere).
"""

from __future__ import annotations

import re

import numpy as np

from pffs.scheduler.replay.model import MILLI, Cluster, IntArray, PodList

KINDS = ("multigpu", "gpushare", "gpuspec", "nongpu")
_NAME = re.compile(r"^(multigpu|gpushare|gpuspec|nongpu)(\d{1,3})$")


def _renamed(pods: PodList, specs: list[str] | None = None) -> PodList:
    """Fresh names in list order (the replay sorts pods by name before its shuffle)."""
    return PodList(
        [f"mix-pod-{i:05d}" for i in range(len(pods))],
        pods.cpu,
        pods.mem,
        pods.share,
        pods.count,
        pods.specs if specs is None else specs,
    )


def _kinds(base: PodList) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """Indices of base's CPU-only, sharing, whole-GPU (one or more) and multi-GPU pods."""
    cpu_only = np.flatnonzero(base.count == 0)
    sharing = np.flatnonzero((base.count == 1) & (base.share < MILLI) & (base.share > 0))
    whole = np.flatnonzero((base.count > 0) & (base.share == MILLI))
    multi = np.flatnonzero(base.count > 1)
    return cpu_only, sharing, whole, multi


def multigpu(base: PodList, percent: int, rng: np.random.Generator) -> PodList:
    _, _, _, multi = _kinds(base)
    demand = base.gpu_milli
    total, in_multi = int(demand.sum()), int(demand[multi].sum())
    extra = []
    while in_multi < percent / 100 * total:
        i = int(multi[rng.integers(len(multi))])
        extra.append(i)
        in_multi += int(demand[i])
        total += int(demand[i])
    return _renamed(base.take(np.concatenate([np.arange(len(base)), np.array(extra, np.int64)])))


def gpushare(base: PodList, percent: int, rng: np.random.Generator) -> PodList:
    cpu_only, sharing, whole, _ = _kinds(base)
    demand = base.gpu_milli
    mean_sharing, mean_whole = demand[sharing].mean(), demand[whole].mean()
    gpu_pods = len(base) - len(cpu_only)
    f = percent / 100
    # n_s * mean_sharing / (n_s * mean_sharing + (gpu_pods - n_s) * mean_whole) = f
    n_sharing = (
        gpu_pods if f >= 1 else round(f * gpu_pods * mean_whole / (mean_sharing * (1 - f) + f * mean_whole))
    )
    picks = np.concatenate(
        [
            rng.choice(cpu_only, len(cpu_only)),
            rng.choice(sharing, n_sharing),
            rng.choice(whole, gpu_pods - n_sharing),
        ]
    )
    return _renamed(base.take(rng.permutation(picks)))


def gpuspec(base: PodList, percent: int, rng: np.random.Generator, cluster: Cluster) -> PodList:
    specs = list(base.specs)
    gpu_node = np.repeat(np.arange(cluster.size), cluster.gpu_count)  # one entry per GPU of the cluster
    for i in np.flatnonzero(base.count > 0).tolist():
        if rng.random() >= percent / 100:
            continue
        hosts = (cluster.gpu_count[gpu_node] >= base.count[i]) & (
            cluster.cpu_capacity[gpu_node] >= base.cpu[i]
        )
        if hosts.any():
            node = int(rng.choice(gpu_node[hosts]))
            specs[i] = cluster.model_names[int(cluster.gpu_model[node])]
    return _renamed(base, specs)


def nongpu(base: PodList, percent: int, rng: np.random.Generator) -> PodList:
    cpu_only = np.flatnonzero(base.count == 0)
    gpu_pods = np.flatnonzero(base.count > 0)
    n_cpu = round(percent / 100 * len(gpu_pods) / (1 - percent / 100))
    picks = np.concatenate([gpu_pods, rng.choice(cpu_only, n_cpu)])
    return _renamed(base.take(rng.permutation(picks)))


def make_mix(name: str, base: PodList, cluster: Cluster, seed: int | None = None) -> PodList:
    """The mix called ``name`` (e.g. ``multigpu40``, ``gpushare50``, ``gpuspec20``, ``nongpu30``) from
    ``base``; ``seed`` defaults to one fixed per name, so a name is always the same mix."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(
            f"unknown mix {name!r} (a kind from {', '.join(KINDS)} and a percentage, e.g. multigpu40)"
        )
    kind, percent = match.group(1), int(match.group(2))
    if not 0 <= percent <= 100 or (kind == "nongpu" and percent >= 100):
        raise ValueError(f"mix {name!r}: the percentage must be 0-100 (below 100 for nongpu)")
    rng = np.random.default_rng(seed if seed is not None else sum(map(ord, name)) * 1009 + percent)
    if kind == "multigpu":
        return multigpu(base, percent, rng)
    if kind == "gpushare":
        return gpushare(base, percent, rng)
    if kind == "gpuspec":
        return gpuspec(base, percent, rng, cluster)
    return nongpu(base, percent, rng)
