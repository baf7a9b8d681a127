"""The pure cluster model: nodes and pods as NumPy arrays, what fits where, and placing a pod.

Units are integers throughout: milli-CPU, MiB of memory, milli-GPU (one GPU = ``MILLI``). A node's GPUs are a
row of ``Cluster.gpu_free``; a node with fewer GPUs than the widest node has its missing slots at 0, so a
missing GPU behaves as a fully used one: it never fits a request and adds nothing to the free totals.

A pod asks for CPU, memory and, optionally, ``count`` GPUs with ``share`` milli on each. A sharing pod has
``count == 1`` and ``share < MILLI``; a multi-GPU pod takes whole GPUs (``share == MILLI``). ``model_mask``
says which GPU models it accepts, one bit per model of the cluster (``ANY_MODEL``: all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pffs.scheduler.core.fragmentation import ANY_MODEL, NodeCapacities

MILLI = 1000

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod's request (a row of a ``PodList``)."""

    cpu: int
    mem: int
    share: int  # milli-GPU per GPU, 0 for a CPU-only pod
    count: int  # number of GPUs, 0 for a CPU-only pod
    model_mask: int  # accepted GPU models, bits of Cluster.model_names (ANY_MODEL: any)

    @property
    def gpu_milli(self) -> int:
        """Total GPU request: what the pod adds to 'arrived' and, once placed, to 'used'."""
        return self.share * self.count

    @property
    def is_sharing(self) -> bool:
        return self.count == 1 and 0 < self.share < MILLI


@dataclass
class Cluster:
    """Nodes' capacities (fixed) and what is free on them now (changes as pods are placed)."""

    names: list[str]
    cpu_capacity: IntArray
    mem_capacity: IntArray
    gpu_count: IntArray
    gpu_model: IntArray  # index into model_names, -1 for a node without GPUs
    model_names: list[str]
    cpu_free: IntArray = field(init=False)
    mem_free: IntArray = field(init=False)
    gpu_free: IntArray = field(init=False)  # (nodes, widest node's GPU count), milli left per GPU

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Every node empty again."""
        width = max(int(self.gpu_count.max(initial=0)), 1)
        self.cpu_free = self.cpu_capacity.copy()
        self.mem_free = self.mem_capacity.copy()
        slots = np.arange(width)
        self.gpu_free = np.where(slots[None, :] < self.gpu_count[:, None], MILLI, 0).astype(np.int64)

    def copy(self) -> Cluster:
        """A cluster with the same nodes, all empty."""
        return Cluster(
            list(self.names),
            self.cpu_capacity,
            self.mem_capacity,
            self.gpu_count,
            self.gpu_model,
            list(self.model_names),
        )

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def gpu_capacity_milli(self) -> int:
        return int(self.gpu_count.sum()) * MILLI

    @property
    def used_gpu_milli(self) -> int:
        return self.gpu_capacity_milli - int(self.gpu_free.sum())

    def model_bits(self) -> IntArray:
        """Each node's model as one bit (0 for a node without GPUs), to test against a pod's model_mask."""
        return np.where(self.gpu_model >= 0, np.left_shift(1, np.maximum(self.gpu_model, 0)), 0)

    def capacities(self) -> NodeCapacities:
        """What each node offers when empty (for ``TypicalShapes``' scarcity)."""
        return NodeCapacities(self.cpu_capacity, self.gpu_count, self.model_bits())

    def model_mask(self, spec: str) -> int:
        """A ``gpu_spec`` such as ``"V100M16|V100M32"`` as bits of this cluster's models; empty: any model."""
        wanted = [m for m in spec.split("|") if m]
        if not wanted:
            return ANY_MODEL
        return sum(1 << i for i, name in enumerate(self.model_names) if name in wanted)

    def feasible(self, pod: Pod, model_bits: IntArray | None = None) -> BoolArray:
        """Which nodes can take ``pod`` now: CPU and memory fit, its GPUs (of an allowed model) are free."""
        ok = (self.cpu_free >= pod.cpu) & (self.mem_free >= pod.mem)
        if pod.count == 0:
            return ok
        if pod.model_mask != ANY_MODEL:
            bits = self.model_bits() if model_bits is None else model_bits
            ok &= (bits & pod.model_mask) != 0
        if pod.share < MILLI:
            ok &= (self.gpu_free >= pod.share).any(axis=1)
        else:
            ok &= (self.gpu_free == MILLI).sum(axis=1) >= pod.count
        return ok

    def place(self, node: int, pod: Pod, gpus: tuple[int, ...]) -> None:
        """Take the pod's resources on ``node``, ``pod.share`` on each GPU of ``gpus``."""
        if len(gpus) != pod.count:
            raise ValueError(f"pod wants {pod.count} GPUs, got {gpus}")
        free = self.gpu_free[node]
        if self.cpu_free[node] < pod.cpu or self.mem_free[node] < pod.mem:
            raise ValueError(f"node {self.names[node]} lacks CPU or memory for {pod}")
        if len(set(gpus)) != len(gpus) or any(g >= self.gpu_count[node] or free[g] < pod.share for g in gpus):
            raise ValueError(f"GPUs {gpus} of node {self.names[node]} cannot take {pod}")
        self.cpu_free[node] -= pod.cpu
        self.mem_free[node] -= pod.mem
        for g in gpus:
            free[g] -= pod.share


@dataclass(frozen=True)
class PodList:
    """A trace's pods as columns; ``specs`` keeps each pod's ``gpu_spec`` text ("" = any model)."""

    names: list[str]
    cpu: IntArray
    mem: IntArray
    share: IntArray
    count: IntArray
    specs: list[str]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def gpu_milli(self) -> IntArray:
        return self.share * self.count

    def pod(self, i: int, cluster: Cluster) -> Pod:
        spec = self.specs[i]
        return Pod(
            int(self.cpu[i]),
            int(self.mem[i]),
            int(self.share[i]),
            int(self.count[i]),
            cluster.model_mask(spec) if spec else ANY_MODEL,
        )

    def take(self, order: IntArray) -> PodList:
        """The pods in ``order`` (indices may repeat)."""
        return PodList(
            [self.names[i] for i in order],
            self.cpu[order],
            self.mem[order],
            self.share[order],
            self.count[order],
            [self.specs[i] for i in order],
        )
