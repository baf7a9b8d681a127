"""Synthetic simulations of what the openb trace lacks: gangs (with ToR and NVLink needs) and cache locality.

A discrete-event simulation: jobs arrive, a scheduler places their pods, a job runs for its duration once all
its pods run (the way PyTorch DDP and MPI jobs do) and then frees them. The scheduler works at the first
multiple of ``tick`` seconds after something changed (1 s: Volcano's schedule period; kube-scheduler reacts
to events at once). Two schedulers, the same jobs, cluster, durations and node scores:

- ``gang``: pffs's session (``run_session``), one ``PodGroup`` per job with ``min_member`` = its pods: all of
  a job's pods are placed at once or none, and the first gang that waits keeps its room (backfill).
- ``gangless``: the default kube-scheduler with no gang scheduler, choosing nodes with the same scores (pffs's
  plugins: only the handling of gangs differs). Each pod is its own group of one. Pods are tried one at a
  time in queue order (priority, then queue timestamp); a pod that does not fit is skipped and the
  scheduler goes on with later pods (no reservation, no all-or-nothing). As in kube-scheduler's scheduling
  queue, a pod that failed gets a fresh timestamp (it goes behind the pods queued before the failure),
  backs off 1 s doubling to 10 s (``podInitialBackoffSeconds``/``podMaxBackoffSeconds``) and waits in the
  unschedulable pool until a pod leaves the cluster (the event that can make it fit; every departure
  requeues every parked pod, so the pool's 5-minute flush would change nothing and is not modelled). The
  placed pods of a job whose other pods are not placed hold their GPUs doing nothing (a partial gang), and
  partial gangs can hold the room each other needs. The escape: a job whose first pod has been placed for
  ``start_timeout`` seconds (30 min, torch.distributed's long-standing default process-group timeout)
  without all its pods running fails its rendezvous and is restarted: its pods are deleted (their room
  freed) and created again at the back of the queue, as a training operator does with a job that failed
  and may restart. ``start_timeout=None``: partial gangs hold their pods until they complete.

The locality simulation gives every node an LRU cache of datasets (bytes-bounded); a job's pods read the
job's dataset once at start (its first epoch): what the node holds at the warm speed, the rest from the
backend at the cold speed, then the node holds it all; the job runs for its duration after that. The
speeds are pffs's own measured figures (bench/results/mounts.json: 1 GiB read through the pffs mount, cold
from S3 473 MB/s, warm from the disk cache after a remount 1363 MB/s). To tell why locality helps as much
as it does, each placement of a pod with a dataset is checked against the cluster as it was before the
session: could two or more nodes take it (a choice), could a node holding the dataset take it, did the
pod go there, or did every node holding it lack room.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from pffs.scheduler.core.objects import MILLI, Gpu, Node, Placement, Pod, PodGroup, Queue
from pffs.scheduler.core.session import Weights, run_session
from pffs.scheduler.core.state import ClusterState

COLD_MBPS = 473.0  # pffs mount, 1 GiB, cold from S3 (bench/results/mounts.json)
WARM_MBPS = 1363.0  # pffs mount, 1 GiB, warm from the disk cache after a remount (same file)
MB = 1_000_000
MODES = ("gang", "gangless")
BACKOFF_INITIAL = 1.0  # kube-scheduler's podInitialBackoffSeconds
BACKOFF_MAX = 10.0  # kube-scheduler's podMaxBackoffSeconds
START_TIMEOUT = 1800.0  # a partial gang's pods give up after this long and the job restarts
_EPS = 1e-9


def make_cluster(
    nodes: int = 64,
    gpus: int = 8,
    per_nvlink: int = 4,
    per_tor: int = 8,
    cpu: int = 96_000,
    mem: int = 1_024_000,
) -> list[Node]:
    """``nodes`` nodes of ``gpus`` GPUs, NVLink groups (and NUMA domains) of ``per_nvlink``, ``per_tor``
    nodes under each ToR switch."""
    return [
        Node(
            f"node{i:03d}",
            cpu,
            mem,
            tuple(Gpu(g, g // per_nvlink, g // per_nvlink) for g in range(gpus)),
            "A100",
            f"tor{i // per_tor:02d}",
            cached={},
        )
        for i in range(nodes)
    ]


@dataclass
class Job:
    name: str
    arrival: float  # seconds
    duration: float  # seconds of compute once all pods run
    pods: int
    gpus: int  # per pod (1 with gpu_milli < MILLI: a sharing pod)
    gpu_milli: int = MILLI
    priority: int = 0
    dataset: str = ""
    size: int = 0  # dataset bytes

    @property
    def kind(self) -> str:
        if self.gpu_milli < MILLI:
            return "sharing"
        if self.pods > 1:
            return "gang"
        return f"{self.gpus}-gpu"

    def group(self) -> PodGroup:
        datasets = (self.dataset,) if self.dataset else ()
        pods = [
            Pod(
                f"{self.name}-{k}",
                self.name,
                4000 * self.gpus,
                32_000 * self.gpus,
                self.gpus,
                self.gpu_milli,
                datasets=datasets,
            )
            for k in range(self.pods)
        ]
        return PodGroup(
            self.name, "default", pods, min_member=self.pods, priority=self.priority, created=self.arrival
        )


def gang_jobs(count: int, seed: int, load: float, gpus_total: int, high_priority: float = 0.0) -> list[Job]:
    """A mix of 1-GPU pods, sharing pods, 2-4 GPU pods, 8-GPU single-node jobs and 2-8 node gangs of 8 GPUs,
    arriving as a Poisson stream that offers ``load`` times the cluster's GPU capacity."""
    rng = random.Random(seed)
    jobs = []
    specs: list[tuple[str, float]] = [
        ("1", 0.35),
        ("share", 0.15),
        ("2-4", 0.15),
        ("8", 0.15),
        ("gang", 0.20),
    ]
    for i in range(count):
        kind = rng.choices([k for k, _ in specs], [w for _, w in specs])[0]
        pods, gpus, milli = 1, 1, MILLI
        if kind == "share":
            milli = rng.choice([250, 500])
        elif kind == "2-4":
            gpus = rng.choice([2, 4])
        elif kind == "8":
            gpus = 8
        elif kind == "gang":
            pods, gpus = rng.randint(2, 8), 8
        duration = rng.lognormvariate(math.log(3600 if kind == "gang" else 1800), 0.6)
        jobs.append(
            Job(
                f"j{i:04d}",
                0.0,
                duration,
                pods,
                gpus,
                milli,
                priority=1 if rng.random() < high_priority else 0,
            )
        )
    mean_work = sum(j.duration * j.pods * j.gpus * j.gpu_milli / MILLI for j in jobs) / len(jobs)
    rate = load * gpus_total / mean_work  # jobs per second
    t = 0.0
    for j in jobs:
        t += rng.expovariate(rate)
        j.arrival = t
    return jobs


def locality_jobs(
    count: int,
    seed: int,
    load: float,
    gpus_total: int,
    datasets: int = 12,
    size_gb: tuple[float, float] = (100.0, 600.0),
    parallel: int = 4,
) -> list[Job]:
    """Hyper-parameter sweeps and recurring training runs that re-read a fixed set of datasets.

    ``datasets`` datasets of ``size_gb`` (uniform), Zipf popularity. 70% of the work items are sweeps: 4-12
    trials of 1, 2 or 4 GPUs (30 min median) on one dataset, ``parallel`` at once and then one every
    30 min / ``parallel`` (the way Katib's parallelTrialCount keeps a sweep going); 30% are training runs
    (1 h median) of one 8-GPU pod or a 2 x 8-GPU gang. Work items arrive as a Poisson stream offering
    ``load`` times the GPU capacity; jobs are named in arrival order."""
    rng = random.Random(seed)
    sizes = [int(rng.uniform(*size_gb) * 1e9) for _ in range(datasets)]
    popularity = [1.0 / (k + 1) for k in range(datasets)]
    items: list[list[tuple[float, Job]]] = []  # (offset from the item's arrival, job)
    made = 0
    while made < count:
        d = rng.choices(range(datasets), popularity)[0]
        ds, size = f"s3://data/ds{d:02d}", sizes[d]
        item = []
        if rng.random() < 0.7:
            gpus = rng.choice([1, 2, 4])
            for k in range(min(rng.randint(4, 12), count - made)):
                offset = max(0, k - parallel + 1) * 1800.0 / parallel
                duration = rng.lognormvariate(math.log(1800), 0.5)
                item.append((offset, Job("", 0.0, duration, 1, gpus, dataset=ds, size=size)))
        else:
            pods = rng.choice([1, 2])
            duration = rng.lognormvariate(math.log(3600), 0.5)
            item.append((0.0, Job("", 0.0, duration, pods, 8, dataset=ds, size=size)))
        items.append(item)
        made += len(item)
    mean_work = sum(j.duration * j.pods * j.gpus for item in items for _, j in item) / len(items)
    rate = load * gpus_total / mean_work  # items per second
    t = 0.0
    jobs = []
    for item in items:
        t += rng.expovariate(rate)
        for offset, j in item:
            j.arrival = t + offset
            jobs.append(j)
    jobs.sort(key=lambda j: j.arrival)
    for i, j in enumerate(jobs):
        j.name = f"j{i:04d}"
    return jobs


@dataclass
class Stats:
    """What one simulation measured. Waits of jobs that never started count up to the horizon (so a mean
    or p95 with ``never_started`` > 0 is a lower bound)."""

    mode: str
    jobs: int
    started: int
    never_started: int  # within the horizon
    sessions: int
    horizon: float
    gpu_util: float  # GPU milli-seconds of running jobs / capacity, while jobs arrive (0 .. last arrival)
    gpu_held_util: float  # the same counting every placed pod (partial gangs too)
    partial_gang_gpu_hours: float  # GPUs held by placed pods of jobs not running yet, whole simulation
    partial_peak_gpus: float  # most GPUs held by partial gangs at one time
    partial_overlap_hours: float  # time during which two or more partial gangs held GPUs at once
    restarts: int  # gangless: jobs restarted after start_timeout
    wait_mean: float
    wait_p95: float
    wait_by_kind: dict[str, float]  # mean
    wait_p95_by_kind: dict[str, float]
    wait_high_mean: float
    tor_span_mean: float  # multi-node gangs: distinct ToR switches at start
    one_tor_fraction: float
    nvlink_fraction: float  # 2-4 GPU pods with all GPUs in one NVLink group
    evicted_groups: int
    evictions_whole: bool  # every eviction took all of a group's running pods
    backend_bytes: int = 0
    data_seconds_mean: float = 0.0  # mean over pods of the start-to-data time (reading the dataset once)
    warm_fraction: float = 0.0  # bytes read warm / bytes read
    choice_fraction: float = math.nan  # placements with 2+ nodes that could take the pod (before the session)
    warm_node_fraction: float = math.nan  # placements where one of those nodes held the dataset whole
    warm_taken_fraction: float = math.nan  # of the latter, placements on such a node
    warm_busy_fraction: float = math.nan  # placements where the nodes holding the dataset were all too full
    session_seconds: float = 0.0


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, int] = OrderedDict()

    def held(self, key: str) -> int:
        return self.items.get(key, 0)

    def touch(self, key: str, size: int) -> None:
        self.items.pop(key, None)
        size = min(size, self.capacity)
        while self.items and sum(self.items.values()) + size > self.capacity:
            self.items.popitem(last=False)
        self.items[key] = size


@dataclass
class _Queued:
    """A gang-less pod in kube-scheduler's queue."""

    order: int  # its timestamp's rank: creation, refreshed at every failed attempt
    ready: float  # end of its backoff
    attempts: int = 0
    parked: bool = False  # in the unschedulable pool: waits for a pod to leave the cluster


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Simulation:
    def __init__(
        self,
        nodes: list[Node],
        jobs: list[Job],
        mode: str,
        weights: Weights | None,
        tick: float,
        horizon: float | None,
        cache_bytes: int,
        queues: list[Queue] | None,
        start_timeout: float | None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.nodes = nodes
        self.node_by_name = {n.name: n for n in nodes}
        self.mode = mode
        self.weights = weights
        self.tick = tick
        self.end = horizon if horizon is not None else math.inf
        self.queues = queues or [Queue("default")]
        self.start_timeout = start_timeout
        self.jobs = {j.name: j for j in jobs}
        self.arrivals = sorted(jobs, key=lambda j: (j.arrival, j.name))
        self.groups = {j.name: j.group() for j in jobs}
        # gang-less: each pod its own group of one
        self.solo_pods = {name: [replace(p, group=p.name) for p in g.pods] for name, g in self.groups.items()}
        self.job_of = {p.name: name for name, pods in self.solo_pods.items() for p in pods}
        self.solo_pod = {p.name: p for pods in self.solo_pods.values() for p in pods}
        self.caches = {n.name: _Lru(cache_bytes) for n in nodes} if cache_bytes else {}
        self.sizes = {j.dataset: j.size for j in jobs if j.dataset}
        self.window = max((j.arrival for j in jobs), default=0.0)  # utilisation is measured while jobs arrive
        self.capacity = sum(len(n.gpus) for n in nodes) * MILLI
        self.tor_of = {n.name: n.tor for n in nodes}
        self.link_of = {n.name: {g.index: g.nvlink_group for g in n.gpus} for n in nodes}

        self.t = 0.0
        self.next_arrival = 0
        self.placed: dict[str, list[Placement]] = {}  # job -> its placed pods (a running job's, or partial)
        self.running: set[str] = set()
        self.first_start: dict[str, float] = {}
        self.generation: dict[str, int] = {}  # job -> its current run, to drop stale finish events
        self.finishes: list[tuple[float, str, int]] = []
        self.waiting: set[str] = set()  # gang: jobs waiting
        self.dirty = False  # gang: something changed since the last session
        self.queued: dict[str, _Queued] = {}  # gangless: pods waiting
        self.held_since: dict[str, float] = {}  # gangless: partial gang -> when its first pod was placed
        self.seq = itertools.count()

        self.used_ms = self.held_ms = self.partial_ms = 0.0
        self.partial_peak = 0.0
        self.overlap = 0.0
        self.restarts = 0
        self.tor_spans: list[int] = []
        self.nvlink_counted: set[str] = set()
        self.nvlink_ok = 0
        self.evicted_groups = 0
        self.whole = True
        self.sessions = 0
        self.session_seconds = 0.0
        self.backend = self.read_total = self.read_warm = 0
        self.data_seconds: list[float] = []
        # placements with data: all, with a choice, a warm node fits, taken warm, warm nodes all full
        self.choices = [0, 0, 0, 0, 0]

    # --- time ------------------------------------------------------------------------------------------

    def _tick_at(self, when: float) -> float:
        return math.ceil(when / self.tick - _EPS) * self.tick

    def _on_tick(self) -> bool:
        return abs(self.t / self.tick - round(self.t / self.tick)) < _EPS

    def _next_time(self) -> float:
        times = [math.inf]
        if self.next_arrival < len(self.arrivals):
            times.append(self.arrivals[self.next_arrival].arrival)
        while self.finishes and self.finishes[0][2] != self.generation.get(self.finishes[0][1]):
            heapq.heappop(self.finishes)  # a run that was evicted or restarted
        if self.finishes:
            times.append(self.finishes[0][0])
        if self.mode == "gang":
            if self.dirty and self.waiting:
                times.append(self._tick_at(self.t))
        else:
            if self.start_timeout is not None and self.held_since:
                times.append(min(self.held_since.values()) + self.start_timeout)
            ready = [q.ready for q in self.queued.values() if not q.parked]
            if ready:
                times.append(self._tick_at(max(min(ready), self.t)))
        return min(times)

    def _advance(self, to: float) -> None:
        dt = to - self.t
        if dt > 0:
            inside = max(0.0, min(to, self.window) - self.t)
            partial_jobs, partial_milli = 0, 0
            for name, pls in self.placed.items():
                milli = sum(p.pod.gpu_count * p.pod.gpu_milli for p in pls)
                self.held_ms += milli * inside
                if name in self.running:
                    self.used_ms += milli * inside
                else:
                    self.partial_ms += milli * dt
                    partial_jobs += 1
                    partial_milli += milli
            self.partial_peak = max(self.partial_peak, partial_milli / MILLI)
            if partial_jobs >= 2:
                self.overlap += dt
        self.t = to

    # --- events ----------------------------------------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        if self.mode == "gang":
            self.waiting.add(job.name)
            self.dirty = True
        else:
            for pod in self.solo_pods[job.name]:
                self.queued[pod.name] = _Queued(next(self.seq), self.t)

    def _freed(self) -> None:
        """Pods left the cluster: the gang session runs again, parked gang-less pods go back to the queue
        (those still backing off wait for the end of their backoff)."""
        if self.mode == "gang":
            self.dirty = True
        else:
            for q in self.queued.values():
                q.parked = False

    def _release(self, name: str) -> None:
        self.placed.pop(name, None)
        self.running.discard(name)
        self.held_since.pop(name, None)
        self.generation[name] = self.generation.get(name, 0) + 1
        self._freed()

    def _requeue(self, name: str) -> None:
        """A job whose pods were evicted or gave up: all its pods wait again, at the back of the queue."""
        if self.mode == "gang":
            self.waiting.add(name)
        else:
            for pod in self.solo_pods[name]:
                self.queued[pod.name] = _Queued(next(self.seq), self.t)

    def _finish_due(self) -> None:
        while self.finishes and self.finishes[0][0] <= self.t:
            _, name, gen = heapq.heappop(self.finishes)
            if gen == self.generation.get(name):
                self._release(name)

    def _time_out_partial_gangs(self) -> None:
        if self.start_timeout is None:
            return
        for name, since in sorted(self.held_since.items(), key=lambda kv: (kv[1], kv[0])):
            if since + self.start_timeout <= self.t + _EPS:
                self._release(name)
                self._requeue(name)
                self.restarts += 1

    def _start(self, name: str) -> None:
        job = self.jobs[name]
        pls = self.placed[name]
        self.running.add(name)
        self.held_since.pop(name, None)
        self.first_start.setdefault(name, self.t)
        reading = 0.0
        if job.dataset and self.caches:
            for p in pls:
                cache = self.caches[p.node]
                warm = cache.held(job.dataset)
                cold = job.size - warm
                secs = cold / (COLD_MBPS * MB) + warm / (WARM_MBPS * MB)
                self.data_seconds.append(secs)
                reading = max(reading, secs)
                self.backend += cold
                self.read_total += job.size
                self.read_warm += warm
                cache.touch(job.dataset, job.size)
                self.node_by_name[p.node].cached = {
                    d: size / self.sizes[d] for d, size in cache.items.items()
                }
        if job.pods > 1:
            self.tor_spans.append(len({self.tor_of[p.node] for p in pls}))
        gen = self.generation.setdefault(name, 0)
        heapq.heappush(self.finishes, (self.t + job.duration + reading, name, gen))

    # --- sessions --------------------------------------------------------------------------------------

    def _snapshot(self, running: list[Placement]) -> ClusterState | None:
        """What is free before the session (for the locality diagnostics only)."""
        if not self.caches:
            return None
        state = ClusterState(self.nodes)
        for p in running:
            i = state.index[p.node]
            state.assign(i, p.pod, tuple(state.slot_of[i][g] for g in p.gpus))
        return state

    def _count_choice(self, state: ClusterState | None, pl: Placement) -> None:
        if state is None or not pl.pod.datasets:
            return
        data = pl.pod.datasets[0]
        feasible = np.flatnonzero(state.fits(pl.pod))
        holds = np.array([n.cached.get(data, 0.0) >= 1.0 - _EPS for n in state.nodes], dtype=bool)
        warm = bool(holds[feasible].any())
        self.choices[0] += 1
        self.choices[1] += len(feasible) >= 2
        self.choices[2] += warm
        self.choices[3] += warm and holds[state.index[pl.node]]
        self.choices[4] += not warm and bool(holds.any())

    def _count_nvlink(self, pl: Placement) -> None:
        if 2 <= pl.pod.gpu_count <= 4 and pl.pod.name not in self.nvlink_counted:
            self.nvlink_counted.add(pl.pod.name)
            self.nvlink_ok += len({self.link_of[pl.node][g] for g in pl.gpus}) == 1

    def _gang_session(self) -> None:
        self.dirty = False
        running = [p for pls in self.placed.values() for p in pls]
        live = sorted(set(self.placed) | self.waiting)
        state = self._snapshot(running)
        clock = time.perf_counter()
        result = run_session(self.nodes, self.queues, [self.groups[g] for g in live], running, self.weights)
        self.session_seconds += time.perf_counter() - clock
        self.sessions += 1
        for name in sorted({pl.pod.group for pl in result.evictions}):
            evicted = {pl.pod.name for pl in result.evictions if pl.pod.group == name}
            self.whole &= evicted == {pl.pod.name for pl in self.placed.get(name, [])}
            self.evicted_groups += 1
            self._release(name)
            self._requeue(name)
        for pl in result.placements:
            self._count_choice(state, pl)
            self._count_nvlink(pl)
            self.placed.setdefault(pl.pod.group, []).append(pl)
            self.waiting.discard(pl.pod.group)
        for name in sorted({pl.pod.group for pl in result.placements}):
            if name not in self.running and len(self.placed[name]) == self.jobs[name].pods:
                self._start(name)

    def _pod_session(self) -> None:
        active = sorted(
            (q.order, name) for name, q in self.queued.items() if not q.parked and q.ready <= self.t + _EPS
        )
        if not active:
            return
        running = [p for pls in self.placed.values() for p in pls]
        order = {name: float(k) for k, name in active}

        def solo(pod: Pod) -> PodGroup:
            job = self.jobs[self.job_of[pod.name]]
            created = order.get(pod.name, job.arrival)
            return PodGroup(pod.name, "default", [pod], 1, job.priority, created)

        groups = [solo(p.pod) for p in running] + [solo(self.solo_pod[name]) for _, name in active]
        state = self._snapshot(running)
        clock = time.perf_counter()
        result = run_session(self.nodes, self.queues, groups, running, self.weights)
        self.session_seconds += time.perf_counter() - clock
        self.sessions += 1
        placed_now = {pl.pod.name for pl in result.placements}
        for pl in result.placements:
            self._count_choice(state, pl)
            self._count_nvlink(pl)
            job = self.job_of[pl.pod.name]
            del self.queued[pl.pod.name]
            self.placed.setdefault(job, []).append(pl)
            self.held_since.setdefault(job, self.t)
        for _, name in active:  # the pods that did not fit: a fresh timestamp, backoff, parked
            if name not in placed_now:
                q = self.queued[name]
                q.order = next(self.seq)
                q.attempts += 1
                q.ready = self.t + min(BACKOFF_INITIAL * 2.0 ** (q.attempts - 1), BACKOFF_MAX)
                q.parked = True
        for job in sorted({self.job_of[pl.pod.name] for pl in result.placements}):
            if job not in self.running and len(self.placed[job]) == self.jobs[job].pods:
                self._start(job)
        # a preempted pod breaks its job: the whole job restarts
        for job in sorted({self.job_of[pl.pod.name] for pl in result.evictions}):
            self.evicted_groups += 1
            self._release(job)
            self._requeue(job)

    # --- the loop --------------------------------------------------------------------------------------

    def run(self) -> Stats:
        while True:
            now = self._next_time()
            if now == math.inf:
                break  # nothing left, or only jobs that can never be placed
            if now > self.end:
                self._advance(self.end)
                break
            self._advance(now)
            while (
                self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].arrival <= self.t
            ):
                self._arrive(self.arrivals[self.next_arrival])
                self.next_arrival += 1
            self._finish_due()
            if self.mode == "gang":
                if self.dirty and self.waiting and self._on_tick():
                    self._gang_session()
            else:
                self._time_out_partial_gangs()
                if self._on_tick():
                    self._pod_session()
        return self._stats()

    def _stats(self) -> Stats:
        jobs = list(self.jobs.values())
        jobs = [j for j in jobs if j.arrival <= self.t]  # the jobs that arrived within the horizon
        wait = {j.name: self.first_start.get(j.name, self.t) - j.arrival for j in jobs}
        waits = list(wait.values())
        by_kind: dict[str, list[float]] = {}
        for j in jobs:
            by_kind.setdefault(j.kind, []).append(wait[j.name])
        high = [wait[j.name] for j in jobs if j.priority > 0]
        span = self.capacity * max(min(self.window, self.t), _EPS)
        spans = self.tor_spans
        ch = self.choices
        return Stats(
            mode=self.mode,
            jobs=len(jobs),
            started=len(self.first_start),
            never_started=len(jobs) - len(self.first_start),
            sessions=self.sessions,
            horizon=self.t,
            gpu_util=self.used_ms / span,
            gpu_held_util=self.held_ms / span,
            partial_gang_gpu_hours=self.partial_ms / MILLI / 3600.0,
            partial_peak_gpus=self.partial_peak,
            partial_overlap_hours=self.overlap / 3600.0,
            restarts=self.restarts,
            wait_mean=sum(waits) / len(waits) if waits else math.nan,
            wait_p95=_quantile(waits, 0.95),
            wait_by_kind={k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
            wait_p95_by_kind={k: _quantile(v, 0.95) for k, v in sorted(by_kind.items())},
            wait_high_mean=sum(high) / len(high) if high else math.nan,
            tor_span_mean=sum(spans) / len(spans) if spans else math.nan,
            one_tor_fraction=sum(s == 1 for s in spans) / len(spans) if spans else math.nan,
            nvlink_fraction=self.nvlink_ok / len(self.nvlink_counted) if self.nvlink_counted else math.nan,
            evicted_groups=self.evicted_groups,
            evictions_whole=self.whole,
            backend_bytes=self.backend,
            data_seconds_mean=sum(self.data_seconds) / len(self.data_seconds) if self.data_seconds else 0.0,
            warm_fraction=self.read_warm / self.read_total if self.read_total else 0.0,
            choice_fraction=ch[1] / ch[0] if ch[0] else math.nan,
            warm_node_fraction=ch[2] / ch[0] if ch[0] else math.nan,
            warm_taken_fraction=ch[3] / ch[2] if ch[2] else math.nan,
            warm_busy_fraction=ch[4] / ch[0] if ch[0] else math.nan,
            session_seconds=self.session_seconds,
        )


def simulate(
    nodes: list[Node],
    jobs: list[Job],
    mode: str = "gang",
    weights: Weights | None = None,
    tick: float = 1.0,
    horizon: float | None = None,
    cache_bytes: int = 0,
    queues: list[Queue] | None = None,
    start_timeout: float | None = START_TIMEOUT,
) -> Stats:
    """Run ``jobs`` on ``nodes`` under the ``gang`` or ``gangless`` scheduler (see the module's doc) until
    every job ran or ``horizon`` seconds. ``cache_bytes``: each node's dataset cache (0: no reads).
    ``start_timeout`` applies to ``gangless`` only (a gang never holds GPUs partially)."""
    sim = _Simulation(nodes, jobs, mode, weights, tick, horizon, cache_bytes, queues, start_timeout)
    return sim.run()
