"""Synthetic gang and locality simulations of the scheduling core (what the openb trace lacks).

    .venv/bin/python bench/scheduler_gangs.py                                   # about 90 s on 2 cores
    .venv/bin/python bench/scheduler_gangs.py --jobs 300 --seeds 1 --loc-seeds 1  # quick

(a) gangs: 64 nodes x 8 GPUs (2 NVLink groups of 4), 8 nodes per ToR; a Poisson stream of 1-GPU, sharing,
    2-4 GPU, 8-GPU and 2-8 node x 8 GPU gang jobs offering --load of the GPU capacity. The same jobs under
    gang-aware scheduling (run_session, one PodGroup per job) and under a gang-less kube-scheduler (pods
    one at a time in queue order, no reservation, failed pods back off and wait for a pod to leave, partial
    gangs hold their GPUs idle, a partial gang restarts after --timeout seconds; see
    pffs/scheduler/replay/synthetic.py), both over pffs's node scores; on --seeds seeds, then the first seed
    gang-less without the timeout, and gang-aware with 20% high-priority jobs to count gang preemptions
    (each must evict whole groups). Runs stop 12 h after the last arrival.
(b) locality: 16 nodes x 8 GPUs with a --cache-tb LRU dataset cache each; hyper-parameter sweeps (4-12
    trials of 1-4 GPUs, 4 in flight) and training runs (8 GPUs, 2 x 8 GPUs) re-reading 12 datasets of
    100-600 GB (Zipf popularity) at pffs's measured speeds (bench/results/mounts.json: cold from S3
    473 MB/s, warm from the disk cache 1363 MB/s), offering --loc-load; the locality weight swept over
    0, 1, 2, 4 (the other plugins at 1), mean of --loc-seeds seeds.

Writes bench/results/scheduler_gangs.json and .png, prints tables. Exit 1 if a partial gang held GPUs under
gang scheduling or an eviction took part of a group.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from pffs.scheduler.core.session import Weights
from pffs.scheduler.replay.synthetic import (
    COLD_MBPS,
    START_TIMEOUT,
    WARM_MBPS,
    Stats,
    gang_jobs,
    locality_jobs,
    make_cluster,
    simulate,
)

RESULTS = Path(__file__).parent / "results"
LOCALITY_WEIGHTS = (0.0, 1.0, 2.0, 4.0)
KINDS = ("1-gpu", "sharing", "2-gpu", "4-gpu", "8-gpu", "gang")
DRAIN = 12 * 3600.0  # runs stop this long after the last arrival


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def gang_row(label: str, s: Stats) -> str:
    return (
        f"{label:<30} {s.started:>4}/{s.jobs:<4} {100 * s.gpu_util:6.1f} {100 * s.gpu_held_util:6.1f} "
        f"{s.partial_gang_gpu_hours:8.1f} {s.partial_peak_gpus:5.0f} {s.partial_overlap_hours:6.1f} "
        f"{s.restarts:5} {s.wait_mean / 60:7.1f} {s.wait_p95 / 60:7.1f} {s.evicted_groups:5} "
        f"{s.tor_span_mean:5.2f} {100 * s.nvlink_fraction:5.1f}"
    )


GangRuns = tuple[Stats, Stats, Stats, Stats]  # gang-aware, gang-less, gang-less without timeout, priority


def run_gangs(args: argparse.Namespace, failures: list[str]) -> tuple[dict[str, object], GangRuns]:
    gpus = 64 * 8
    per_seed: list[tuple[int, Stats, Stats]] = []
    for seed in range(args.seed, args.seed + args.seeds):
        jobs = gang_jobs(args.jobs, seed, args.load, gpus)
        horizon = max(j.arrival for j in jobs) + DRAIN
        gang = simulate(make_cluster(), jobs, "gang", horizon=horizon)
        gangless = simulate(make_cluster(), jobs, "gangless", horizon=horizon, start_timeout=args.timeout)
        per_seed.append((seed, gang, gangless))
    jobs = gang_jobs(args.jobs, args.seed, args.load, gpus)
    horizon = max(j.arrival for j in jobs) + DRAIN
    no_timeout = simulate(make_cluster(), jobs, "gangless", horizon=horizon, start_timeout=None)
    prio_jobs = gang_jobs(args.jobs, args.seed, args.load, gpus, high_priority=0.2)
    prio = simulate(make_cluster(), prio_jobs, "gang", horizon=max(j.arrival for j in prio_jobs) + DRAIN)
    for s in [g for _, g, _ in per_seed] + [prio]:
        if s.partial_gang_gpu_hours != 0 or s.restarts != 0:
            failures.append(
                f"a partial gang held GPUs under gang scheduling ({s.partial_gang_gpu_hours} GPU-h)"
            )
        if not s.evictions_whole:
            failures.append("an eviction took part of a group")

    _, gang, gangless = per_seed[0]
    print(
        f"(a) gangs: 64 nodes x 8 GPUs, {args.jobs} jobs, offered load {args.load:.0%}, seed {args.seed}, "
        f"gang-less restart after {args.timeout / 60:.0f} min"
    )
    print(
        f"{'':<30} {'started':>9} {'util%':>6} {'held%':>6} {'partGPUh':>8} {'peak':>5} {'2+part':>6} "
        f"{'rstrt':>5} {'wait m':>7} {'p95 m':>7} {'evict':>5} {'ToRs':>5} {'NVL%':>5}"
    )
    print(gang_row("gang-aware (run_session)", gang))
    print(gang_row("gang-less (kube-scheduler)", gangless))
    print(gang_row("gang-less, no timeout", no_timeout))
    print(gang_row("gang-aware, 20% high prio", prio))
    print(
        "    util: GPUs of running jobs while jobs arrive; held: plus GPUs of partial gangs; peak: most GPUs "
        "held by partial gangs at once; 2+part: hours with two or more partial gangs holding GPUs"
    )
    print(
        f"    high-priority mean wait {prio.wait_high_mean / 60:.1f} min; {prio.evicted_groups} groups "
        f"evicted, all whole: {prio.evictions_whole}"
    )
    print(f"    wait per job kind, minutes (mean / p95), seed {args.seed}:")
    print(f"    {'':<12} {'gang-aware':>15} {'gang-less':>15} {'gang-less, no timeout':>22}")
    for kind in KINDS:
        cells = [
            f"{s.wait_by_kind[kind] / 60:6.1f} / {s.wait_p95_by_kind[kind] / 60:6.1f}"
            if kind in s.wait_by_kind
            else "-"
            for s in (gang, gangless, no_timeout)
        ]
        print(f"    {kind:<12} {cells[0]:>15} {cells[1]:>15} {cells[2]:>22}")
    if len(per_seed) > 1:
        print(f"    over seeds {args.seed}-{args.seed + args.seeds - 1} (gang-aware | gang-less):")
        for seed, g, k in per_seed:
            print(
                f"    seed {seed}: util {100 * g.gpu_util:5.1f} | {100 * k.gpu_util:5.1f}   "
                f"wait {g.wait_mean / 60:5.1f} | {k.wait_mean / 60:5.1f}   "
                f"p95 {g.wait_p95 / 60:6.1f} | {k.wait_p95 / 60:6.1f}   "
                f"gangs {g.wait_by_kind['gang'] / 60:5.1f} | {k.wait_by_kind['gang'] / 60:5.1f}   "
                f"partial GPU-h 0 | {k.partial_gang_gpu_hours:5.1f}   restarts {k.restarts}   "
                f"never started {g.never_started} | {k.never_started}"
            )
    result: dict[str, object] = {
        "per_seed": [{"seed": n, "gang": asdict(g), "gangless": asdict(k)} for n, g, k in per_seed],
        "gangless_no_timeout": asdict(no_timeout),
        "gang_priority": asdict(prio),
    }
    return result, (gang, gangless, no_timeout, prio)


def run_locality(
    args: argparse.Namespace, failures: list[str]
) -> tuple[dict[str, object], list[dict[str, float]], dict[str, list[float]]]:
    nodes, cache = 16, int(args.cache_tb * 1e12)
    runs: dict[float, list[Stats]] = {w: [] for w in LOCALITY_WEIGHTS}
    for seed in range(args.seed, args.seed + args.loc_seeds):
        jobs = locality_jobs(args.loc_jobs, seed, args.loc_load, nodes * 8)
        for w in LOCALITY_WEIGHTS:
            s = simulate(make_cluster(nodes), jobs, "gang", Weights(locality=w), cache_bytes=cache)
            runs[w].append(s)
            if s.partial_gang_gpu_hours != 0 or not s.evictions_whole:
                failures.append(
                    f"locality run (weight {w}, seed {seed}): a partial gang or a partial eviction"
                )
    off = runs[0.0]

    def avg(w: float, f: Callable[[Stats], float]) -> float:
        return mean([f(s) for s in runs[w]])

    print(
        f"(b) locality: {nodes} nodes x 8 GPUs, {args.cache_tb:g} TB cache per node, {args.loc_jobs} jobs "
        f"(sweeps and training runs over 12 datasets of 100-600 GB), offered load {args.loc_load:.0%}, "
        f"mean of seeds {args.seed}-{args.seed + args.loc_seeds - 1}"
    )
    print(
        "    read speeds (pffs's own, bench/results/mounts.json): "
        f"cold {COLD_MBPS} MB/s, warm {WARM_MBPS} MB/s"
    )
    print(
        f"    {'weight':>6} {'backend TB':>10} {'vs 0':>6} {'warm %':>7} {'to-data s':>9} {'wait m':>7} "
        f"{'p95 m':>6} {'8-GPU m':>7} {'util%':>6} {'NVL%':>5} {'choice%':>7} {'warmOK%':>7} "
        f"{'taken%':>6} {'busy%':>6}"
    )
    table: list[dict[str, float]] = []
    per_seed: dict[str, list[float]] = {}
    for w in LOCALITY_WEIGHTS:
        ratio = mean([s.backend_bytes / o.backend_bytes for s, o in zip(runs[w], off, strict=True)])
        row = {
            "weight": w,
            "backend_tb": avg(w, lambda s: s.backend_bytes / 1e12),
            "backend_vs_off": ratio - 1.0,
            "warm_fraction": avg(w, lambda s: s.warm_fraction),
            "data_seconds_mean": avg(w, lambda s: s.data_seconds_mean),
            "wait_mean": avg(w, lambda s: s.wait_mean),
            "wait_p95": avg(w, lambda s: s.wait_p95),
            "wait_8gpu": avg(w, lambda s: s.wait_by_kind.get("8-gpu", math.nan)),
            "gpu_util": avg(w, lambda s: s.gpu_util),
            "nvlink_fraction": avg(w, lambda s: s.nvlink_fraction),
            "choice_fraction": avg(w, lambda s: s.choice_fraction),
            "warm_node_fraction": avg(w, lambda s: s.warm_node_fraction),
            "warm_taken_fraction": avg(w, lambda s: s.warm_taken_fraction),
            "warm_busy_fraction": avg(w, lambda s: s.warm_busy_fraction),
        }
        table.append(row)
        per_seed[f"{w:g}"] = [s.backend_bytes / 1e12 for s in runs[w]]
        print(
            f"    {w:6g} {row['backend_tb']:10.2f} {100 * row['backend_vs_off']:+5.0f}% "
            f"{100 * row['warm_fraction']:7.1f} {row['data_seconds_mean']:9.0f} {row['wait_mean'] / 60:7.1f} "
            f"{row['wait_p95'] / 60:6.1f} {row['wait_8gpu'] / 60:7.1f} {100 * row['gpu_util']:6.1f} "
            f"{100 * row['nvlink_fraction']:5.1f} {100 * row['choice_fraction']:7.0f} "
            f"{100 * row['warm_node_fraction']:7.0f} {100 * row['warm_taken_fraction']:6.0f} "
            f"{100 * row['warm_busy_fraction']:6.0f}"
        )
    print(
        "    vs 0: backend bytes against weight 0, mean of per-seed ratios; to-data: mean start-to-data "
        "(reading the dataset once); choice: placements with 2+ nodes that could take the pod; warmOK: a "
        "node holding the dataset could take it; taken: of those, placed on such a node; busy: the "
        "dataset was warm only on nodes too full to take the pod"
    )
    result: dict[str, object] = {
        "nodes": nodes,
        "cache_bytes": cache,
        "weights": table,
        "backend_tb_per_seed": per_seed,
        "runs": {f"{w:g}": [asdict(s) for s in ss] for w, ss in runs.items()},
    }
    return result, table, per_seed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=900)
    parser.add_argument("--load", type=float, default=1.0, help="offered GPU load (1.0 = capacity)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3, help="gang comparison: seeds from --seed")
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT, help="gang-less restart (s)")
    parser.add_argument("--loc-jobs", type=int, default=600)
    parser.add_argument("--loc-load", type=float, default=0.7)
    parser.add_argument("--loc-seeds", type=int, default=5)
    parser.add_argument("--cache-tb", type=float, default=1.5, help="dataset cache per node (TB)")
    args = parser.parse_args()

    failures: list[str] = []
    began = time.perf_counter()
    gangs, gang_runs = run_gangs(args, failures)
    locality, table, per_seed = run_locality(args, failures)
    elapsed = time.perf_counter() - began
    print(f"total {elapsed:.0f} s")
    for f in failures:
        print("FAILED:", f)

    RESULTS.mkdir(exist_ok=True)
    plot(gang_runs, table, per_seed, args)
    result = {
        "command": "python bench/scheduler_gangs.py " + " ".join(sys.argv[1:]),
        "machine": platform.platform(),
        "args": vars(args),
        "read_speeds_mbps": {"cold": COLD_MBPS, "warm": WARM_MBPS, "source": "bench/results/mounts.json"},
        "gangs": gangs,
        "locality": locality,
        "elapsed_seconds": elapsed,
        "failures": failures,
    }
    (RESULTS / "scheduler_gangs.json").write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failures else 0


def plot(
    gang_runs: GangRuns,
    table: list[dict[str, float]],
    per_seed: dict[str, list[float]],
    args: argparse.Namespace,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gang, gangless, no_timeout, _ = gang_runs
    fig, ax = plt.subplots(2, 3, figsize=(17, 8.5))
    labels = ["gang-aware", "gang-less", "gang-less\nno timeout"]
    runs = [gang, gangless, no_timeout]
    a = ax[0][0]
    a.bar(labels, [100 * s.gpu_util for s in runs], color=["C0", "C1", "C4"], label="running jobs")
    a.bar(
        labels,
        [100 * (s.gpu_held_util - s.gpu_util) for s in runs],
        bottom=[100 * s.gpu_util for s in runs],
        color="C3",
        label="held idle by partial gangs",
    )
    a.set_ylim(50, 105)
    a.set_title(f"GPU utilisation (%), load {args.load:.0%}, seed {args.seed}")
    a.legend(loc="upper center", ncol=2, fontsize="small")
    a = ax[0][1]
    width = 0.27
    for k, (s, label) in enumerate(
        zip(runs, ["gang-aware", "gang-less", "gang-less, no timeout"], strict=True)
    ):
        a.bar(
            [i + (k - 1) * width for i in range(len(KINDS))],
            [s.wait_by_kind.get(kind, 0.0) / 60 for kind in KINDS],
            width,
            label=label,
            color=["C0", "C1", "C4"][k],
        )
    a.set_xticks(range(len(KINDS)), KINDS)
    a.set_title("mean wait per job kind (minutes)")
    a.legend()
    a = ax[0][2]
    a.bar(labels, [s.partial_gang_gpu_hours for s in runs], color=["C0", "C1", "C4"])
    for i, s in enumerate(runs):
        a.annotate(f"{s.restarts} restarts", (i, s.partial_gang_gpu_hours), ha="center", va="bottom")
    a.set_title("GPU-hours held idle by partial gangs")
    weights = [row["weight"] for row in table]
    x = range(len(weights))
    names = [f"{w:g}" for w in weights]
    a = ax[1][0]
    a.bar(x, [row["backend_tb"] for row in table], color=["C7", "C2", "C2", "C2"], label="mean")
    for i, name in enumerate(names):
        seeds = per_seed[name]
        a.plot([i] * len(seeds), seeds, "k.", label="one seed" if i == 0 else None)
    a.set_xticks(list(x), names)
    a.set_xlabel("locality weight")
    a.set_title(f"bytes from the backend (TB), {args.loc_seeds} seeds")
    a.legend()
    a = ax[1][1]
    a.bar(x, [row["data_seconds_mean"] for row in table], color=["C7", "C2", "C2", "C2"])
    a.set_xticks(list(x), names)
    a.set_xlabel("locality weight")
    a.set_title(
        "start-to-data (s); warm fraction " + ", ".join(f"{100 * row['warm_fraction']:.0f}%" for row in table)
    )
    a = ax[1][2]
    a.plot(names, [row["wait_mean"] / 60 for row in table], "o-", label="mean")
    a.plot(names, [row["wait_p95"] / 60 for row in table], "s-", label="p95")
    a.plot(names, [row["wait_8gpu"] / 60 for row in table], "^-", label="8-GPU jobs, mean")
    a.set_xlabel("locality weight")
    a.set_ylim(bottom=0)
    a.set_title("locality runs: job wait (minutes)")
    a.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "scheduler_gangs.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
