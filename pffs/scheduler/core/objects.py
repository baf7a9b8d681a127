"""The scheduling core's vocabulary: nodes with their GPUs, pods, pod groups, queues, and placements.

Plain dataclasses, no Kubernetes types: the Kubernetes edge (``kube/nodes.py``, ``kube/pods.py``,
``kube/groups.py``) translates Kubernetes objects into these, and the core (``session.py``) works on them
alone. Units are integers: milli-CPU, MiB of memory, milli-GPU (a whole GPU is ``MILLI``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MILLI = 1000


RESOURCE_NAMES = ("cpu_milli", "memory_mib", "gpu_milli")


@dataclass(frozen=True)
class Resources:
    """An amount of the resources that quotas count."""

    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_milli: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli + other.cpu_milli,
            self.memory_mib + other.memory_mib,
            self.gpu_milli + other.gpu_milli,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_milli - other.cpu_milli,
            self.memory_mib - other.memory_mib,
            self.gpu_milli - other.gpu_milli,
        )

    def exceeding(self, limit: Resources) -> list[str]:
        """The names of the resources (fields) in which this amount passes ``limit``."""
        return [name for name in RESOURCE_NAMES if getattr(self, name) > getattr(limit, name)]

    def fits_within(self, limit: Resources) -> bool:
        return not self.exceeding(limit)


UNLIMITED = Resources(2**62, 2**62, 2**62)


@dataclass(frozen=True)
class Gpu:
    """One GPU of a node: its index on the node, and which NVLink group and NUMA domain it sits in."""

    index: int
    nvlink_group: int = 0
    numa: int = 0


@dataclass
class Node:
    """A node's capacity, topology and what its pffs cache holds. Free amounts live in ``ClusterState``."""

    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[Gpu, ...] = ()
    gpu_model: str = ""
    tor: str = ""  # the top-of-rack switch the node hangs off
    labels: Mapping[str, str] = field(default_factory=dict)
    cached: Mapping[str, float] = field(default_factory=dict)  # dataset URL -> fraction held warm (0..1)
    schedulable: bool = True


@dataclass(frozen=True)
class Pod:
    """One pod's request. ``gpu_count`` GPUs with ``gpu_milli`` each: a sharing pod has count 1 and
    gpu_milli < MILLI; a multi-GPU pod takes whole GPUs."""

    name: str
    group: str
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu_count: int = 0
    gpu_milli: int = 0  # per GPU
    gpu_models: frozenset[str] = frozenset()  # empty: any model
    node_selector: Mapping[str, str] = field(default_factory=dict)
    datasets: tuple[str, ...] = ()

    @property
    def request(self) -> Resources:
        return Resources(self.cpu_milli, self.memory_mib, self.gpu_count * self.gpu_milli)


def is_sharing(pod: Pod) -> bool:
    return pod.gpu_count == 1 and 0 < pod.gpu_milli < MILLI


def uses_gpus(pod: Pod) -> bool:
    return pod.gpu_count > 0 and pod.gpu_milli > 0


@dataclass
class PodGroup:
    """Pods that run together or not at all (a gang): the group needs ``min_member`` of them placed."""

    name: str
    queue: str
    pods: list[Pod]
    min_member: int = 1
    priority: int = 0
    created: float = 0.0  # arrival time: earlier first among equals

    @property
    def datasets(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for pod in self.pods:
            seen.update(dict.fromkeys(pod.datasets))
        return tuple(seen)


@dataclass
class Queue:
    """A tenant's share. ``guaranteed`` is never taken away by reclaim; ``capability`` is the hard ceiling.

    A non-overcommit queue admits a group only while its usage plus the group's minimum stays within
    ``capability``; an overcommit queue admits past it and marks the group overcommitted (evicted first).
    ``reclaimable``: other queues may take back what this queue uses above ``guaranteed``.
    """

    name: str
    weight: int = 1
    guaranteed: Resources = Resources()
    capability: Resources = UNLIMITED
    overcommit: bool = False
    reclaimable: bool = True


@dataclass(frozen=True)
class Placement:
    """Where a running (or just placed) pod sits: its node and the GPUs it holds, ``gpu_milli`` on each."""

    pod: Pod
    node: str
    gpus: tuple[int, ...] = ()
