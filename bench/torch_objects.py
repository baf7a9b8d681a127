"""How fast `pffs.torch` hands objects to a transform, and how much memory a large one costs (issue 41: the
objects a transform gets stream through the cache instead of arriving whole).

    .venv/bin/python bench/torch_objects.py                          # about five minutes
    mkdir -p /tmp/before && git archive <commit> pffs cache csi | tar -x -C /tmp/before \
        && mv /tmp/before/cache /tmp/before/csi /tmp/before/pffs/
    .venv/bin/python bench/torch_objects.py --before /tmp/before      # that commit's pffs interleaved

On a local SeaweedFS server: --small-count objects of --small-size (128 KiB: one block, fetched whole when
the item is made) and one --large-size object (multi-block: streamed). Each phase runs in a subprocess of
its own (a fresh memory tier), --repeats rounds, median reported:

    small_cold    MapDataset[i] over every small object, transform `sha256(obj.read())`, empty cache dir
    small_warm    the same, a fresh process over the now filled cache dir (disk tier hits)
    large_cold    the large object through MapDataset, read in 1 MiB `read()` calls and hashed, empty cache
                  dir: MB/s, and the process's peak RSS growth while it read (VmHWM after clear_refs)

With --before, every phase also runs with that PYTHONPATH (another pffs), alternating with this one's in
each round, so a machine busy with other work slows both alike. Every object's sha256 is checked against
the source (a mismatch ends the run with an error). Results accumulate in
bench/results/torch_objects.json by label (a run replaces the rows of the labels it ran).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import s3fs

from pffs.config import parse_size
from pffs.testing.s3_server import SeaweedS3

BUCKET = "bench-torch"
SEED = 20261128
RESULTS = Path(__file__).parent / "results"
Result = dict[str, Any]

PHASE = r"""
import hashlib, json, os, sys, time
from pffs.torch import MapDataset

url, cache_dir, options, chunk = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[5])
with open(sys.argv[4]) as f:
    expected = json.load(f)


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


dataset = MapDataset(url, cache_dir=cache_dir, **options)
assert len(dataset) == len(expected), (len(dataset), len(expected))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS from here on
base = status("VmRSS")
cpu, start = time.process_time(), time.perf_counter()
got, read = {}, 0
for i in range(len(dataset)):
    obj = dataset[i]
    digest = hashlib.sha256()
    if chunk:
        while data := obj.read(chunk):
            digest.update(data)
            read += len(data)
    else:
        data = obj.read()
        digest.update(data)
        read += len(data)
    got[obj.key] = digest.hexdigest()
    obj.close()
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
print(json.dumps({"seconds": elapsed, "cpu": cpu, "bytes": read, "objects": len(got),
                  "rss_growth": status("VmHWM") - base, "rss_base": base, "exact": got == expected}))
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def phase(
    url: str, cache: Path, options: dict[str, Any], expected: dict[str, str], chunk: int, pythonpath: str
) -> Result:
    sums = cache.parent / f"{cache.name}.sha256.json"
    sums.write_text(json.dumps(expected))
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    result = subprocess.run(
        [sys.executable, "-c", PHASE, url, str(cache), json.dumps(options), str(sums), str(chunk)],
        capture_output=True, text=True, timeout=600, env=env, cwd=cache.parent,  # not this checkout's pffs
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    row: Result = json.loads(result.stdout)
    if not row["exact"]:
        raise RuntimeError(f"{url}: a sha256 differs from the source")
    return row


def run(args: argparse.Namespace) -> list[Result]:
    rows: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="pffs-torch-objects-") as tmp:
        work = Path(tmp)
        with SeaweedS3(work / "seaweedfs") as s3:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            raw.mkdir(BUCKET)
            rng = np.random.default_rng(SEED)
            small = {f"small/{i:05d}.bin": rng.bytes(args.small_size) for i in range(args.small_count)}
            raw.pipe({f"{BUCKET}/{key}": data for key, data in small.items()})
            large = rng.bytes(args.large_size)
            raw.pipe(f"{BUCKET}/large/large.bin", large)
            small_sums = {key: hashlib.sha256(data).hexdigest() for key, data in small.items()}
            large_sums = {"large/large.bin": hashlib.sha256(large).hexdigest()}
            del small, large
            options = {k: v for k, v in s3.storage_options().items() if k != "skip_instance_cache"}
            variants = {args.label: ""} | ({args.before_label: args.before} if args.before else {})
            rounds: dict[tuple[str, str], list[Result]] = {
                (label, name): [] for label in variants for name in ("small_cold", "small_warm", "large_cold")
            }
            for n in range(args.repeats):  # the variants' phases interleaved: a busy machine slows both
                for label, path in variants.items():
                    cache = work / f"cache-{label}-small-{n}"
                    small_url, large_url = f"s3://{BUCKET}/small", f"s3://{BUCKET}/large"
                    rounds[label, "small_cold"].append(phase(small_url, cache, options, small_sums, 0, path))
                    rounds[label, "small_warm"].append(phase(small_url, cache, options, small_sums, 0, path))
                    cache = work / f"cache-{label}-large-{n}"
                    rounds[label, "large_cold"].append(
                        phase(large_url, cache, options, large_sums, 1 << 20, path)
                    )
                log(
                    f"round {n + 1}: " + ", ".join(f"{k} {v[-1]['seconds']:.2f} s" for k, v in rounds.items())
                )
            for (label, name), results in rounds.items():
                seconds = statistics.median(r["seconds"] for r in results)
                cpu = statistics.median(r["cpu"] for r in results)
                row = {
                    "label": label,
                    "phase": name,
                    "objects": results[0]["objects"],
                    "bytes": results[0]["bytes"],
                    "seconds": round(seconds, 3),
                    "seconds_rounds": [round(r["seconds"], 3) for r in results],
                    "objects_per_s": round(results[0]["objects"] / seconds, 1),
                    # the fastest round: what the code costs when the machine's other work leaves it alone
                    "objects_per_s_best": round(
                        results[0]["objects"] / min(r["seconds"] for r in results), 1
                    ),
                    "mb_per_s": round(results[0]["bytes"] / seconds / 1e6, 1),
                    "cpu_ms_per_object": round(cpu * 1000 / results[0]["objects"], 3),
                    "rss_growth_mib": round(max(r["rss_growth"] for r in results) / (1 << 20), 1),
                    "rss_base_mib": round(max(r["rss_base"] for r in results) / (1 << 20), 1),
                }
                rows.append(row)
    return rows


def describe(row: Result) -> str:
    return (
        f"{row['label']:<8} {row['phase']:<11} {row['objects']:5d} objects, "
        f"{row['bytes'] / (1 << 20):7.1f} MiB: "
        f"{row['objects_per_s']:8.1f} objects/s (best {row['objects_per_s_best']:.1f}), "
        f"{row['mb_per_s']:7.1f} MB/s, "
        f"{row['cpu_ms_per_object']:.3f} ms CPU/object, peak RSS growth {row['rss_growth_mib']:.1f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--small-count", type=int, default=2000)
    parser.add_argument("--small-size", type=parse_size, default=128 << 10)
    parser.add_argument("--large-size", type=parse_size, default=512 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--before",
        default="",
        help="a PYTHONPATH with another pffs (e.g. a `git archive` of main) to run interleaved",
    )
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--out", type=Path, default=RESULTS / "torch_objects.json")
    args = parser.parse_args()
    rows = run(args)
    for row in rows:
        print(describe(row))
    old = json.loads(args.out.read_text()) if args.out.exists() else []
    kept = [row for row in old if row.get("label") not in {row["label"] for row in rows}]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(kept + rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
