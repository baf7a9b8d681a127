"""The session's scoring plugins, and the vectorised arithmetic they share with it.

Each plugin is a function of (state, pod, group context, candidate nodes) and returns one score in 0..1 per
candidate node: they are vectorised across the candidates (NumPy arrays of node indices into the session's
``ClusterState``), which is the same as calling a (state, pod, node) function once per node. Only feasible
nodes are ever scored, so no score can override a hard constraint; the session adds the scores, each times
its weight (``Weights``; 0 switches a plugin off), and takes the best node, ties to the lowest node name.

- ``binpack``: how full the node is after the placement (GPU share for GPU pods, CPU and memory otherwise):
  fills used nodes first, so a group touches few nodes and whole nodes stay free for big pods.
- ``fragmentation``: pffs's trace policy's score (``PffsPolicy``, which beats FGD on the openb traces, see
  bench/scheduler.py), in the spirit of FGD (Weng et al., USENIX ATC '23): the drop of the GPU milli the
  node would strand if filled with the session's typical pod shapes (GPU slots and CPU both counted) plus
  ``NEXT_POD_WEIGHT`` times FGD's next-pod fragment (``TypicalShapes.waste``), shapes weighted as the trace
  policy's (``TypicalShapes.for_stranding``), as whole points of a sigmoid (``score_points``) over 100, so
  near-equal moves tie and go to the lowest node name; a sharing pod's on the best of the GPUs it fits
  (``sharing_growth``), which is the GPU it then takes (``best_sharing_gpus``). Where CPU-only pods ask
  for much of the CPU (``CONTESTED_CPU``), a GPU pod is scored as the trace policy's ``ContestedGpuPolicy``
  scores it.
- ``topology``: a multi-GPU pod scores 1 where one NVLink group has its GPUs free, 0.5 where one NUMA
  domain has, 0 where they would span domains (the GPU set itself is chosen by ``choose_gpus``).
- ``tor``: 1 under a ToR switch the group already uses; elsewhere up to 0.5, by how much of the rest of the
  group that ToR could still take.
- ``locality``: the mean fraction of the group's datasets that the node's pffs cache holds warm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pffs.scheduler.core.arrays import FloatArray, IntArray
from pffs.scheduler.core.fragmentation import (
    CONTESTED_TEMPERATURE,
    POINTS,
    TEMPERATURE,
    contested_tie_break,
    score_points,
)
from pffs.scheduler.core.objects import MILLI, Pod, PodGroup, is_sharing, uses_gpus

if TYPE_CHECKING:
    from pffs.scheduler.core.fragmentation import TypicalShapes
    from pffs.scheduler.core.state import ClusterState

BIG = 2**40  # "unbounded" fit count for a resource a shape does not ask for


@dataclass
class GroupContext:
    """What the plugins need to know about the group being placed: how many of its pods are still to go in
    this attempt, and how warm each node is for its datasets."""

    group: PodGroup
    remaining: int
    locality: FloatArray  # (nodes,)


def gpu_rows_after(
    state: ClusterState, pod: Pod, nodes: IntArray, sharing_slots: IntArray | None = None
) -> IntArray:
    """Each candidate node's free milli per GPU after the pod is placed there (the pod must fit).

    A sharing pod takes the GPU of ``sharing_slots`` (one per node; ``best_sharing_gpus``) or else the first
    that fits; a whole-GPU pod takes ``gpu_count`` fully free GPUs: which ones does not change the multiset
    of free amounts."""
    rows = state.gpu_free[nodes].copy()
    if not uses_gpus(pod) or len(nodes) == 0:
        return rows
    if is_sharing(pod):
        pick = np.argmax(rows >= pod.gpu_milli, axis=1) if sharing_slots is None else sharing_slots
        rows[np.arange(len(nodes)), pick] -= pod.gpu_milli
    else:
        full = rows >= MILLI
        first_k = full & (np.cumsum(full, axis=1) <= pod.gpu_count)
        rows = np.where(first_k, rows - pod.gpu_milli, rows)
    return rows


def fit_counts(
    cpu_free: IntArray, mem_free: IntArray, gpu_rows: IntArray, pod: Pod
) -> IntArray:  # how many pods shaped like ``pod`` fit on each node (static constraints aside)
    n = np.full(len(cpu_free), BIG, dtype=np.int64)
    if pod.cpu_milli > 0:
        n = np.minimum(n, np.maximum(cpu_free, 0) // pod.cpu_milli)
    if pod.memory_mib > 0:
        n = np.minimum(n, np.maximum(mem_free, 0) // pod.memory_mib)
    if uses_gpus(pod):
        if pod.gpu_milli > MILLI:
            return np.zeros(len(cpu_free), dtype=np.int64)
        if is_sharing(pod):
            n = np.minimum(n, (np.maximum(gpu_rows, 0) // pod.gpu_milli).sum(axis=1))
        else:
            n = np.minimum(n, (gpu_rows >= MILLI).sum(axis=1) // pod.gpu_count)
    return n


def binpack(state: ClusterState, pod: Pod, ctx: GroupContext, nodes: IntArray) -> FloatArray:
    if uses_gpus(pod):
        cap = state.gpu_count[nodes] * MILLI
        used = cap - state.gpu_free[nodes].sum(axis=1) + pod.gpu_count * pod.gpu_milli
        return np.clip(used / np.maximum(cap, 1), 0.0, 1.0)
    cpu = (state.cpu_cap[nodes] - state.cpu_free[nodes] + pod.cpu_milli) / np.maximum(state.cpu_cap[nodes], 1)
    mem = (state.mem_cap[nodes] - state.mem_free[nodes] + pod.memory_mib) / np.maximum(
        state.mem_cap[nodes], 1
    )
    return np.clip((cpu + mem) / 2.0, 0.0, 1.0)


def fragmentation(state: ClusterState, pod: Pod, ctx: GroupContext, nodes: IntArray) -> FloatArray:
    shapes = state.typical
    if shapes is None or len(nodes) == 0:
        return np.full(len(nodes), 0.5)
    points = score_points(-waste_growth(state, shapes, pod)[nodes], temperature(state, shapes, pod))
    if contested_gpu_pod(state, pod):
        gpu_left = state.gpu_free[nodes].sum(axis=1) - pod.gpu_count * pod.gpu_milli
        points = points + contested_tie_break(state.cpu_free[nodes] - pod.cpu_milli, gpu_left)
    return points / POINTS


def temperature(state: ClusterState, shapes: TypicalShapes, pod: Pod) -> float:
    """The sigmoid's temperature for ``pod``'s fragmentation score, as the trace policy's."""
    if contested_gpu_pod(state, pod):
        return CONTESTED_TEMPERATURE
    return shapes.sharing_temperature if is_sharing(pod) else TEMPERATURE


def contested_gpu_pod(state: ClusterState, pod: Pod) -> bool:
    """``pod`` asks for GPUs where the CPU-only pods ask for much of the CPU (``ClusterState.cpu_contested``):
    scored on FGD's next-pod fragment, as the trace policy's ``ContestedGpuPolicy`` scores it."""
    return state.cpu_contested and uses_gpus(pod)


def waste_growth(state: ClusterState, shapes: TypicalShapes, pod: Pod) -> FloatArray:
    """Per node (all of them): how much placing ``pod`` there grows its waste (``TypicalShapes.waste``, or
    ``next_pod`` for a ``contested_gpu_pod``); a sharing pod's, on the GPU where it grows least
    (``sharing_growth``). Cached per pod shape and recomputed only for the nodes that changed since; values
    of nodes where the pod does not fit are meaningless (only feasible nodes are ever scored, and a node
    becomes feasible only by changing)."""
    measure = _measure(state, shapes, pod)
    key = (measure.__name__, pod.cpu_milli, pod.gpu_count, pod.gpu_milli)
    cached = state.score_cache.get(key)
    if cached is None:
        values, stale = np.zeros(state.n_nodes), np.arange(state.n_nodes)
    else:
        values, seen = cached
        stale = np.flatnonzero(seen != state.version)
    if cached is None or len(stale):
        if is_sharing(pod):
            row, _, growth = sharing_growth(state, shapes, pod, stale)
            least = np.full(len(stale), np.inf)
            np.minimum.at(least, row, growth)
            values[stale] = np.where(np.isfinite(least), least, 0.0)
        else:
            bits = state.model_bits[stale]
            before = measure(state.cpu_free[stale], state.gpu_free[stale], bits)
            after = measure(state.cpu_free[stale] - pod.cpu_milli, gpu_rows_after(state, pod, stale), bits)
            values[stale] = after - before
        state.score_cache[key] = (values, state.version.copy())
    return values


def sharing_growth(
    state: ClusterState, shapes: TypicalShapes, pod: Pod, nodes: IntArray
) -> tuple[IntArray, IntArray, FloatArray]:
    """A sharing pod on each of ``nodes``, on each GPU it fits: (index into ``nodes``, GPU slot, growth of
    the waste), the slots of a node in ascending order, one per distinct free amount. The trace policy
    scores a sharing pod on every fitting GPU and keeps the best (``FgdPolicy``); so does the session
    (``waste_growth``, and ``best_sharing_gpus`` for the GPU it takes)."""
    measure = _measure(state, shapes, pod)
    rows = state.gpu_free[nodes]
    # GPUs of a node with equal free milli leave the node in equal states: only the first of each is
    # measured (an empty node once, not once per GPU); ``best_sharing_gpus`` gives the others its score.
    width = rows.shape[1]
    earlier = np.tril(np.ones((width, width), dtype=bool), k=-1)  # [g, h]: slot h comes before slot g
    repeated = ((rows[:, :, None] == rows[:, None, :]) & earlier[None, :, :]).any(axis=2)
    row, gpu = np.nonzero((rows >= pod.gpu_milli) & ~repeated)
    after = rows[row].copy()
    after[np.arange(len(row)), gpu] -= pod.gpu_milli
    cpu, bits = state.cpu_free[nodes], state.model_bits[nodes]
    measured = measure(
        np.concatenate([cpu, cpu[row] - pod.cpu_milli]),
        np.concatenate([rows, after]),
        bits[np.concatenate([np.arange(len(nodes)), row])],
    )
    return row, gpu, measured[len(nodes) :] - measured[: len(nodes)][row]


def best_sharing_gpus(
    state: ClusterState, shapes: TypicalShapes, pod: Pod, nodes: IntArray, prefer: IntArray | None = None
) -> IntArray:
    """The GPU slot a sharing pod takes on each of ``nodes`` (it must fit): one whose score is the node's,
    as the trace policy's ``FgdPolicy.choose_gpus`` takes one of the best-scoring GPUs; among those the
    least ``prefer`` (per node and slot; the session's: whole GPUs left in the slot's NVLink group), then
    the lowest slot (the trace policy's choice)."""
    row, gpu, growth = sharing_growth(state, shapes, pod, nodes)
    points = score_points(-growth, temperature(state, shapes, pod))
    best = np.full(len(nodes), -np.inf)
    np.maximum.at(best, row, points)
    rows = state.gpu_free[nodes]
    winning = np.full(rows.shape, -1)  # the free milli of each best-scoring measured slot, else -1
    won = points == best[row]
    winning[row[won], gpu[won]] = rows[row[won], gpu[won]]
    # Every slot with as much free as a measured winner scores as it does.
    ties = ((winning[:, :, None] == rows[:, None, :]) & (winning[:, :, None] >= 0)).any(axis=1)
    slots = np.arange(rows.shape[1])
    key = (prefer if prefer is not None else 0) * rows.shape[1] + slots[None, :]
    return np.asarray(np.argmin(np.where(ties, key, BIG), axis=1), dtype=np.int64)


def _measure(state: ClusterState, shapes: TypicalShapes, pod: Pod) -> Callable[..., FloatArray]:
    return shapes.next_pod if contested_gpu_pod(state, pod) else shapes.waste


def whole_gpus_per_link(state: ClusterState, nodes: IntArray) -> IntArray:
    """(nodes, NVLink groups): how many whole free GPUs each group of each node has."""
    full = (state.gpu_free[nodes] >= MILLI).astype(np.int64)
    return np.asarray(np.einsum("mw,mwg->mg", full, state.nvlink_onehot[nodes]), dtype=np.int64)


def topology(state: ClusterState, pod: Pod, ctx: GroupContext, nodes: IntArray) -> FloatArray:
    if not uses_gpus(pod) or pod.gpu_count < 2:
        return np.ones(len(nodes))
    full = state.gpu_free[nodes] >= MILLI  # (M, W)
    per_link = whole_gpus_per_link(state, nodes)
    per_numa = np.einsum("mw,mwg->mg", full.astype(np.int64), state.numa_onehot[nodes])
    one_link = per_link.max(axis=1, initial=0) >= pod.gpu_count
    one_numa = per_numa.max(axis=1, initial=0) >= pod.gpu_count
    return np.where(one_link, 1.0, np.where(one_numa, 0.5, 0.0))


def tor(state: ClusterState, pod: Pod, ctx: GroupContext, nodes: IntArray) -> FloatArray:
    group = ctx.group
    if len(group.pods) <= 1:
        return np.ones(len(nodes))
    used = np.zeros(len(state.tors), dtype=bool)
    for i in state.group_nodes.get(group.name, ()):
        used[state.tor_idx[i]] = True
    cand_tor = state.tor_idx[nodes]
    room = fit_counts(state.cpu_free, state.mem_free, state.gpu_free, pod) * state.static_mask(pod)
    room_per_tor = np.bincount(
        state.tor_idx, weights=np.minimum(room, ctx.remaining), minlength=len(state.tors)
    )
    share = np.minimum(1.0, room_per_tor[cand_tor] / max(ctx.remaining, 1))
    return np.where(used[cand_tor], 1.0, 0.5 * share)


def locality(state: ClusterState, pod: Pod, ctx: GroupContext, nodes: IntArray) -> FloatArray:
    return ctx.locality[nodes]


def group_locality(state: ClusterState, group: PodGroup) -> FloatArray:
    """Per node: the mean fraction of the group's datasets its cache holds (0 for a group without any)."""
    datasets = group.datasets
    if not datasets:
        return np.zeros(len(state.nodes))
    return np.array(
        [
            sum(min(1.0, max(0.0, node.cached.get(d, 0.0))) for d in datasets) / len(datasets)
            for node in state.nodes
        ]
    )


PLUGINS = {
    "binpack": binpack,
    "fragmentation": fragmentation,
    "topology": topology,
    "tor": tor,
    "locality": locality,
}
