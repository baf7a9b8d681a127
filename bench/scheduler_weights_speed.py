"""What pffs's stranded-GPU weights (issue 16, ``TypicalShapes.for_stranding``) cost in replay speed.

Replays openb traces on the 1,213-node cluster with pffs as committed and with the weights it had before
(each typical shape at its pod frequency), interleaved seed by seed in one process so that the load of a
shared machine falls on both alike, and prints pods/s of each. Writes
bench/results/scheduler_weights_speed.json.

    .venv/bin/python bench/scheduler_weights_speed.py [--traces DIR] [--names default,...] [--seeds 42-44]

bench/scheduler.py gives the speed of every policy on every trace; this one answers only "did the new
weights make pffs slower, and by how much". The traces are read in place, never copied here.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scheduler import NODE_FILE, replay_parser, seeds_option  # noqa: E402  (bench/scheduler.py)

from pffs.scheduler.core.fragmentation import TypicalShapes  # noqa: E402
from pffs.scheduler.replay.policies import POLICIES, PffsPolicy  # noqa: E402
from pffs.scheduler.replay.simulate import replay  # noqa: E402
from pffs.scheduler.replay.traces import load_nodes, load_pods  # noqa: E402

OLD_WEIGHTS = "pffs-pod-frequency-weights"
# Registered for this run only: pffs's policy before c4fa39e (same measure, shapes at pod frequency).
POLICIES[OLD_WEIGHTS] = lambda cluster, trace, rng: PffsPolicy(
    cluster, TypicalShapes.from_pods(trace, cluster)
)


def main(argv: list[str] | None = None) -> int:
    parser = replay_parser(__doc__, seeds="42-44")
    parser.add_argument("--names", default="default,multigpu30,gpushare40", help="traces to replay")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "scheduler_weights_speed.json"))
    args = parser.parse_args(argv)
    folder = Path(args.traces)
    seeds = seeds_option(parser, args.seeds)
    names = [n for n in args.names.split(",") if n]
    missing = [n for n in names if not (folder / f"openb_pod_list_{n}.csv").is_file()]
    if missing or not (folder / NODE_FILE).is_file():
        parser.error(f"no openb trace {', '.join(missing) or 'node list'} in {folder}")
    cluster = load_nodes(folder / NODE_FILE)
    report = {}
    for name in names:
        trace = load_pods(folder / f"openb_pod_list_{name}.csv")
        rates: dict[str, list[float]] = {"pffs": [], OLD_WEIGHTS: []}
        for seed in seeds:
            for policy, per_seed in rates.items():
                per_seed.append(round(replay(cluster, trace, policy, seed).pods_per_second, 1))
        means = {policy: round(statistics.mean(v), 1) for policy, v in rates.items()}
        change = means["pffs"] / means[OLD_WEIGHTS] - 1
        report[name] = {"pods_per_second": rates, "mean": means, "committed_vs_before": round(change, 3)}
        print(
            f"{name:<13} pffs {means['pffs']:>8.0f} pods/s   pod-frequency weights "
            f"{means[OLD_WEIGHTS]:>8.0f} pods/s   {change:+.1%}",
            flush=True,
        )
    payload = {"cluster_nodes": cluster.size, "seeds": seeds, "traces": report}
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
