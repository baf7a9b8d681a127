"""The gang core (``pffs scheduler``'s session) on the openb traces, beside the trace replay's FGD and pffs.

Per trace and seed, the pods that arrive up to the protocol's 100% point (their GPU demand reaches the
cluster's capacity) go, in the seed's order, to one session on the trace cluster, each pod its own group;
the nodes are named so that the lowest name is the node the seed ranks first (the session's ties go to the
lowest name, the replay's to the seed's first node). What the session places, in % of the GPU capacity,
stands beside FGD's and pffs's replays at 100% arrived (``bench/scheduler.py``) with the session's default
weights and with the former default (``binpack`` 1). Writes bench/results/scheduler_session.{json,png}.

    .venv/bin/python bench/scheduler_session.py [--traces DIR] [--seeds 42-51] [--names default,...]

The traces are research-use data: they are read in place (default ../shared/data/openb), never copied here.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scheduler import NODE_FILE, load_trace, replay_parser, seeds_option  # noqa: E402  (bench/scheduler.py)

from pffs.scheduler.core.objects import Queue  # noqa: E402
from pffs.scheduler.core.session import Weights, run_session  # noqa: E402
from pffs.scheduler.replay.as_session import ranked_names, session_group, session_nodes  # noqa: E402
from pffs.scheduler.replay.model import Cluster, PodList  # noqa: E402
from pffs.scheduler.replay.simulate import replay  # noqa: E402
from pffs.scheduler.replay.traces import DEFAULT_RATIO, load_nodes, replay_order  # noqa: E402

# Published traces of each kind, and the CPU-contested and GPU-model-bound mixes (bench/scheduler.py)
DEFAULT_NAMES = "default,gpushare40,gpushare100,multigpu30,nongpu40,gpuspec45"
VARIANTS: dict[str, Weights | None] = {
    "fgd": None,  # the trace replay's policies
    "pffs": None,
    "session": Weights(),
    "session, binpack 1": replace(Weights(), binpack=1.0),
}


@functools.cache
def cluster_and_trace(folder: str, name: str) -> tuple[Cluster, PodList]:
    """The openb cluster and a trace or mix, loaded once per worker process."""
    cluster = load_nodes(Path(folder) / NODE_FILE)
    return cluster, load_trace(Path(folder), name, cluster)


def session_alloc(folder: str, name: str, seed: int, weights: Weights) -> float:
    """% of the GPU capacity the session places of the pods arrived by 100%."""
    cluster, trace = cluster_and_trace(folder, name)
    order = replay_order(trace, cluster.copy(), seed, DEFAULT_RATIO)
    nodes = session_nodes(cluster, ranked_names(order.node_rank))
    groups, demand = [], 0
    for event, i in enumerate(order.pods.tolist()):
        milli = int(trace.share[i]) * max(int(trace.count[i]), 1)
        if demand + milli > cluster.gpu_capacity_milli:
            break
        demand += milli
        groups.append(session_group(trace, i, f"g{event:06d}", float(event)))
    result = run_session(nodes, [Queue("default")], groups, [], weights)
    placed = sum(p.pod.gpu_count * p.pod.gpu_milli for p in result.placements)
    return 100.0 * placed / cluster.gpu_capacity_milli


def one(task: tuple[str, str, int, str]) -> tuple[tuple[str, str, int, str], float]:
    folder, name, seed, variant = task
    weights = VARIANTS[variant]
    if weights is None:
        alloc = replay(*cluster_and_trace(folder, name), variant, seed).alloc_at(100)
        return task, float(alloc if alloc is not None else "nan")
    return task, session_alloc(folder, name, seed, weights)


def plot(report: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    shown = [v for v in VARIANTS if v != "fgd"]
    fig, ax = plt.subplots(figsize=(max(1.6 * len(names) + 2, 8), 4.5))
    width = 0.8 / len(shown)
    for j, variant in enumerate(shown):
        ax.bar(
            [i + (j - (len(shown) - 1) / 2) * width for i in range(len(names))],
            [report[n][variant]["minus_fgd"] for n in names],
            width,
            label=variant,
        )
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GPU allocated at 100% arrived, minus FGD (points)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = replay_parser(__doc__)
    parser.add_argument("--names", default=DEFAULT_NAMES, help="published traces or held-out mixes")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scheduler_session"))
    args = parser.parse_args(argv)
    seeds = seeds_option(parser, args.seeds)
    if not (Path(args.traces) / NODE_FILE).is_file():
        parser.error(f"no openb node list {NODE_FILE} in {args.traces}")
    names = [n for n in args.names.split(",") if n]
    cluster = load_nodes(Path(args.traces) / NODE_FILE)
    for name in names:
        try:
            load_trace(Path(args.traces), name, cluster)
        except ValueError as err:
            parser.error(str(err))
    tasks = [(args.traces, n, s, v) for n in names for v in VARIANTS for s in seeds]
    got: dict[tuple[str, str], dict[int, float]] = {}
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        for (_, name, seed, variant), alloc in tqdm(
            pool.imap_unordered(one, tasks), total=len(tasks), unit="run", file=sys.stderr
        ):
            got.setdefault((name, variant), {})[seed] = round(alloc, 3)
    report: dict[str, dict[str, Any]] = {}
    for name in names:
        fgd = statistics.mean(got[(name, "fgd")].values())
        for variant in VARIANTS:
            per_seed = dict(sorted(got[(name, variant)].items()))
            mean = statistics.mean(per_seed.values())
            report.setdefault(name, {})[variant] = {
                "alloc_at_100": round(mean, 3),
                "minus_fgd": round(mean - fgd, 3),
                "per_seed": per_seed,
            }
    print(f"\nGPU allocated at 100% arrived, % of capacity, mean of seeds {args.seeds} (minus FGD)")
    print(f"{'trace':<12} " + " ".join(f"{v:>20}" for v in VARIANTS))
    for name, row in report.items():
        cells = [f"{row[v]['alloc_at_100']:.2f} ({row[v]['minus_fgd']:+.2f})" for v in VARIANTS]
        print(f"{name:<12} " + " ".join(f"{c:>20}" for c in cells))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = {v: None if w is None else vars(w) for v, w in VARIANTS.items()}
    given = argv if argv is not None else sys.argv[1:]
    doc = {
        "command": " ".join([".venv/bin/python bench/scheduler_session.py", *given]),
        "seeds": seeds,
        "unit": "% of the GPU capacity allocated at 100% arrived",
        "weights": weights,
        "results": report,
        "seconds": round(time.perf_counter() - start, 1),
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
