"""`pffs sched simulate`: replay a GPU-cluster trace with a placement policy (the FGD paper's protocol)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

SIMULATE_HELP = """\
Replays an Alibaba openb GPU trace (cluster-trace-gpu-v2023) the way the FGD paper's simulator does, so the
figures compare with the published ones: the pods are shuffled with the seed, resampled until they ask for
130% of the cluster's GPUs, and placed one by one, never leaving; a pod that fits nowhere fails. Reported:
the GPU allocation ratio (allocated GPU milli / capacity) when the arrived demand is at 100% and 130% of
capacity, pods placed and failed, and pods placed per second. Several --seed options give each seed and
their mean (the paper's figures are means over seeds 42-51).

policies: random, best-fit, dot-product, gpu-packing, fgd (the paper's), pffs (pffs's default: FGD's
expected-fragmentation idea, measured as the GPUs a node strands when filled with the typical pods)."""


def add_parsers(sub: Any, verbosity: argparse.ArgumentParser) -> None:
    from pffs.scheduler.replay import POLICY_NAMES

    # No cache or backend options here: a replay touches neither.
    sched = sub.add_parser(
        "sched",
        help="scheduler tools: replay a GPU-cluster trace (sched simulate)",
        description="Scheduler tools that run offline, without a cluster.",
    )
    sched_sub = sched.add_subparsers(dest="sched_command", metavar="COMMAND", required=True)
    p = sched_sub.add_parser(
        "simulate",
        parents=[verbosity],
        help="replay a GPU trace with a placement policy",
        description=SIMULATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example:\n  pffs sched simulate --nodes ../shared/data/openb/openb_node_list_gpu_node.csv \\\n"
            "      --pods ../shared/data/openb/openb_pod_list_default.csv --policy pffs --seed 42 --seed 43"
        ),
    )
    p.add_argument("--nodes", required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument(
        "--pods", required=True, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec])"
    )
    p.add_argument(
        "--policy", default="pffs", choices=list(POLICY_NAMES), help="placement policy (default pffs)"
    )
    p.add_argument(
        "--seed", type=int, action="append", help="replay seed; repeat for several (default 42)", dest="seeds"
    )
    p.add_argument(
        "--load", type=float, default=1.3, help="demand to resample to, x GPU capacity (default 1.3)"
    )
    p.add_argument("--curve", action="store_true", help="with --json: the whole allocation curve per seed")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=simulate)


def simulate(args: argparse.Namespace) -> int:
    from pffs.cli.errors import UsageError
    from pffs.scheduler.replay.simulate import REPORT_LEVELS, replay
    from pffs.scheduler.replay.traces import TraceError, load_nodes, load_pods

    if not 0 < args.load <= 10:
        raise UsageError(f"--load must be in (0, 10], not {args.load}")
    seeds = args.seeds or [42]
    try:
        cluster = load_nodes(args.nodes)
        trace = load_pods(args.pods)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    results = []
    for seed in seeds:
        result = replay(cluster, trace, args.policy, seed, args.load)
        results.append(result)
        if not args.json and len(seeds) > 1:
            print(f"  seed {seed}: {result.pods} pods in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    levels = [str(level) for level in REPORT_LEVELS]
    summaries = [r.summary() for r in results]
    mean = {level: _mean([r.alloc_at(int(level)) for r in results]) for level in levels}
    if args.json:
        out: dict[str, Any] = {
            "nodes": args.nodes,
            "pods": args.pods,
            "policy": args.policy,
            "gpus": cluster.gpu_capacity_milli // 1000,
            "seeds": summaries,
            "mean_alloc_at": mean,
            "pods_per_second": round(statistics.mean(r.pods_per_second for r in results), 1),
        }
        if args.curve:
            for summary, r in zip(summaries, results, strict=True):
                summary["curve"] = r.curve()
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.policy} on {cluster.size} nodes ({cluster.gpu_capacity_milli // 1000} GPUs), {args.pods}")
    header = f"{'seed':>6} {'pods':>7} {'placed':>7} {'failed':>7} " + " ".join(
        f"{'alloc@' + level + '%':>11}" for level in levels
    )
    print(header + f" {'pods/s':>8}")
    for s in summaries:
        alloc = s["alloc_at"]
        print(
            f"{s['seed']:>6} {s['pods']:>7} {s['placed']:>7} {s['failed']:>7} "
            + " ".join(f"{_pct(alloc[level]):>11}" for level in levels)
            + f" {s['pods_per_second']:>8}"
        )
    if len(results) > 1:
        print(
            f"{'mean':>6} {'':>7} {'':>7} {'':>7} " + " ".join(f"{_pct(mean[level]):>11}" for level in levels)
        )
    return 0


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.mean(present), 3) if present else None


def _pct(value: object) -> str:
    return "-" if value is None else f"{value:.2f}%"
