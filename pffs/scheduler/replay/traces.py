"""Reading the openb trace CSVs, and the per-seed replay order of the FGD paper's simulator.

Node list columns: ``sn,cpu_milli,memory_mib,gpu,model``. Pod list columns: ``name,cpu_milli,memory_mib,
num_gpu,gpu_milli`` and optionally ``gpu_spec`` (``A|B``: allowed GPU models); any other column (qos, phase,
times) is ignored, since pods never leave in this replay.

The replay order (see ``replay_order``) follows the reference simulator draw for draw, with Go's generator
(``go_rand``): seed; one ``Int`` (it logs it); shuffle the name-sorted trace; resample from the name-sorted
trace until the next sample's GPU share would pass ``ratio`` x capacity (or drop random pods if the trace
already asks for more); a few draws the informers of its Kubernetes client take; then a permutation of the
name-sorted nodes. That permutation is the node order that breaks score ties (its Kubernetes fork picks the
tied node with the smallest name, and each node name starts with its number in the permutation).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pffs.scheduler.replay.go_rand import GoRand
from pffs.scheduler.replay.model import MILLI, Cluster, IntArray, PodList

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
DEFAULT_RATIO = 1.3
# Go draws taken between the trace resampling and the node permutation: each informer the simulator's
# Kubernetes client starts draws a watch timeout (one Float64) when it first watches. Found by matching the
# published per-seed curves exactly (see tests/test_scheduler_sim.py); 0..30 were tried.
INFORMER_DRAWS = 10
MAX_MODELS = 62  # a pod's allowed models are bits of one int64


class TraceError(ValueError):
    """The file is not a trace this module can read (wrong columns, bad numbers)."""


def _rows(path: Path, required: tuple[str, ...]) -> list[dict[str, str]]:
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, not a CSV file")
    with path.open(newline="") as f:  # FileNotFoundError passes through: the caller reports it
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)} (has: {reader.fieldnames})")
        return list(reader)


def _int(row: dict[str, str], column: str, path: Path, line: int) -> int:
    text = (row.get(column) or "").strip()
    try:
        return int(text) if text else 0
    except ValueError:
        try:
            return int(float(text))
        except ValueError:
            raise TraceError(f"{path}:{line}: {column}={text!r} is not a number") from None


def load_nodes(path: str | Path) -> Cluster:
    """The node list as an empty ``Cluster`` (file order kept)."""
    path = Path(path)
    rows = _rows(path, NODE_COLUMNS)
    if not rows:
        raise TraceError(f"{path}: no nodes")
    models: list[str] = []
    model_ids = []
    for r in rows:
        model = (r["model"] or "").strip()
        if model and model not in models:
            models.append(model)
        model_ids.append(models.index(model) if model else -1)
    if len(models) > MAX_MODELS:
        raise TraceError(f"{path}: more than {MAX_MODELS} GPU models")
    numbers = np.array(
        [[_int(r, c, path, i + 2) for c in ("cpu_milli", "memory_mib", "gpu")] for i, r in enumerate(rows)],
        dtype=np.int64,
    )
    if (numbers < 0).any():
        raise TraceError(f"{path}: negative capacity")
    gpu_count = numbers[:, 2]
    model_arr = np.array(model_ids, dtype=np.int64)
    model_arr[gpu_count == 0] = -1
    return Cluster([r["sn"] for r in rows], numbers[:, 0], numbers[:, 1], gpu_count, model_arr, models)


def load_pods(path: str | Path) -> PodList:
    """The pod list. ``gpu_milli`` is clipped to (0, 1000]; a GPU pod asking 0 milli counts as CPU-only."""
    path = Path(path)
    rows = _rows(path, POD_COLUMNS)
    n = len(rows)
    cpu = np.empty(n, np.int64)
    mem = np.empty(n, np.int64)
    share = np.empty(n, np.int64)
    count = np.empty(n, np.int64)
    for i, r in enumerate(rows):
        line = i + 2
        cpu[i] = _int(r, "cpu_milli", path, line)
        mem[i] = _int(r, "memory_mib", path, line)
        num_gpu = _int(r, "num_gpu", path, line)
        milli = min(_int(r, "gpu_milli", path, line), MILLI)
        if cpu[i] < 0 or mem[i] < 0 or num_gpu < 0:
            raise TraceError(f"{path}:{line}: negative request")
        if num_gpu == 0 or milli <= 0:
            share[i], count[i] = 0, 0
        elif num_gpu > 1 and milli < MILLI:
            raise TraceError(f"{path}:{line}: a multi-GPU pod must take whole GPUs (gpu_milli={milli})")
        else:
            share[i], count[i] = milli, num_gpu
    specs = ["|".join(m for m in (r.get("gpu_spec") or "").split("|") if m) for r in rows]
    specs = [s if c > 0 else "" for s, c in zip(specs, count, strict=True)]  # CPU pods ignore gpu_spec
    return PodList([r["name"] for r in rows], cpu, mem, share, count, specs)


@dataclass
class ReplayOrder:
    """What one seed decides: the pods to submit (indices into the trace, in order) and the tie order."""

    pods: IntArray
    node_rank: IntArray  # per node: lower wins a tie
    rng: GoRand  # the stream after those draws (the random policy goes on drawing from it)
    resampled: int  # pods appended (> 0) or dropped (< 0) to reach ratio x capacity


def replay_order(
    pods: PodList,
    cluster: Cluster,
    seed: int,
    ratio: float = DEFAULT_RATIO,
    informer_draws: int = INFORMER_DRAWS,
) -> ReplayOrder:
    """The reference simulator's pod order and node tie order for ``seed`` (see the module docstring)."""
    rng = GoRand(seed)
    rng.go_int()
    by_name = sorted(range(len(pods)), key=pods.names.__getitem__)
    order = list(by_name)
    rng.shuffle(order)
    milli = pods.gpu_milli.tolist()
    share = pods.share.tolist()
    total = sum(milli)
    target = ratio * float(cluster.gpu_capacity_milli)
    resampled = 0
    if ratio > 0 and total > target:
        while float(total) > target and order:
            i = rng.intn(len(order))
            total -= milli[order.pop(i)]
            resampled -= 1
    elif ratio > 0 and total < target and by_name:
        while True:
            i = by_name[rng.intn(len(by_name))]
            # As the reference does: the stop test adds the sample's per-GPU share, not its total.
            if float(total + share[i]) > target:
                break
            total += milli[i]
            order.append(i)
            resampled += 1
    for _ in range(informer_draws):
        rng.float64()
    nodes_by_name = sorted(range(cluster.size), key=cluster.names.__getitem__)
    rank = np.empty(cluster.size, np.int64)
    rank[nodes_by_name] = rng.perm(cluster.size)
    return ReplayOrder(np.array(order, dtype=np.int64), rank, rng, resampled)
