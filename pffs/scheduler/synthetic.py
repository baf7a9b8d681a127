"""Synthetic simulations of what the openb trace lacks: gangs (with ToR and NVLink needs) and cache locality.

A discrete-event simulation drives ``run_session``: jobs arrive, the scheduler runs a session at every
scheduling tick where something changed, placed jobs run for their duration and free their pods. Two ways
to schedule the same jobs:

- ``gang``: one ``PodGroup`` per job with ``min_member`` = its pods (run_session's gang allocation);
- ``gangless``: every pod its own group of one, placed as soon as it fits: a job starts when its last pod
  is placed, and until then its placed pods hold their GPUs doing nothing (a partial gang).

The locality simulation gives every node an LRU cache of datasets (bytes-bounded); a job's pods read the
job's dataset once at start: what the node holds at the warm speed, the rest from the backend at the cold
speed, then the node holds it all. The speeds are pffs's own measured figures (bench/results/mounts.json:
1 GiB read through the pffs mount, cold from S3 473 MB/s, warm from the disk cache after a remount
1363 MB/s).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from pffs.scheduler.objects import MILLI, Gpu, Node, Placement, Pod, PodGroup, Queue
from pffs.scheduler.session import Weights, run_session

COLD_MBPS = 473.0  # pffs mount, 1 GiB, cold from S3 (bench/results/mounts.json)
WARM_MBPS = 1363.0  # pffs mount, 1 GiB, warm from the disk cache after a remount (same file)
MB = 1_000_000


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


@dataclass
class Stats:
    """What one simulation measured."""

    mode: str
    jobs: int
    started: int
    sessions: int
    horizon: float
    gpu_util: float  # GPU milli-seconds of started jobs / capacity, while jobs arrive (0 .. last arrival)
    gpu_held_util: float  # the same counting every placed pod (partial gangs too)
    partial_gang_gpu_hours: float
    wait_mean: float
    wait_p95: float
    wait_by_kind: dict[str, float]
    wait_high_mean: float
    tor_span_mean: float  # multi-node gangs: distinct ToR switches at start
    one_tor_fraction: float
    nvlink_fraction: float  # 2-4 GPU pods with all GPUs in one NVLink group
    evicted_groups: int
    evictions_whole: bool  # every eviction took all of a group's running pods
    backend_bytes: int = 0
    data_seconds_mean: float = 0.0  # mean over pods of the start-to-data time (reading the dataset once)
    warm_fraction: float = 0.0  # bytes read warm / bytes read
    session_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


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


def simulate(
    nodes: list[Node],
    jobs: list[Job],
    mode: str = "gang",
    weights: Weights | None = None,
    tick: float = 30.0,
    horizon: float | None = None,
    cache_bytes: int = 0,
    queues: list[Queue] | None = None,
) -> Stats:
    """Run ``jobs`` on ``nodes``; sessions at multiples of ``tick`` seconds where something changed."""
    import time

    queues = queues or [Queue("default")]
    capacity = sum(len(n.gpus) for n in nodes) * MILLI
    tor_of = {n.name: n.tor for n in nodes}
    link_of = {n.name: {g.index: g.nvlink_group for g in n.gpus} for n in nodes}
    by_name = {j.name: j for j in jobs}
    groups: dict[str, PodGroup] = {}
    for j in jobs:
        g = j.group()
        if mode == "gang":
            groups[j.name] = g
        else:
            for p in g.pods:
                groups[p.name] = PodGroup(
                    p.name, g.queue, [replace(p, group=p.name)], 1, g.priority, g.created
                )
    owner = {name: name if mode == "gang" else name.rsplit("-", 1)[0] for name in groups}
    groups_of: dict[str, list[str]] = {}
    for name, job_name in owner.items():
        groups_of.setdefault(job_name, []).append(name)
    caches = {n.name: _Lru(cache_bytes) for n in nodes} if cache_bytes else {}

    arrivals = sorted(jobs, key=lambda j: j.arrival)
    next_arrival = 0
    pending: set[str] = set()  # group names waiting (some of a gang-less job's pods may be placed)
    placed: dict[str, list[Placement]] = {}  # job -> its placed pods
    started: dict[str, float] = {}
    first_start: dict[str, float] = {}
    finishes: list[tuple[float, str]] = []
    t = 0.0
    used_ms = held_ms = partial_ms = 0.0
    tor_spans: list[int] = []
    nvlink_ok = nvlink_all = 0
    evicted_groups = 0
    whole = True
    sessions = 0
    session_seconds = 0.0
    backend = read_total = read_warm = 0
    data_seconds: list[float] = []
    end = horizon if horizon is not None else math.inf
    dirty = False

    window = max((j.arrival for j in jobs), default=0.0)  # utilization is measured while jobs arrive

    def advance(to: float) -> None:
        nonlocal t, used_ms, held_ms, partial_ms
        dt = to - t
        inside = max(0.0, min(to, window) - t)
        if dt > 0:
            for name, pls in placed.items():
                milli = sum(p.pod.gpu_count * p.pod.gpu_milli for p in pls)
                held_ms += milli * inside
                if name in started:
                    used_ms += milli * inside
                else:
                    partial_ms += milli * dt
        t = to

    def start(name: str) -> None:
        nonlocal backend, read_total, read_warm
        job = by_name[name]
        pls = placed[name]
        started[name] = t
        first_start.setdefault(name, t)
        extra = 0.0
        if job.dataset and caches:
            for p in pls:
                warm = caches[p.node].held(job.dataset)
                cold = job.size - warm
                secs = cold / (COLD_MBPS * MB) + warm / (WARM_MBPS * MB)
                data_seconds.append(secs)
                extra = max(extra, secs)
                backend += cold
                read_total += job.size
                read_warm += warm
                caches[p.node].touch(job.dataset, job.size)
                node = next(n for n in nodes if n.name == p.node)
                node.cached = {d: size / by_name_size[d] for d, size in caches[p.node].items.items()}
        if job.pods > 1:
            tor_spans.append(len({tor_of[p.node] for p in pls}))
        heapq.heappush(finishes, (t + job.duration + extra, name))

    by_name_size = {j.dataset: j.size for j in jobs if j.dataset}
    nvlink_counted: set[str] = set()
    while next_arrival < len(arrivals) or finishes or pending:
        candidates = []
        if next_arrival < len(arrivals):
            candidates.append(arrivals[next_arrival].arrival)
        if finishes:
            candidates.append(finishes[0][0])
        if dirty and pending:
            candidates.append((math.floor(t / tick) + 1) * tick)
        if not candidates:
            break  # only jobs that can never be placed are left
        now = min(candidates)
        if now > end:
            break
        advance(now)
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival <= t:
            job = arrivals[next_arrival]
            next_arrival += 1
            pending.update(groups_of[job.name])
            dirty = True
        while finishes and finishes[0][0] <= t:
            _, name = heapq.heappop(finishes)
            if name in started:
                del placed[name]
                del started[name]
                dirty = True
        if not dirty or not pending or abs(t / tick - round(t / tick)) > 1e-9:
            continue  # sessions only on tick boundaries, and only when something changed
        dirty = False
        running = [p for pls in placed.values() for p in pls]
        live = {p.pod.group for p in running} | pending
        clock = time.perf_counter()
        result = run_session(nodes, queues, [groups[g] for g in sorted(live)], running, weights)
        session_seconds += time.perf_counter() - clock
        sessions += 1
        if result.evictions:
            gone_groups = {pl.pod.group for pl in result.evictions}
            evicted_groups += len(gone_groups)
            for gname in gone_groups:
                jname = owner[gname]
                evicted_names = {pl.pod.name for pl in result.evictions if pl.pod.group == gname}
                held = {pl.pod.name for pl in placed.get(jname, []) if pl.pod.group == gname}
                whole &= evicted_names == held
                placed[jname] = [pl for pl in placed[jname] if pl.pod.name not in evicted_names]
                if not placed[jname]:
                    del placed[jname]
                started.pop(jname, None)
                finishes[:] = [(ft, n) for ft, n in finishes if n != jname]
                heapq.heapify(finishes)
                pending.add(gname)
            dirty = True
        for pl in result.placements:
            jname = owner[pl.pod.group]
            placed.setdefault(jname, []).append(pl)
            pending.discard(pl.pod.group)
            dirty = True
            if 2 <= by_name[jname].gpus <= 4 and pl.pod.name not in nvlink_counted:
                nvlink_counted.add(pl.pod.name)
                nvlink_all += 1
                nvlink_ok += len({link_of[pl.node][g] for g in pl.gpus}) == 1
        for jname in sorted({owner[pl.pod.group] for pl in result.placements}):
            if jname not in started and len(placed[jname]) == by_name[jname].pods:
                start(jname)
    horizon_used = t
    waits = sorted(first_start[j.name] - j.arrival for j in jobs if j.name in first_start)
    never = [j for j in jobs if j.name not in first_start]
    by_kind: dict[str, list[float]] = {}
    for j in jobs:
        if j.name in first_start:
            by_kind.setdefault(j.kind, []).append(first_start[j.name] - j.arrival)
    high = [first_start[j.name] - j.arrival for j in jobs if j.priority > 0 and j.name in first_start]
    span = capacity * max(min(window, horizon_used), 1e-9)
    return Stats(
        mode=mode,
        jobs=len(jobs),
        started=len(first_start),
        sessions=sessions,
        horizon=horizon_used,
        gpu_util=used_ms / span,
        gpu_held_util=held_ms / span,
        partial_gang_gpu_hours=partial_ms / MILLI / 3600.0,
        wait_mean=sum(waits) / len(waits) if waits else math.nan,
        wait_p95=waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else math.nan,
        wait_by_kind={k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        wait_high_mean=sum(high) / len(high) if high else math.nan,
        tor_span_mean=sum(tor_spans) / len(tor_spans) if tor_spans else math.nan,
        one_tor_fraction=sum(s == 1 for s in tor_spans) / len(tor_spans) if tor_spans else math.nan,
        nvlink_fraction=nvlink_ok / nvlink_all if nvlink_all else math.nan,
        evicted_groups=evicted_groups,
        evictions_whole=whole,
        backend_bytes=backend,
        data_seconds_mean=sum(data_seconds) / len(data_seconds) if data_seconds else 0.0,
        warm_fraction=read_warm / read_total if read_total else 0.0,
        session_seconds=session_seconds,
        extra={"never_started": float(len(never))},
    )


def locality_jobs(count: int, seed: int, load: float, gpus_total: int, datasets: int = 24) -> list[Job]:
    """Single-node jobs of 1-8 GPUs and 2-node gangs, each reading one of ``datasets`` datasets (Zipf
    popularity, 20-400 GB), arriving to offer ``load`` times the GPU capacity."""
    rng = random.Random(seed)
    sizes = [int(rng.uniform(20, 400) * 1e9) for _ in range(datasets)]
    popularity = [1.0 / (k + 1) for k in range(datasets)]
    jobs = []
    for i in range(count):
        d = rng.choices(range(datasets), popularity)[0]
        pods, gpus = rng.choice([(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)])
        duration = rng.lognormvariate(math.log(1800), 0.5)
        jobs.append(
            Job(f"j{i:04d}", 0.0, duration, pods, gpus, dataset=f"s3://data/ds{d:02d}", size=sizes[d])
        )
    mean_work = sum(j.duration * j.pods * j.gpus for j in jobs) / len(jobs)
    rate = load * gpus_total / mean_work
    t = 0.0
    for j in jobs:
        t += rng.expovariate(rate)
        j.arrival = t
    return jobs
