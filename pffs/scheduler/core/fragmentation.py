"""GPU fragmentation as FGD measures it: the typical pods of a trace, and a node's expected fragment.

A node's fragment for a pod shape t is the GPU milli that t could not use there: all the node's free GPU milli
if t cannot run on it (a CPU-only shape, a GPU model t does not accept, too little CPU, too few GPUs with
t's share free), else the free milli on GPUs that have less than t's share left. The node's fragmentation is
the expectation over the typical shapes, F = sum_t p_t * f_t.

The arithmetic follows the reference simulator operation for operation (per-category sums in shape order,
then the categories added in a fixed order) so that F is the same float64 there and here: FGD's score is an
integer cut of sigmoid(dF / 1000), and a dF of exactly 0 (score 50) against a dF of 1e-13 (score 49) decides
ties.

pffs's own measure, ``waste``, adds to it what filling a node with each shape would strand (``stranded``),
over FGD's shapes and the rare ones that few nodes can run (``from_counts`` and ``scarcity`` with ``nodes``),
with shapes bound to GPU models weighed against those models' GPUs (``scarcity``) and the weights scaled so
that what a node's model accepts weighs 1 on average (``accessible_weight``).
Both floors above use them: the session's fragmentation score (``waste``, through ``scoring.py``) and the
trace replay's policies (FGD's ``fragmentation``, pffs's ``waste``). It reads plain arrays, so the replay's
``PodList`` and ``Cluster`` come in by shape (``PodColumns``, ``ModelMasks``) and nothing here imports them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

import numpy as np

from pffs.scheduler.core.arrays import FloatArray, IntArray
from pffs.scheduler.core.objects import MILLI

ANY_MODEL = -1  # a model mask with every bit set: the pod (or shape) accepts any GPU model

# The reference's fragment categories, in the order their sums are added (Q3, "satisfied", is not a fragment).
LACK_BOTH, LACK_GPU, LACK_CPU, CPU_SHAPE_FITS, CPU_SHAPE_LACKS_CPU, NO_ACCESS = range(6)
DEFAULT_POPULARITY = 95  # percent of the trace's pods the typical shapes must cover
# ``for_stranding``: a sharing shape's weight against a whole-GPU one's (1, 3 and 2 were measured; see README)
SHARING_WEIGHT = 2.0
# ``waste``: the weight of FGD's next-pod fragment beside the stranded milli. 0.25-1.0 were measured on the
# published traces (seeds 42-51, see README): every one beat FGD by 0.2 points or more from 0.5 to 0.7,
# with steep drops outside (0.35: +0.06 on gpushare100; 0.75: +0.09 on gpushare40).
NEXT_POD_WEIGHT = 0.55
# pffs's shapes: FGD's, and every rarer GPU shape (any model) that at most this part of the nodes can run
RARE_SHAPE_HOSTS = 0.1

# pffs's placement score, in the trace policy (``PffsPolicy``) and the gang session alike: the drop of the
# measure on a sigmoid of this many milli, cut to whole points (``score_points``), so that near-equal moves
# tie and the fixed node order packs them. 2000-8000 all beat FGD on default and gpushare100; 4000 was best.
TEMPERATURE = 4000.0
# A sharing pod's temperature is up to 1 + SHARING_COARSEST times that, in step with the whole-GPU shapes'
# part of the weight times SHARING_COARSENING and with the part that accepts any GPU model
# (``TypicalShapes.sharing_temperature``): coarsening 2.5, 3.5 and 4 were measured, 3.5 lost on no trace;
# at most 2 and 3 times, 3 (stop 27) lifted the multi-GPU mixes (seeds 42-51, see README).
SHARING_COARSENING = 3.5
SHARING_COARSEST = 2.0
# ... and times 1 - SHARING_BOUND_FINER x the part of the GPU shapes' weight bound to GPU models: finer where
# the sharing terms tell which model's GPUs a pod breaks. 0.2, 0.3 and 0.45 were measured on the gpuspec mixes
# (seeds 42-51, see README): 0.3 lifted gpuspec85 from +0.13 to +0.27 against FGD at 130% arrived (stop 28).
SHARING_BOUND_FINER = 0.3
# From this part of the cluster's CPU asked for by CPU-only pods (``TypicalShapes.cpu_only_demand``), the
# CPU is contested and GPU pods are placed on ``next_pod`` at FGD's temperature, ties to the node left with
# the least CPU per free GPU (``contested_tie_break``). Every published trace is at 0.28 or less; on the
# held-out mixes the switch helped from 0.43 (nongpu25: +0.75 -> +0.87 against FGD) and hurt at 0.33
# (nongpu20: +0.98 -> -0.33).
CONTESTED_CPU = 0.5
CONTESTED_TEMPERATURE = 1000.0
POINTS = 100  # a score's whole points (the reference simulator's plugins score 0-100)


def score_points(drop: FloatArray, temperature: float) -> FloatArray:
    """The drop of the measure (before - after, milli) as whole points of a sigmoid: 50 for no change."""
    with np.errstate(over="ignore"):
        return np.asarray(np.floor(float(POINTS) / (1.0 + np.exp(-drop / temperature))), dtype=np.float64)


def contested_tie_break(cpu_left: IntArray, gpu_milli_left: IntArray) -> FloatArray:
    """Where the CPU is contested, the points (under one half, so it orders ties only) a GPU pod's score
    gains on each node: the most where it leaves the least free CPU per free GPU. A node left without a
    free GPU counts half a GPU, so its CPU left still sorts it; any falling function orders the ties alike,
    this one reads 0.125 at 12 cores a GPU."""
    cpu_per_gpu = cpu_left / np.maximum(gpu_milli_left / float(MILLI), 0.5)
    return np.asarray(0.5 / (1.0 + cpu_per_gpu / 12000.0), dtype=np.float64)


class PodColumns(Protocol):
    """A trace's pods as columns (the replay's ``PodList``): what ``TypicalShapes.from_pods`` reads."""

    @property
    def cpu(self) -> IntArray: ...
    @property
    def share(self) -> IntArray: ...
    @property
    def count(self) -> IntArray: ...
    @property
    def specs(self) -> list[str]: ...


class ModelMasks(Protocol):
    """Turns a pod's GPU spec into model bits (the replay's ``Cluster``)."""

    def model_mask(self, spec: str) -> int: ...


@dataclass(frozen=True)
class NodeCapacities:
    """What each node of the cluster offers when empty: CPU milli, GPUs, its GPU model's bit (0: none)."""

    cpu: IntArray
    gpus: IntArray
    model_bits: IntArray


@dataclass(frozen=True)
class _Filling:
    """Per typical shape, what ``TypicalShapes._per_shape`` divides by and compares with."""

    shares: IntArray  # the distinct GPU shares (CPU-only shapes counted as share 1)
    share_of_shape: IntArray  # each shape's index in ``shares``
    count: IntArray  # GPUs per pod, at least 1
    cpu: IntArray  # CPU milli per pod, at least 1
    needs_cpu: np.ndarray  # the shape asks for CPU (else its CPU never limits it)
    gpu_shape: np.ndarray  # the shape asks for a GPU
    milli: IntArray  # GPU milli per pod (share x count)


@dataclass(frozen=True)
class TypicalShapes:
    """The most frequent pod shapes of a trace and their renormalised probabilities."""

    cpu: IntArray
    share: IntArray
    count: IntArray
    model_mask: IntArray
    prob: FloatArray
    pods: int = 0  # the pods the shapes were counted from (``prob * pods``: how many of each to expect)

    @classmethod
    def from_pods(
        cls,
        pods: PodColumns,
        cluster: ModelMasks,
        popularity: int = DEFAULT_POPULARITY,
        nodes: NodeCapacities | None = None,
    ) -> TypicalShapes:
        """Shapes (cpu, share, count, gpu_spec) by descending frequency, CPU-only ones included, until they
        cover ``popularity`` percent of the pods; probabilities renormalised over the shapes kept. With
        ``nodes``, the rare shapes that few of them can run too (``from_counts``)."""
        counts = Counter(
            zip(pods.cpu.tolist(), pods.share.tolist(), pods.count.tolist(), pods.specs, strict=True)
        )
        return cls.from_counts(
            counts, lambda spec: cluster.model_mask(spec) if spec else ANY_MODEL, popularity, nodes
        )

    @classmethod
    def from_counts(
        cls,
        counts: Mapping[tuple[int, int, int, str], int],
        model_mask: Callable[[str], int],
        popularity: int = DEFAULT_POPULARITY,
        nodes: NodeCapacities | None = None,
    ) -> TypicalShapes:
        """The typical shapes of pods counted by (cpu, share, count, gpu_spec); ``model_mask`` turns a spec
        into model bits. Equal counts rank in descending shape order, as the reference simulator sorts.

        With ``nodes`` (pffs), every rarer GPU shape that accepts any model and that at most
        ``RARE_SHAPE_HOSTS`` of the nodes can run joins FGD's, and each kept shape's probability is its
        share of the kept pods. On openb that is the 8-GPU pod with 120 cores: under 1% of the pods, it
        fits only the 39 nodes of 128 cores, and left out, nothing in the measure keeps those free for it."""
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        total = float(sum(counts.values()))
        expected = float(popularity) * total / 100.0
        kept = 0
        covered = 0.0
        while covered < expected and kept < len(ranked):
            covered += ranked[kept][1]
            kept += 1
        if nodes is not None:
            rare = cls._of([shape for shape, _ in ranked[kept:]], model_mask)
            scarce = (rare.share > 0) & (rare.model_mask == ANY_MODEL)
            scarce &= rare.hosts(nodes) <= RARE_SHAPE_HOSTS * len(nodes.cpu)
            shapes = [shape for shape, _ in ranked[:kept]]
            shapes += [shape for (shape, _), add in zip(ranked[kept:], scarce, strict=True) if add]
            share = float(sum(counts[s] for s in shapes))
            return replace(cls._of(shapes, model_mask, [counts[s] / share for s in shapes]), pods=int(total))
        if kept < len(ranked):
            prob = [(c / total) / (covered / total) for _, c in ranked[:kept]]
        else:
            prob = [c / total for _, c in ranked]
        return replace(cls._of([shape for shape, _ in ranked[:kept]], model_mask, prob), pods=int(total))

    @classmethod
    def _of(
        cls,
        shapes: list[tuple[int, int, int, str]],
        model_mask: Callable[[str], int],
        prob: list[float] | None = None,
    ) -> TypicalShapes:
        return cls(
            np.array([s[0] for s in shapes], np.int64),
            np.array([s[1] for s in shapes], np.int64),
            np.array([s[2] for s in shapes], np.int64),
            np.array([model_mask(s[3]) for s in shapes], np.int64),
            np.array(prob if prob is not None else [0.0] * len(shapes), np.float64),
        )

    def __len__(self) -> int:
        return len(self.prob)

    def for_stranding(self, nodes: NodeCapacities | None = None) -> TypicalShapes:
        """The same shapes weighted for ``stranded``: a shape's frequency divided by its GPU count, a sharing
        shape's doubled, and with ``nodes`` a GPU shape's raised where its hosts or its models' GPUs are
        scarce (``scarcity``), renormalised. The shapes bound to GPU models share among themselves, by
        their models' scarcity, the weight their frequency gives them together: multiplied through, the
        scarcity of small models left the shapes that accept any model 26% of the GPU shapes' weight on mix
        gpuspec45 (59% with this) and 5% on gpuspec80 (20%), and with them most of what tells two nodes of
        one model apart (gpuspec80, seeds 42-51: 0.26 points behind FGD at 130% arrived, 0.16 with this).
        With ``nodes``, the weights are then divided by the part the nodes' models accept
        (``accessible_weight``), so that part weighs 1 on average whether or not shapes are bound.

        ``stranded`` asks how much of a node each shape, filling it alone, would leave unused. A k-GPU shape
        leaves ALL the free GPUs of a node with fewer than k free, so at its pod frequency its term swamps
        the others and small pods run from every node an 8-GPU pod could still take (openb multigpu30,
        seeds 42-43, pffs - FGD: -0.30 points at pod frequency, -0.51 weighted up by k, +0.16 divided by
        k). A sharing shape's term is the one that tells a partly used GPU from a whole one (a whole-GPU
        shape sees either as one slot or none): doubling it packs sharing pods onto GPUs already broken.
        """
        sharing = (self.share > 0) & (self.share < MILLI)
        weight = self.prob / np.maximum(self.count, 1) * np.where(sharing, SHARING_WEIGHT, 1.0)
        if nodes is not None:
            scaled = weight * np.where(self.share > 0, self.scarcity(nodes), 1.0)
            # The bound shapes' scarcity moves weight between GPU models, not away from the shapes that
            # accept any model: together the bound shapes keep the weight their pods' frequency gives them.
            bound = (self.model_mask != ANY_MODEL) & (self.share > 0)
            if scaled[bound].sum() > 0:
                scaled[bound] *= weight[bound].sum() / scaled[bound].sum()
            weight = scaled
        total = weight.sum()
        weighted = replace(self, prob=weight / total if total > 0 else weight)
        if nodes is None:
            return weighted
        return replace(weighted, prob=weighted.prob / max(weighted.accessible_weight(nodes), 1e-9))

    def accessible_weight(self, nodes: NodeCapacities) -> float:
        """The part of the weight on the shapes that accept a node's GPU model, averaged over the cluster's
        GPUs: 1 where no shape is bound to a model.

        On a node of model X, a shape bound to other models counts all the node's free milli, so every pod
        placed there lowers its term by the pod's milli times its weight, whichever node of X it takes: the
        differences between the nodes of X come from the shapes that accept X alone. ``for_stranding``
        divides the weights by this, so those shapes weigh 1 on an average node, as all shapes do on a
        trace with no bound pods, where the scores' temperature (``TEMPERATURE``) was set. Left
        at 0.42 (mix gpuspec80), the same differences scored as if the temperature were 2.4 times higher:
        near-equal placements tied and went to the seed's first node, and sharing pods broke GPUs on nodes
        whose CPU then ran out (seeds 42-51: 0.16 points behind FGD at 130% arrived; 0.26 ahead with this)."""
        total = float(self.prob.sum())
        if total <= 0:
            return 1.0
        refused = (~self._accepts(nodes.model_bits)) @ self.prob  # per node: the weight that cannot use it
        return 1.0 - float(refused @ nodes.gpus) / max(float(nodes.gpus.sum()), 1.0) / total

    def cpu_only_demand(self, nodes: NodeCapacities) -> float:
        """The part of the cluster's CPU that the CPU-only pods ask for by the time the GPU pods have asked
        for all its GPUs (100% arrived), from the shapes' pod frequencies (so before ``for_stranding``):
        0.20 on openb's default, 0.28 on gpushare100 (the most of any published trace), 0.56 on mix
        nongpu30, 1.09 on nongpu45. 0 where no shape asks for a GPU."""
        gpu_shape = self.share > 0
        gpus = float((self.prob * self.share * np.maximum(self.count, 1))[gpu_shape].sum()) / MILLI
        cores = float((self.prob * self.cpu)[~gpu_shape].sum())
        if gpus <= 0:
            return 0.0
        return cores / gpus * float(nodes.gpus.sum()) / max(float(nodes.cpu.sum()), 1.0)

    def hosts(self, nodes: NodeCapacities) -> IntArray:
        """Per shape: the nodes that could run one of its pods when empty (CPU, GPUs, an accepted model)."""
        return np.asarray(self._host_mask(nodes).sum(axis=1), dtype=np.int64)

    def _host_mask(self, nodes: NodeCapacities) -> np.ndarray:
        """(shapes, nodes): the node, empty, could run one pod of the shape."""
        return (
            (nodes.cpu[None, :] >= self.cpu[:, None])
            & (nodes.gpus[None, :] >= self.count[:, None])
            & self._accepts(nodes.model_bits).T
        )

    def _accepts(self, model_bits: IntArray) -> np.ndarray:
        """(nodes, shapes): the shape accepts the node's GPU model (or any model)."""
        return ((model_bits[:, None] & self.model_mask[None, :]) != 0) | (
            self.model_mask[None, :] == ANY_MODEL
        )

    def scarcity(self, nodes: NodeCapacities) -> FloatArray:
        """Per shape, how much more its stranding counts because few nodes or GPUs can run it.

        A shape that accepts any model: 1 + (the nodes over its hosts - 1) x its pressure, the GPUs its
        expected pods (``prob * pods``) ask for over the GPUs of its hosts, capped at 1. On openb an 8-GPU
        pod with 120 cores fits 39 of the 1213 nodes (31 times fewer), one with 64-88 cores about 610 (2),
        a one-GPU pod nearly any (1). Where such pods would fill their hosts the measure must keep those
        hosts for them, or small pods take the nodes and the big pods fail before the cluster is full
        (openb multigpu30, seeds 42-51: 0.95 points of the GPU demand lost before 90% had arrived without
        this, 0.03 with it, FGD 0.00). Where they are few (gpushare80: one such pod, 3% of those nodes'
        GPUs), keeping their hosts apart costs more than it saves (0.16 points against FGD in a screen of
        seeds 42-51 with the scarcity in full).

        A shape bound to GPU models: the cluster's GPUs over the GPUs of its models. Its terms count all
        the free milli of every node of another model, so a pod placed on a node of model Y lowers the
        measure by the weight of the shapes not bound to Y: counted by frequency alone, the models with
        the most GPUs (and so the most bound pods) were the ones kept free, and pods that accept any model
        filled the small models their own pods needed (mix gpuspec45, seeds 42-51: 0.45 points behind FGD
        at 100% arrived; +2.8 with this). Over its models' GPUs, each model's bound pods count for what
        they ask of that model; a shape bound to models no node has weighs nothing."""
        hosting = self._host_mask(nodes)
        hosts = np.maximum(hosting.sum(axis=1), 1)
        host_gpus = np.maximum((hosting * nodes.gpus[None, :]).sum(axis=1), 1)
        demand = self.prob * self.pods * np.maximum(self.count, 1) * self.share / MILLI
        pressure = np.minimum(1.0, demand / host_gpus)
        scarce = 1.0 + (len(nodes.cpu) / hosts - 1.0) * pressure
        model_gpus = (self._accepts(nodes.model_bits) * nodes.gpus[:, None]).sum(axis=0)
        # A shape no GPU of the cluster accepts weighs nothing: it says nothing of where others should go.
        bound = np.where(model_gpus > 0, nodes.gpus.sum() / np.maximum(model_gpus, 1), 0.0)
        return np.asarray(np.where(self.model_mask == ANY_MODEL, scarce, bound), dtype=np.float64)

    @cached_property
    def _shares(self) -> tuple[IntArray, IntArray]:
        """The distinct shares (few) and each shape's index among them: ``fragmentation`` compares the
        GPUs with each share once, not once per shape."""
        shares, share_of_shape = np.unique(self.share, return_inverse=True)
        return shares, share_of_shape

    @cached_property
    def _filling(self) -> _Filling:
        """The shapes' constants that ``_per_shape`` divides by, computed once (it runs per scored node)."""
        gpu_shape = self.share > 0
        share = np.where(gpu_shape, self.share, 1)
        count = np.maximum(self.count, 1)
        shares, share_of_shape = np.unique(share, return_inverse=True)
        return _Filling(
            shares, share_of_shape, count, np.maximum(self.cpu, 1), self.cpu > 0, gpu_shape, share * count
        )

    def whole_gpu_fraction(self) -> float:
        """The whole-GPU shapes' part of the weight on GPU shapes (sharing shapes the rest): 0 on a trace
        of sharing pods only, about 0.4 on openb's default, 0.5 on gpushare20."""
        sharing = (self.share > 0) & (self.share < MILLI)
        whole = float(self.prob[self.share >= MILLI].sum())
        gpu = whole + float(self.prob[sharing].sum())
        return whole / gpu if gpu > 0 else 0.0

    @cached_property
    def sharing_temperature(self) -> float:
        """A sharing pod's temperature (computed once: the session reads it for every sharing pod it
        scores): coarser where whole-GPU shapes carry much of the weight, up to 1 + ``SHARING_COARSEST``
        times ``TEMPERATURE``. There the whole-GPU term already tells a broken GPU
        from a whole one, and letting the finer differences of the sharing terms tie packs sharing pods onto
        the nodes ranked first; on a trace of sharing pods only it is ``TEMPERATURE`` (those terms are all
        the measure has). The coarsening shrinks with the part of the weight on shapes bound to GPU models
        (``unbound_fraction``): there the sharing terms tell which model's GPUs a pod breaks. Measured (seeds
        42-51): at most three times instead of twice, every multi-GPU mix gained (multigpu60 +0.15 -> +0.25
        against FGD) and gpuspec75 lost at 130% arrived (+0.26 -> +0.19); scaled by the unbound part,
        gpuspec75 +0.35, gpuspec60 +0.09 -> +0.23. Where most pods are bound it goes below ``TEMPERATURE``,
        by ``SHARING_BOUND_FINER`` times the bound part (0.7 times where every GPU pod is bound): on
        gpuspec85 (0.15 unbound) 5,200 milli scored sharing pods 0.13 points ahead of FGD at 130% arrived,
        3,900 0.27 ahead (seeds 42-51; 1.0 where no pod is bound, so those traces are unchanged)."""
        coarser = min(SHARING_COARSENING * self.whole_gpu_fraction(), 1.0)
        unbound = self.unbound_fraction()
        coarsened = 1.0 + SHARING_COARSEST * coarser * unbound
        return TEMPERATURE * coarsened * (1.0 - SHARING_BOUND_FINER * (1.0 - unbound))

    def unbound_fraction(self) -> float:
        """The part of the GPU shapes' weight on shapes that accept any GPU model: 1 where no pod names a
        model (every published openb trace), 0.40 on mix gpuspec60, 0.10 on gpuspec90."""
        gpu = self.share > 0
        total = float(self.prob[gpu].sum())
        return float(self.prob[gpu & (self.model_mask == ANY_MODEL)].sum()) / total if total > 0 else 1.0

    def fragmentation(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> FloatArray:
        """F for each of M node states: ``cpu_free`` (M,), ``gpu_free`` (M, GPUs), ``model_bits`` (M,)."""
        m = len(cpu_free)
        gpu_total = gpu_free.sum(axis=1)
        shares, share_of_shape = self._shares
        fits = gpu_free[:, None, :] >= shares[None, :, None]  # (M, shares, GPUs)
        fit_count = fits.sum(axis=2)[:, share_of_shape]  # (M, shapes)
        small = np.where(fits, 0, gpu_free[:, None, :]).sum(axis=2)[:, share_of_shape]
        cpu_ok = cpu_free[:, None] >= self.cpu[None, :]
        gpu_shape = self.share[None, :] > 0
        access = self._accepts(model_bits)
        hosts = fit_count >= self.count[None, :]
        category = np.select(
            [~gpu_shape & cpu_ok, ~gpu_shape, ~access, hosts & cpu_ok, hosts, cpu_ok],
            [CPU_SHAPE_FITS, CPU_SHAPE_LACKS_CPU, NO_ACCESS, LACK_GPU, LACK_CPU, LACK_GPU],
            LACK_BOTH,
        )
        # Where the shape runs, only its too-small GPUs are fragment; elsewhere every free GPU milli is.
        milli = np.where(gpu_shape & access & hosts & cpu_ok, small, gpu_total[:, None])
        amount = self.prob[None, :] * milli
        frag = np.zeros(m)
        for c in range(6):
            # cumsum adds left to right, as the reference's running sums do (a plain sum would pair up terms)
            part = (
                np.cumsum(np.where(category == c, amount, 0.0), axis=1)[:, -1] if len(self) else np.zeros(m)
            )
            frag = frag + part
        return frag

    def stranded(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> FloatArray:
        """Expected GPU milli left unusable if each of M nodes were filled with pods of one typical shape.

        For shape t: its pods that fit = min(GPU slots // t's GPU count, free CPU // t's CPU), where a GPU
        offers free // share slots; what they would not use of the node's free GPU milli is stranded.
        CPU-only shapes are left out: they strand every GPU on every node alike, so they never decide.
        """
        left, _ = self._per_shape(cpu_free, gpu_free, model_bits)
        return np.asarray(left @ self.prob, dtype=np.float64)

    def waste(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> FloatArray:
        """pffs's measure: ``stranded`` plus ``NEXT_POD_WEIGHT`` times FGD's fragment for the same shapes
        (``fragmentation``'s arithmetic, not its float-for-float order: nothing here must match FGD's).

        ``stranded`` looks at a node filled to the end; FGD's fragment at the next pod only (whether one
        more pod of each shape fits, and the milli on GPUs too small for it). Late in a busy cluster the
        next pod is the one that counts: the sum keeps the slivers that small pods can still use. Both
        come from one pass over the nodes' GPUs (the divisions are the costly part)."""
        left, next_pod = self._per_shape(cpu_free, gpu_free, model_bits)
        return np.asarray((left + NEXT_POD_WEIGHT * next_pod) @ self.prob, dtype=np.float64)

    def next_pod(self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray) -> FloatArray:
        """FGD's fragment of each node for one more pod of each shape alone (``waste``'s second term; FGD's
        meaning, not its float-for-float order)."""
        _, next_pod = self._per_shape(cpu_free, gpu_free, model_bits)
        return np.asarray(next_pod.astype(np.float64) @ self.prob, dtype=np.float64)

    def _per_shape(
        self, cpu_free: IntArray, gpu_free: IntArray, model_bits: IntArray
    ) -> tuple[IntArray, IntArray]:
        """Per (node, shape): the milli stranded by filling the node with the shape, and FGD's fragment of
        the node for one more pod of it (all free milli where none fits, else the milli on GPUs below its
        share; CPU-only shapes: all free milli, as in ``fragmentation``)."""
        gpu_total = gpu_free.sum(axis=1)
        c = self._filling
        # GPU slots per distinct share (few), then per shape: the division is the costly part.
        per_gpu = gpu_free[:, None, :] // c.shares[None, :, None]  # (M, shares, GPUs)
        per_share = per_gpu.sum(axis=2)
        fitting_gpus = (per_gpu > 0).sum(axis=2)[:, c.share_of_shape]
        below_share = np.where(per_gpu == 0, gpu_free[:, None, :], 0).sum(axis=2)[:, c.share_of_shape]
        slots = per_share[:, c.share_of_shape] // c.count[None, :]  # (M, shapes)
        by_cpu = np.where(c.needs_cpu, cpu_free[:, None] // c.cpu[None, :], slots)
        fits = np.minimum(slots, by_cpu)
        usable = self._accepts(model_bits) & c.gpu_shape[None, :]
        used = np.where(usable, fits * c.milli[None, :], 0)
        left = (gpu_total[:, None] - used) * c.gpu_shape[None, :]
        one_more = usable & (cpu_free[:, None] >= self.cpu[None, :]) & (fitting_gpus >= c.count[None, :])
        next_pod = np.where(one_more, below_share, gpu_total[:, None])
        return left, next_pod
