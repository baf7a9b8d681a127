"""Synthetic gang and locality simulations of the scheduling core (what the openb trace lacks).

    .venv/bin/python bench/scheduler_gangs.py            # about a minute on 2 cores
    .venv/bin/python bench/scheduler_gangs.py --jobs 300 # quick

(a) gangs: 64 nodes x 8 GPUs (2 NVLink groups of 4), 8 nodes per ToR; a Poisson stream of 1-GPU, sharing,
    2-4 GPU, 8-GPU and 2-8 node x 8 GPU gang jobs. Gang-aware scheduling (run_session, one PodGroup per job)
    against gang-less placement (each pod on its own, as soon as it fits) on the same jobs; then gang-aware
    with 20% high-priority jobs, to count gang preemptions (each must evict whole groups).
(b) locality: 16 nodes x 8 GPUs with a 2 TB LRU dataset cache each; jobs read one of 24 datasets (20-400 GB,
    Zipf popularity) at pffs's measured speeds (bench/results/mounts.json: cold from S3 473 MB/s, warm from
    the disk cache 1363 MB/s); locality weight 1 against 0.

Writes bench/results/scheduler_gangs.json and .png, prints a table. Exit 1 if a partial gang held GPUs under
gang scheduling or an eviction took part of a group.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pffs.scheduler.session import Weights
from pffs.scheduler.synthetic import (
    COLD_MBPS,
    WARM_MBPS,
    Stats,
    gang_jobs,
    locality_jobs,
    make_cluster,
    simulate,
)

RESULTS = Path(__file__).parent / "results"


def row(label: str, s: Stats) -> str:
    return (
        f"{label:<26} {s.started:>5}/{s.jobs:<5} {100 * s.gpu_util:6.1f} {100 * s.gpu_held_util:6.1f} "
        f"{s.wait_mean / 60:7.1f} {s.wait_p95 / 60:7.1f} "
        f"{s.wait_by_kind.get('gang', float('nan')) / 60:7.1f} "
        f"{s.partial_gang_gpu_hours:8.1f} {s.tor_span_mean:5.2f} {100 * s.one_tor_fraction:5.1f} "
        f"{100 * s.nvlink_fraction:6.1f} {s.evicted_groups:5}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=900)
    parser.add_argument("--load", type=float, default=1.0, help="offered GPU load (1.0 = capacity)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    failures = []
    began = time.perf_counter()
    nodes = make_cluster()
    gpus = sum(len(n.gpus) for n in nodes)
    jobs = gang_jobs(args.jobs, args.seed, args.load, gpus)
    gang = simulate(make_cluster(), jobs, "gang")
    gangless = simulate(make_cluster(), jobs, "gangless")
    prio_jobs = gang_jobs(args.jobs, args.seed, args.load, gpus, high_priority=0.2)
    prio = simulate(make_cluster(), prio_jobs, "gang")
    if gang.partial_gang_gpu_hours != 0 or prio.partial_gang_gpu_hours != 0:
        failures.append("a partial gang held GPUs under gang scheduling")
    if not prio.evictions_whole:
        failures.append("an eviction took part of a group")

    loc_nodes = 16
    loc_jobs = locality_jobs(args.jobs // 2, args.seed, 0.9, loc_nodes * 8)
    cache = 2_000_000_000_000
    warm = simulate(make_cluster(loc_nodes), loc_jobs, "gang", Weights(), cache_bytes=cache)
    cold = simulate(make_cluster(loc_nodes), loc_jobs, "gang", Weights(locality=0.0), cache_bytes=cache)
    elapsed = time.perf_counter() - began

    print(f"(a) gangs: 64 nodes x 8 GPUs, {args.jobs} jobs, offered load {args.load:.0%}, seed {args.seed}")
    print(
        f"{'':<26} {'started':>11} {'util%':>6} {'held%':>6} {'wait m':>7} {'p95 m':>7} {'gang m':>7} "
        f"{'partGPUh':>8} {'ToRs':>5} {'1ToR%':>5} {'NVL%':>6} {'evict':>5}"
    )
    print(row("gang-aware (run_session)", gang))
    print(row("gang-less (pod by pod)", gangless))
    print(row("gang-aware, 20% high prio", prio))
    print(
        f"    high-priority mean wait {prio.wait_high_mean / 60:.1f} min; "
        f"{prio.evicted_groups} groups evicted, "
        f"all whole: {prio.evictions_whole}"
    )
    print(f"(b) locality: {loc_nodes} nodes x 8 GPUs, {len(loc_jobs)} jobs, 2 TB cache per node")
    print(
        "    read speeds (pffs's own, bench/results/mounts.json): "
        f"cold {COLD_MBPS} MB/s, warm {WARM_MBPS} MB/s"
    )
    print(f"{'':<16} {'backend TB':>10} {'warm %':>7} {'start-to-data s':>16} {'wait m':>7} {'util%':>6}")
    for label, s in (("locality on", warm), ("locality off", cold)):
        print(
            f"{label:<16} {s.backend_bytes / 1e12:10.2f} {100 * s.warm_fraction:7.1f} "
            f"{s.data_seconds_mean:16.1f} "
            f"{s.wait_mean / 60:7.1f} {100 * s.gpu_util:6.1f}"
        )
    print(
        f"total {elapsed:.0f} s; session time gang-aware {gang.session_seconds:.1f} s "
        f"over {gang.sessions} sessions"
    )
    for f in failures:
        print("FAILED:", f)

    result = {
        "machine": platform.platform(),
        "args": vars(args),
        "read_speeds_mbps": {"cold": COLD_MBPS, "warm": WARM_MBPS, "source": "bench/results/mounts.json"},
        "gangs": {"gang": asdict(gang), "gangless": asdict(gangless), "gang_priority": asdict(prio)},
        "locality": {"on": asdict(warm), "off": asdict(cold)},
        "elapsed_seconds": elapsed,
        "failures": failures,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler_gangs.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(gang, gangless, prio, warm, cold)
    return 1 if failures else 0


def plot(gang: Stats, gangless: Stats, prio: Stats, warm: Stats, cold: Stats) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(16, 4))
    labels = ["gang-aware", "gang-less"]
    ax[0].bar(labels, [100 * gang.gpu_util, 100 * gangless.gpu_util], color=["C0", "C1"])
    ax[0].bar(
        labels,
        [0, 100 * (gangless.gpu_held_util - gangless.gpu_util)],
        bottom=[0, 100 * gangless.gpu_util],
        color="C3",
        label="held by partial gangs",
    )
    ax[0].set_title("GPU utilization (%)")
    ax[0].legend(loc="lower right")
    x = range(3)
    width = 0.35
    ax[1].bar(
        [i - width / 2 for i in x],
        [gang.wait_mean / 60, gang.wait_p95 / 60, gang.wait_by_kind.get("gang", 0) / 60],
        width,
        label="gang-aware",
    )
    ax[1].bar(
        [i + width / 2 for i in x],
        [gangless.wait_mean / 60, gangless.wait_p95 / 60, gangless.wait_by_kind.get("gang", 0) / 60],
        width,
        label="gang-less",
    )
    ax[1].set_xticks(list(x), ["mean", "p95", "gangs' mean"])
    ax[1].set_title("job wait (minutes)")
    ax[1].legend()
    ax[2].bar(
        ["gang-aware", "gang-less"],
        [gang.partial_gang_gpu_hours, gangless.partial_gang_gpu_hours],
        color=["C0", "C1"],
    )
    ax[2].set_title(f"GPU-hours held by partial gangs\n(gang preemption: {prio.evicted_groups} whole groups)")
    ax[3].bar(
        ["locality on", "locality off"],
        [warm.backend_bytes / 1e12, cold.backend_bytes / 1e12],
        color=["C2", "C7"],
    )
    ax[3].set_title(
        "bytes from the backend (TB)\n"
        f"start-to-data {warm.data_seconds_mean:.0f} s vs {cold.data_seconds_mean:.0f} s"
    )
    fig.tight_layout()
    fig.savefig(RESULTS / "scheduler_gangs.png", dpi=110)


if __name__ == "__main__":
    sys.exit(main())
