"""How long the `pffs` command takes to start and answer: `--version`, `--help`, and `pffs cat` of a small
object already in the cache (what webdataset's `pipe:pffs cat ...` pays per shard).

    .venv/bin/python bench/cli_start.py              # 7 runs each, a local SeaweedFS for `cat`
    .venv/bin/python bench/cli_start.py --runs 3 --no-chart

Each figure is the median wall time of a fresh process (with bytecode, as installed), next to bare
`python -c pass` (the floor every Python command pays) in the same run. Writes
bench/results/cli_start.json and cli_start.png (--out-dir) and prints a table; exits 1 if a command fails
or `cat` prints other bytes than the object's. Run by `make test` after the tests, so every CI log carries
the current figures (no figure is asserted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PFFS = str(Path(sys.executable).parent / "pffs")
PAYLOAD = b"label,index\n" + b"".join(b"cat,%03d\n" % i for i in range(48))  # 396 bytes


def timed(command: list[str], env: dict[str, str], runs: int, expect: bytes | None = None) -> list[float]:
    seconds = []
    for run in range(runs + 1):
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, timeout=120, check=False)
        if run:  # the first writes the bytecode
            seconds.append(time.perf_counter() - started)
        if done.returncode != 0 or (expect is not None and done.stdout != expect):
            raise SystemExit(
                f"{' '.join(command[:4])}: exit {done.returncode}: {done.stderr.decode()[-500:]}"
            )
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--no-chart", action="store_true")
    args = parser.parse_args()
    from pffs.testing.s3_server import SeaweedS3

    results: dict[str, list[float]] = {}
    # As installed: with bytecode (pip compiles it; this machine's PYTHONDONTWRITEBYTECODE=1 would make every
    # run compile pffs's sources again). The first run of each command writes it and is not counted.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    results["python -c pass"] = timed([sys.executable, "-c", "pass"], env, args.runs)
    results["pffs --version"] = timed([PFFS, "--version"], env, args.runs)
    results["pffs --help"] = timed([PFFS, "--help"], env, args.runs)
    with tempfile.TemporaryDirectory(prefix="pffs-cli-start-") as tmp, SeaweedS3(Path(tmp) / "s3") as s3:
        import fsspec

        raw = fsspec.filesystem("s3", skip_instance_cache=True, **s3.storage_options())
        raw.mkdir("cli-start")
        raw.pipe("cli-start/labels.csv", PAYLOAD)
        env.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key)
        cat = [PFFS, "--endpoint-url", s3.endpoint_url, "--cache-dir", f"{tmp}/cache", "cat"]
        timed([*cat, "s3://cli-start/labels.csv"], env, 1, PAYLOAD)  # cold: now it is cached
        results["pffs cat (cached, 396 B)"] = timed(
            [*cat, "s3://cli-start/labels.csv"], env, args.runs, PAYLOAD
        )
    medians = {name: statistics.median(values) for name, values in results.items()}
    width = max(map(len, medians))
    print(f"{'command':<{width}}  median s  (of {args.runs})")
    for name, value in medians.items():
        print(f"{name:<{width}}  {value:8.3f}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip(),
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "median_s": medians,
        "all_s": results,
    }
    (args.out_dir / "cli_start.json").write_text(json.dumps(record, indent=2) + "\n")
    if not args.no_chart:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        names = list(medians)
        ax.barh(names, [medians[n] for n in names], color="#4c72b0")
        ax.axvline(0.3, color="#c44e52", linestyle="--", label="issue 35's target: 0.3 s")
        ax.set_xlabel("seconds to start and answer (median)")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(args.out_dir / "cli_start.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
