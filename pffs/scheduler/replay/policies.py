"""The reference placement policies of the FGD paper, scoring every feasible node at once with NumPy.

Each policy gives scores (higher is better) to the feasible nodes, exactly as the paper's simulator
computes them (its plugins return truncated integers, which is why ties are common), and picks the GPUs on
the chosen node. The simulator breaks score ties by the seed's node order (``traces.replay_order``).

- ``random``: one feasible node drawn uniformly; a sharing pod on a GPU drawn among those that fit.
- ``best-fit``: 100 * (1 - [0.5 * cpu_left_after / 128 cores + 0.5 * gpu_milli_left_after / 8000]).
- ``dot-product``: 100 * (1 - <free, request> / 2), both vectors (cpu, gpu milli) scaled by (128 cores, 8000
  milli): the node whose free resources are least aligned with the request wins (the reference's sign).
- ``gpu-packing``: prefer a partly used GPU (the fuller the better), then free GPUs of a used node, then an
  empty node (smaller first); CPU-only pods score 0 everywhere.
- ``fgd``: sigmoid((F_before - F_after) / 1000), F the node's expected fragmentation over the trace's typical
  pods (``fragmentation``); a sharing pod tries every GPU that fits and keeps the best.

GPUs within the chosen node: a sharing pod goes on the fitting GPU with the least left (``fgd``: the first
best-scoring GPU; ``random``: a random fitting GPU); whole-GPU pods take the lowest-indexed free GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from pffs.scheduler.core.fragmentation import (
    CONTESTED_CPU,
    CONTESTED_TEMPERATURE,
    TEMPERATURE,
    TypicalShapes,
    contested_tie_break,
    score_points,
)
from pffs.scheduler.replay import POLICY_NAMES
from pffs.scheduler.replay.go_rand import GoRand
from pffs.scheduler.replay.model import MILLI, Cluster, IntArray, Pod, PodList

MAX_SCORE = 100
MAX_SPEC_CPU = 128_000  # the scores' normalisation constants (the reference's largest node)
MAX_SPEC_GPU = 8 * MILLI


class Policy(Protocol):
    name: str

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> IntArray:
        """Integer scores of ``nodes`` (all feasible for ``pod``), higher is better."""
        ...

    def choose_gpus(self, cluster: Cluster, pod: Pod, node: int) -> tuple[int, ...]:
        """The GPUs ``pod`` takes on ``node``."""
        ...

    def node_changed(self, cluster: Cluster, node: int) -> None:
        """``node``'s free resources changed (a pod was placed there)."""
        ...


def best_fit_gpu(free: IntArray, pod: Pod) -> tuple[int, ...]:
    """Sharing pod: the fitting GPU with the least left (lowest index on a tie). Whole GPUs: lowest first."""
    if pod.count == 0:
        return ()
    if pod.share < MILLI:
        left = np.where(free >= pod.share, free, MILLI + 1)
        return (int(left.argmin()),)
    return tuple(int(g) for g in np.flatnonzero(free == MILLI)[: pod.count])


class _Stateless:
    """Policies whose scores depend only on the nodes' current free resources."""

    name = ""

    def node_changed(self, cluster: Cluster, node: int) -> None:
        pass

    def choose_gpus(self, cluster: Cluster, pod: Pod, node: int) -> tuple[int, ...]:
        return best_fit_gpu(cluster.gpu_free[node], pod)


class RandomPolicy(_Stateless):
    name = "random"

    def __init__(self, rng: GoRand) -> None:
        self.rng = rng

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> IntArray:
        out = np.zeros(len(nodes), np.int64)
        if len(nodes) > 1:  # the reference draws only when it has to choose
            out[self.rng.intn(len(nodes))] = MAX_SCORE
        return out

    def choose_gpus(self, cluster: Cluster, pod: Pod, node: int) -> tuple[int, ...]:
        if not pod.is_sharing:
            return best_fit_gpu(cluster.gpu_free[node], pod)
        chosen, fitting = -1, 0
        for g, left in enumerate(cluster.gpu_free[node][: cluster.gpu_count[node]].tolist()):
            if left >= pod.share:  # reservoir sampling, one draw per fitting GPU as the reference does
                fitting += 1
                if self.rng.intn(fitting) == 0:
                    chosen = g
        return (chosen,)


class BestFitPolicy(_Stateless):
    name = "best-fit"

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> IntArray:
        cpu_left = (cluster.cpu_free[nodes] - pod.cpu) / MAX_SPEC_CPU * 0.5
        gpu_left = (cluster.gpu_free[nodes].sum(axis=1) - pod.gpu_milli) / MAX_SPEC_GPU * 0.5
        return ((1.0 - (cpu_left + gpu_left)) * MAX_SCORE).astype(np.int64)


class DotProductPolicy(_Stateless):
    name = "dot-product"

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> IntArray:
        cpu = (cluster.cpu_free[nodes] / MAX_SPEC_CPU) * (pod.cpu / MAX_SPEC_CPU)
        gpu = (cluster.gpu_free[nodes].sum(axis=1) / MAX_SPEC_GPU) * (pod.gpu_milli / MAX_SPEC_GPU)
        return (MAX_SCORE * (1 - (cpu + gpu) / 2)).astype(np.int64)


class GpuPackingPolicy(_Stateless):
    name = "gpu-packing"

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> IntArray:
        if pod.count == 0:
            return np.zeros(len(nodes), np.int64)
        free = cluster.gpu_free[nodes]
        fully_free = (free == MILLI).sum(axis=1)
        empty_node = fully_free == cluster.gpu_count[nodes]
        # Empty node: fewer GPUs first; used node, whole GPUs needed: fewer taken first.
        score = np.where(empty_node, np.maximum(MAX_SCORE // 3 - fully_free, fully_free), 0)
        whole = np.maximum(MAX_SCORE // 2 - pod.count, MAX_SCORE // 3)
        if pod.share < MILLI:
            tightest = np.where(free >= pod.share, free, MILLI + 1).min(axis=1)
            shared = np.maximum(MAX_SCORE - (tightest * 100 // MILLI) // 10, MAX_SCORE // 2)
            used = np.where(tightest == MILLI, MAX_SCORE // 2 - 1, shared)
        else:
            used = np.full(len(nodes), whole)
        return np.where(empty_node, score, used).astype(np.int64)


class FgdPolicy:
    """FGD, with scores cached per (pod shape, node state): nodes in the same state score the same, and a
    placement changes one node's state, so most of a pod's scores were computed for an earlier pod.

    Subclasses change what is measured (``_measure``) and how its drop becomes a score (``_score``)."""

    name = "fgd"

    def __init__(self, cluster: Cluster, typical: TypicalShapes) -> None:
        self.typical = typical
        self._state_ids: dict[tuple[int, int, tuple[int, ...]], int] = {}
        self._cpu: list[int] = []
        self._bits: list[int] = []
        self._gpus: list[tuple[int, ...]] = []
        self._frag: list[float] = []
        self._shape_ids: dict[tuple[int, int, int, int], int] = {}
        self._cache = np.full((8, 64), np.nan)  # (shape, state) -> score, NaN: not computed
        self._best: dict[tuple[int, int], frozenset[int]] = {}  # sharing pods: the best GPUs' free milli
        self._bits_of_node = cluster.model_bits()
        self.node_state = np.array([self._state_of(cluster, n) for n in range(cluster.size)], np.int64)

    def _state_of(self, cluster: Cluster, node: int) -> int:
        gpus = tuple(sorted(cluster.gpu_free[node].tolist(), reverse=True))
        key = (int(self._bits_of_node[node]), int(cluster.cpu_free[node]), gpus)
        sid = self._state_ids.get(key)
        if sid is None:
            sid = self._state_ids[key] = len(self._cpu)
            self._cpu.append(key[1])
            self._bits.append(key[0])
            self._gpus.append(gpus)
            self._frag.append(float("nan"))
        return sid

    def node_changed(self, cluster: Cluster, node: int) -> None:
        self.node_state[node] = self._state_of(cluster, node)

    def _shape_of(self, pod: Pod) -> int:
        key = (pod.cpu, pod.share, pod.count, pod.model_mask)
        sid = self._shape_ids.get(key)
        if sid is None:
            sid = self._shape_ids[key] = len(self._shape_ids)
        return sid

    def _grow(self, shapes: int, states: int) -> None:
        rows, cols = self._cache.shape
        if shapes > rows or states > cols:
            grown = np.full((max(rows, 2 * shapes), max(cols, 2 * states)), np.nan)
            grown[:rows, :cols] = self._cache
            self._cache = grown

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> np.ndarray:
        shape = self._shape_of(pod)
        self._grow(shape + 1, len(self._cpu))
        states = self.node_state[nodes]
        cached = self._cache[shape, states]
        missing = np.isnan(cached)
        if missing.any():
            self._score_states(shape, pod, np.unique(states[missing]))
            cached = self._cache[shape, states]
        return cached

    def _measured(
        self, states: IntArray, after: tuple[IntArray, IntArray, IntArray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The measure of ``states`` (cached per state) and of the hypothetical nodes ``after`` (CPU free,
        GPUs free, model bits), in one ``_measure`` call: on a few nodes its cost is per call, not per
        node (one call instead of two made the replay 20% faster, results bit-identical)."""
        before = np.array([self._frag[s] for s in states.tolist()])
        unmeasured = np.isnan(before)
        todo = states[unmeasured].tolist()
        cpu = np.concatenate([np.array([self._cpu[s] for s in todo], np.int64), after[0]])
        gpus = np.concatenate(
            [np.array([self._gpus[s] for s in todo], np.int64).reshape(-1, after[1].shape[1]), after[1]]
        )
        bits = np.concatenate([np.array([self._bits[s] for s in todo], np.int64), after[2]])
        measured = self._measure(cpu, gpus, bits)
        for s, f in zip(todo, measured[: len(todo)].tolist(), strict=True):
            self._frag[s] = f
        before[unmeasured] = measured[: len(todo)]
        return before, measured[len(todo) :]

    def _score_states(self, shape: int, pod: Pod, states: IntArray) -> None:
        cpu = np.array([self._cpu[s] for s in states.tolist()], np.int64) - pod.cpu
        gpus = np.array([self._gpus[s] for s in states.tolist()], np.int64)  # each row sorted descending
        bits = np.array([self._bits[s] for s in states.tolist()], np.int64)
        if pod.is_sharing:
            # One hypothetical placement per (state, GPU that fits); a state's score is its best GPU's.
            row_state, gpu = np.nonzero(gpus >= pod.share)
            after_gpus = gpus[row_state].copy()
            after_gpus[np.arange(len(row_state)), gpu] -= pod.share
            before, after = self._measured(states, (cpu[row_state], after_gpus, bits[row_state]))
            row_score = self._score(pod, before[row_state], after)
            best = np.full(len(states), -np.inf)
            np.maximum.at(best, row_state, row_score)
            values = gpus[row_state, gpu]
            winners: dict[int, set[int]] = {}
            for r, v in zip(
                row_state[row_score == best[row_state]].tolist(),
                values[row_score == best[row_state]],
                strict=True,
            ):
                winners.setdefault(r, set()).add(int(v))
            for r, s in enumerate(states.tolist()):
                self._best[(shape, s)] = frozenset(winners.get(r, ()))
            self._cache[shape, states] = best
            return
        after_gpus = gpus.copy()
        if pod.count:  # whole GPUs: rows are sorted descending, so the free ones come first
            after_gpus[:, : pod.count] = 0
        before, after = self._measured(states, (cpu, after_gpus, bits))
        self._cache[shape, states] = self._score(pod, before, after)

    def _measure(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> np.ndarray:
        return self.typical.fragmentation(cpu_free, gpu_free, model_bits)

    def _score(self, pod: Pod, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        return _fgd_score(before, after).astype(np.float64)

    def choose_gpus(self, cluster: Cluster, pod: Pod, node: int) -> tuple[int, ...]:
        if not pod.is_sharing:
            return best_fit_gpu(cluster.gpu_free[node], pod)
        best = self._best[(self._shape_of(pod), int(self.node_state[node]))]
        free = cluster.gpu_free[node].tolist()
        return (next(g for g, left in enumerate(free) if left >= pod.share and left in best),)


class PffsPolicy(FgdPolicy):
    """pffs's default: FGD's idea with a measure that looks past the next pod.

    FGD asks, per typical shape, whether ONE more such pod fits; a node with 16 cores and 4 free GPUs passes
    for an 11-core one-GPU shape, yet the pod strands the other 3 GPUs. Here the measure is the GPU milli a
    node would strand if it were filled with pods of each typical shape (CPU and GPU slots both counted),
    plus ``NEXT_POD_WEIGHT`` times FGD's next-pod fragment for the same shapes (``TypicalShapes.waste``):
    the filling sees the long run, the next pod what is left when the cluster is nearly full. The shapes
    are FGD's and the rare ones few nodes can run, weighted up where their pods would fill those nodes,
    and those bound to GPU models weighed against those models' GPUs within the weight their frequency
    gives them together, all scaled so that the shapes a node's GPU model accepts weigh 1 on average
    (``TypicalShapes.from_counts``, ``scarcity``, ``for_stranding`` and ``accessible_weight`` with the
    cluster's ``capacities``). Its drop is
    scored on a coarser sigmoid than FGD's (``TEMPERATURE`` milli instead of 1000, ``score_points``), so
    near-equal moves tie and the seed's node order packs them onto the same nodes; a sharing pod's, coarser
    still where whole-GPU pods carry much of the measure, and finer where pods are bound to GPU models
    (``TypicalShapes.sharing_temperature``). The gang
    session scores with the same measure and points (``scoring.fragmentation``). The README's ablation
    gives each part's contribution.

    Where the CPU-only pods ask for half the cluster's CPU or more, the ``pffs`` policy is
    ``CpuContestedPolicy``: this class still places the CPU-only pods, ``ContestedGpuPolicy`` the GPU pods.
    """

    name = "pffs"
    TEMPERATURE = TEMPERATURE

    def __init__(self, cluster: Cluster, typical: TypicalShapes) -> None:
        super().__init__(cluster, typical)
        self.sharing_temperature = typical.sharing_temperature

    def _measure(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> np.ndarray:
        return self.typical.waste(cpu_free, gpu_free, model_bits)

    def _score(self, pod: Pod, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        return score_points(before - after, self.sharing_temperature if pod.is_sharing else self.TEMPERATURE)


class ContestedGpuPolicy(PffsPolicy):
    """GPU pods where the CPU is contested (``CpuContestedPolicy``): the drop of FGD's next-pod fragment of
    pffs's shapes (``TypicalShapes.next_pod``) on FGD's temperature, sharing pods too, and score ties to the
    node left with the least free CPU per free GPU.

    Where CPU-only pods will take most of the CPU, filling a node with GPU pods (``stranded``) is not
    what happens to it: its CPU goes to whichever pod comes next. On mix nongpu40 (seeds 42-51, pffs -
    FGD at 100% arrived) GPU pods placed on ``waste`` left pffs 0.27 points behind FGD; on the next-pod
    fragment at FGD's temperature, +0.30; with the tie-break, +1.94. The tie-break spends on GPU pods first
    the CPU of nodes with little CPU per GPU, and leaves to the CPU-only pods the CPU of nodes with much
    (openb's 104-core nodes have 2 GPUs): at nongpu40's 100% point those pods took as much CPU as before,
    but stranded 2 GPUs a node there rather than 8 on the 96-core nodes. It orders ties only (under half a
    point). As a tie-break of ``PffsPolicy`` it put pffs 0.7-6.9 points behind FGD on the four published
    traces screened (default, gpushare40, gpushare80, multigpu30), whose packing rests on the seed's ties."""

    TEMPERATURE = CONTESTED_TEMPERATURE

    def __init__(self, cluster: Cluster, typical: TypicalShapes) -> None:
        super().__init__(cluster, typical)
        self.sharing_temperature = self.TEMPERATURE

    def _measure(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> np.ndarray:
        return self.typical.next_pod(cpu_free, gpu_free, model_bits)

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> np.ndarray:
        scores = super().scores(cluster, pod, nodes)
        gpu_left = cluster.gpu_free[nodes].sum(axis=1) - pod.gpu_milli
        return scores + contested_tie_break(cluster.cpu_free[nodes] - pod.cpu, gpu_left)


class CpuContestedPolicy:
    """pffs where the CPU-only pods ask for ``CONTESTED_CPU`` of the cluster's CPU or more by 100% arrived
    (``TypicalShapes.cpu_only_demand``): CPU-only pods are placed as ``PffsPolicy`` places them, GPU pods
    as ``ContestedGpuPolicy`` does. Each keeps its own scores; both hear of every placement."""

    name = "pffs"

    def __init__(self, cluster: Cluster, typical: TypicalShapes) -> None:
        self.cpu_pods = PffsPolicy(cluster, typical)
        self.gpu_pods = ContestedGpuPolicy(cluster, typical)

    def _placing(self, pod: Pod) -> PffsPolicy:
        return self.gpu_pods if pod.count else self.cpu_pods

    def scores(self, cluster: Cluster, pod: Pod, nodes: IntArray) -> np.ndarray:
        return self._placing(pod).scores(cluster, pod, nodes)

    def choose_gpus(self, cluster: Cluster, pod: Pod, node: int) -> tuple[int, ...]:
        return self._placing(pod).choose_gpus(cluster, pod, node)

    def node_changed(self, cluster: Cluster, node: int) -> None:
        self.cpu_pods.node_changed(cluster, node)
        self.gpu_pods.node_changed(cluster, node)


def _fgd_score(before: np.ndarray, after: np.ndarray) -> IntArray:
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-((before - after) / 1000))) * float(MAX_SCORE)).astype(np.int64)


def _pffs(cluster: Cluster, trace: PodList) -> PffsPolicy | CpuContestedPolicy:
    """pffs's policy for ``trace``: FGD's typical shapes and the rare ones few nodes can run, weighted for
    pffs's measure; ``CpuContestedPolicy`` where the CPU-only pods ask for much of the CPU."""
    nodes = cluster.capacities()
    counted = TypicalShapes.from_pods(trace, cluster, nodes=nodes)
    shapes = counted.for_stranding(nodes)
    if counted.cpu_only_demand(nodes) >= CONTESTED_CPU:
        return CpuContestedPolicy(cluster, shapes)
    return PffsPolicy(cluster, shapes)


PolicyFactory = Callable[[Cluster, PodList, GoRand], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "random": lambda cluster, trace, rng: RandomPolicy(rng),
    "dot-product": lambda cluster, trace, rng: DotProductPolicy(),
    "gpu-packing": lambda cluster, trace, rng: GpuPackingPolicy(),
    "best-fit": lambda cluster, trace, rng: BestFitPolicy(),
    "fgd": lambda cluster, trace, rng: FgdPolicy(cluster, TypicalShapes.from_pods(trace, cluster)),
    "pffs": lambda cluster, trace, rng: _pffs(cluster, trace),
}
assert tuple(POLICIES) == POLICY_NAMES, "pffs/scheduler/replay/__init__.py names other policies"


def make_policy(name: str, cluster: Cluster, trace: PodList, rng: GoRand) -> Policy:
    """The policy called ``name``; ``trace`` is the original pod list (FGD's typical pods come from it)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from: {', '.join(POLICIES)})") from None
    return factory(cluster, trace, rng)
