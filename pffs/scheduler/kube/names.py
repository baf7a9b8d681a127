"""The names `pffs scheduler` reads from Kubernetes objects and writes to them (the README documents them),
and what each means. The cache report's names (``pffs.io/cache``, ``pffs.io/datasets``, the CSI driver) are
in ``locality.py``, which the CSI plugin shares.

Nodes
  * ``status.allocatable`` cpu, memory and ``nvidia.com/gpu``; nodes that are cordoned
    (``spec.unschedulable``) or not Ready are left out.
  * label ``nvidia.com/gpu.product``: the GPU model (as NVIDIA's GPU feature discovery sets it).
  * label ``pffs.io/tor``: the top-of-rack switch (a rack-level name; the zone label is too coarse for this).
  * annotation ``pffs.io/gpu-topology``: JSON
    ``{"nvlink_groups": [[0,1,2,3],[4,5,6,7]], "numa": [0,0,0,0,1,1,1,1]}`` (both keys
    optional); without it all GPUs count as one NVLink group and NUMA domain.
  * annotation ``pffs.io/cache``: what the node's pffs cache holds (``locality.py``); read in ``nodes.py``.

Pods (only those with ``spec.schedulerName`` = ours are placed; every pod on a node uses room there)
  * requests summed over containers, against the largest init container (sidecars added), plus overhead.
  * ``nvidia.com/gpu``: whole GPUs; annotation ``pffs.io/gpu-milli: "250"``: a share of one GPU instead.
  * GPU model: nodeSelector ``nvidia.com/gpu.product`` and/or annotation ``pffs.io/gpu-models: "A100,H100"``.
  * datasets: annotation ``pffs.io/datasets`` and pffs CSI inline volumes (``locality.py``).
  * ``spec.priority``; label ``pffs.io/queue`` (default ``default``).
  * label ``scheduling.x-k8s.io/pod-group``: the pod's gang. Min member from the PodGroup
    (``scheduling.x-k8s.io/v1alpha1``, ``spec.minMember``) or, without one, the pod annotation
    ``pffs.io/min-member``. A PodGroup's own label ``pffs.io/queue`` overrides its pods'.
  * annotation ``pffs.io/gpus: "0,1"``: the GPU indexes pffs chose; written through the Binding (the API
    server copies a Binding's annotations onto the pod), read back for running pods.
  * annotations ``pffs.io/warm-before-bind: "10m"`` and ``pffs.io/warm-secret``: bind the gang once its
    nodes are warm, or at the deadline (``warm_before_bind.py``).
"""

from __future__ import annotations

SCHEDULER_NAME = "pffs-scheduler"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
TOR_LABEL = "pffs.io/tor"
TOPOLOGY_ANNOTATION = "pffs.io/gpu-topology"
GPU_MILLI_ANNOTATION = "pffs.io/gpu-milli"
GPU_MODELS_ANNOTATION = "pffs.io/gpu-models"
GPUS_ANNOTATION = "pffs.io/gpus"
QUEUE_LABEL = "pffs.io/queue"
MIN_MEMBER_ANNOTATION = "pffs.io/min-member"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
PODGROUP_API = "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"
DEFAULT_QUEUE = "default"
