"""What is free on each node and what each queue uses, during one session: ``ClusterState``.

NumPy arrays indexed by node (nodes sorted by name), changed only through ``assign`` and ``unassign``; the
scoring plugins (``scoring.py``) read it, the session (``session.py``) changes it. Feasibility (``fits``) is
here: CPU and memory fit; ``node_selector`` labels match; ``gpu_models`` (if any) holds the node's model; a
sharing pod needs one GPU with its share free; a k-GPU pod needs k fully free GPUs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pffs.scheduler.core.arrays import BoolArray, FloatArray, IntArray
from pffs.scheduler.core.objects import (
    MILLI,
    RESOURCE_NAMES,
    Node,
    Pod,
    Queue,
    Resources,
    is_sharing,
    uses_gpus,
)

if TYPE_CHECKING:
    from pffs.scheduler.core.fragmentation import TypicalShapes


class ClusterState:
    """What is free on each node (NumPy arrays indexed by node, sorted by name) and each queue's usage.

    Changed only through ``assign`` and ``unassign``, which are exact inverses, so a tentative gang is
    rolled back by undoing its assignments."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = sorted(nodes, key=lambda n: n.name)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        width = max((len(n.gpus) for n in self.nodes), default=0) or 1
        n_nodes = len(self.nodes)
        self.cpu_cap = np.array([n.cpu_milli for n in self.nodes], dtype=np.int64)
        self.mem_cap = np.array([n.memory_mib for n in self.nodes], dtype=np.int64)
        self.gpu_count = np.array([len(n.gpus) for n in self.nodes], dtype=np.int64)
        self.cpu_free = self.cpu_cap.copy()
        self.mem_free = self.mem_cap.copy()
        slots = np.arange(width)
        self.gpu_free = np.where(slots[None, :] < self.gpu_count[:, None], MILLI, 0).astype(np.int64)
        # GPU index (as Placement names it) <-> slot in the node's row
        self.slot_of = [{g.index: s for s, g in enumerate(n.gpus)} for n in self.nodes]
        self.nvlink_onehot = self._onehot([[g.nvlink_group for g in n.gpus] for n in self.nodes], width)
        self.numa_onehot = self._onehot([[g.numa for g in n.gpus] for n in self.nodes], width)
        self.tors = sorted({n.tor for n in self.nodes})
        tor_id = {t: i for i, t in enumerate(self.tors)}
        self.tor_idx = np.array([tor_id[n.tor] for n in self.nodes], dtype=np.int64)
        self.schedulable = np.array([n.schedulable for n in self.nodes], dtype=bool)
        # One bit per GPU model (the measure's ``model_mask`` test); none if there are more than fit in 62.
        models = sorted({n.gpu_model for n in self.nodes if n.gpu_model and n.gpus})
        self.model_bit = {m: 1 << i for i, m in enumerate(models)} if len(models) <= 62 else {}
        self.model_bits = np.array(
            [self.model_bit.get(n.gpu_model, 0) if n.gpus else 0 for n in self.nodes], dtype=np.int64
        )
        self.group_nodes: dict[str, Counter[int]] = {}  # group -> node -> pods there (running and placed)
        self.usage: dict[str, Resources] = {}  # queue -> requests of its running and placed pods
        self.queue_of: dict[str, str] = {}  # group -> queue
        self.typical: TypicalShapes | None = None
        self.cpu_contested = False  # CPU-only pods ask for much of the CPU (``CONTESTED_CPU``)
        self._static: dict[tuple[object, ...], BoolArray] = {}
        # Per node, the last change (a tick of ``assign``/``unassign``): scores cached per pod shape are
        # recomputed only for the nodes that changed since (one or two per placement).
        self.version = np.zeros(n_nodes, dtype=np.int64)
        self._tick = 0
        self.score_cache: dict[tuple[object, ...], tuple[FloatArray, IntArray]] = {}
        self.totals = Resources(
            int(self.cpu_cap.sum()), int(self.mem_cap.sum()), int(self.gpu_count.sum()) * MILLI
        )
        self.n_nodes = n_nodes

    @staticmethod
    def _onehot(ids: list[list[int]], width: int) -> IntArray:
        distinct = sorted({i for row in ids for i in row}) or [0]
        pos = {v: k for k, v in enumerate(distinct)}
        out = np.zeros((len(ids), width, len(distinct)), dtype=np.int64)
        for m, row in enumerate(ids):
            for s, v in enumerate(row):
                out[m, s, pos[v]] = 1
        return out

    def static_mask(self, pod: Pod) -> BoolArray:
        """Nodes the pod may ever use: schedulable, labels match, GPU model accepted."""
        key = (tuple(sorted(pod.node_selector.items())), pod.gpu_models if uses_gpus(pod) else frozenset())
        mask = self._static.get(key)
        if mask is None:
            mask = self.schedulable.copy()
            for i, node in enumerate(self.nodes):
                if any(node.labels.get(k) != v for k, v in pod.node_selector.items()) or (
                    uses_gpus(pod) and pod.gpu_models and node.gpu_model not in pod.gpu_models
                ):
                    mask[i] = False
            self._static[key] = mask
        return mask

    def fits(self, pod: Pod) -> BoolArray:
        """Nodes that can take the pod now."""
        ok = self.static_mask(pod) & (self.cpu_free >= pod.cpu_milli) & (self.mem_free >= pod.memory_mib)
        if uses_gpus(pod):
            if pod.gpu_milli > MILLI:
                return np.zeros(self.n_nodes, dtype=bool)
            if is_sharing(pod):
                ok &= (self.gpu_free >= pod.gpu_milli).any(axis=1)
            else:
                ok &= (self.gpu_free >= MILLI).sum(axis=1) >= pod.gpu_count
        return ok

    def _touch(self, node: int) -> None:
        self._tick += 1
        self.version[node] = self._tick

    def assign(self, node: int, pod: Pod, slots: tuple[int, ...]) -> None:
        self._touch(node)
        self.cpu_free[node] -= pod.cpu_milli
        self.mem_free[node] -= pod.memory_mib
        for s in slots:
            self.gpu_free[node, s] -= pod.gpu_milli
        self.group_nodes.setdefault(pod.group, Counter())[node] += 1
        self.add_usage(pod, +1)

    def unassign(self, node: int, pod: Pod, slots: tuple[int, ...]) -> None:
        self._touch(node)
        self.cpu_free[node] += pod.cpu_milli
        self.mem_free[node] += pod.memory_mib
        for s in slots:
            self.gpu_free[node, s] += pod.gpu_milli
        counts = self.group_nodes[pod.group]
        counts[node] -= 1
        if counts[node] <= 0:
            del counts[node]
        self.add_usage(pod, -1)

    def add_usage(self, pod: Pod, sign: int) -> None:
        queue = self.queue_of.get(pod.group)
        if queue is None:
            return
        r = pod.request
        old = self.usage.get(queue, Resources())
        self.usage[queue] = old + r if sign > 0 else old - r

    def share(self, queue: Queue) -> float:
        """Dominant share of the cluster the queue uses, divided by its weight."""
        used = self.usage.get(queue.name, Resources())
        parts = [
            getattr(used, r) / getattr(self.totals, r) for r in RESOURCE_NAMES if getattr(self.totals, r) > 0
        ]
        return max(parts, default=0.0) / max(queue.weight, 1)
