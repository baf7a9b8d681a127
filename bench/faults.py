"""Faults a mount holds: pffs against Mountpoint for S3, rclone and s3fs-fuse, each reading one dataset
through the same fault proxy (pffs/testing/fault_proxy.py) in front of one local SeaweedFS (issue 43).

    .venv/bin/python bench/faults.py                                  # 50% 503 SlowDown, 10% mid-body stalls
    .venv/bin/python bench/faults.py --throttle 0.2 --stall 0 --only pffs,mountpoint

Run as root (/dev/fuse). The dataset (--files files of --size bytes under s3://bench-data/ds/small/, written
straight to the server) is read whole by 8 threads, each file once, through each client's mount of
s3://bench-data/ds made through the proxy, its cache empty. Every read has a deadline (--read-deadline): a
read still waiting then counts as hung (the proxy then lets every stalled answer go, and the mount is
unmounted by force). Every byte read is checked against the sha256 it was written with. Per client: reads
exact, wrong (bytes that differ: the one outcome a cache must never have), failed (an error), hung, the
seconds it took, and what the proxy did to its requests. JuiceFS is left out: it reads its own format, not
the dataset's objects (bench/mounts.py says how it is measured there).

Results: bench/results/faults.json and faults.png. Nothing here is asserted: tests/test_retries_fault_proxy.py
holds pffs to 0 failed reads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mounts import BUCKET, MOUNT_S3, PREFIX, THREADS, Context, Mount, log

from pffs.testing.fault_proxy import FaultProxy, Faults
from pffs.testing.s3_server import SeaweedS3

CLIENTS = ("pffs", "mountpoint", "rclone", "s3fs")
RESULTS = Path(__file__).resolve().parent / "results"
SMALL_DIR = "small"


def write_dataset(server: SeaweedS3, files: int, size: int) -> dict[str, str]:
    """The files, written straight to the server: name under the dataset -> sha256."""
    import s3fs

    s3 = s3fs.S3FileSystem(**server.storage_options())
    s3.mkdir(BUCKET)
    digests: dict[str, str] = {}
    for n in range(files):
        data = os.urandom(size)
        name = f"{SMALL_DIR}/{n:05d}.bin"
        s3.pipe_file(f"{BUCKET}/{PREFIX}/{name}", data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def read_one(path: Path, started: set[str]) -> str:
    started.add(path.name)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_all(root: Path, digests: dict[str, str], deadline_s: float) -> dict[str, Any]:
    """Every file once by THREADS threads; outcomes counted: a read still waiting at the deadline is hung,
    one never begun (every reader held by a hung read) not reached. Hung threads are left behind (a FUSE
    read cannot be cancelled from here)."""
    outcomes = {"exact": 0, "wrong": 0, "failed": 0, "hung": 0, "not_reached": 0}
    errors: dict[str, int] = {}
    begun: set[str] = set()
    started = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    futures = {pool.submit(read_one, root / name, begun): name for name in digests}
    done, waiting = concurrent.futures.wait(futures, timeout=deadline_s)
    seconds = time.monotonic() - started
    for future in done:
        try:
            outcomes["exact" if future.result() == digests[futures[future]] else "wrong"] += 1
        except OSError as exc:
            outcomes["failed"] += 1
            key = os.strerror(exc.errno) if exc.errno else type(exc).__name__
            errors[key] = errors.get(key, 0) + 1
    hung = {Path(futures[future]).name for future in waiting} & begun
    outcomes["hung"], outcomes["not_reached"] = len(hung), len(waiting) - len(hung)
    pool.shutdown(wait=False, cancel_futures=True)
    return {**outcomes, "errors": errors, "seconds": round(seconds, 2)}


def run_client(client: str, ctx: Context, proxy: FaultProxy, digests: dict[str, str], args: Any) -> dict:
    work = ctx.workdir / client
    mount = Mount(client, ctx, work / "cache", work / "mnt")
    before = dict(proxy.counts)
    result: dict[str, Any] = {"client": client}
    try:
        mount.start()
        result.update(read_all(mount.root, digests, args.read_deadline))
    except Exception as exc:  # a mount that cannot start through the faults: said, not fatal
        result.update(error=str(exc)[-500:], exact=0, wrong=0, failed=len(digests), hung=0, not_reached=0)
    finally:
        proxy.release()  # stalled answers end, so the unmount is not held by a read
        mount.stop()
    result["proxy"] = {k: proxy.counts[k] - before.get(k, 0) for k in proxy.counts}
    log(f"  {client}: {json.dumps({k: v for k, v in result.items() if k != 'client'})}")
    return result


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["clients"]
    names = [r["client"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0] * len(rows)
    for outcome, color in (("exact", "tab:green"), ("failed", "tab:orange"), ("hung", "tab:gray"),
                           ("not_reached", "lightgray"), ("wrong", "tab:red")):  # fmt: skip
        values = [r.get(outcome, 0) for r in rows]
        left.bar(names, values, bottom=bottom, color=color, label=outcome)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_title(f"reads of {report['files']} files: outcome")
    left.legend()
    right.bar(names, [r.get("seconds", 0) for r in rows], color="tab:blue")
    right.set_title("seconds to read them (hung reads: the deadline)")
    faults = report["faults"]
    fig.suptitle(f"through {faults['throttle']:.0%} 503 SlowDown and {faults['stall']:.0%} mid-body stalls")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200, help="files in the dataset (default 200)")
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes per file (default 1 MiB)")
    parser.add_argument("--throttle", type=float, default=0.5, help="share of requests answered 503")
    parser.add_argument("--stall", type=float, default=0.1, help="share of answers stalled mid-body")
    parser.add_argument("--read-deadline", type=float, default=180.0, help="seconds all reads may take")
    parser.add_argument("--only", help="comma-separated clients (default: all of " + ",".join(CLIENTS) + ")")
    parser.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = parser.parse_args()
    clients = args.only.split(",") if args.only else list(CLIENTS)
    if "mountpoint" in clients and not MOUNT_S3.exists():
        log(f"skipping mountpoint: no {MOUNT_S3}")
        clients.remove("mountpoint")
    with tempfile.TemporaryDirectory(prefix="pffs-faults-") as tmp:
        workdir = Path(tmp)
        server = SeaweedS3(workdir / "s3").start()
        try:
            digests = write_dataset(server, args.files, args.size)
            faults = Faults(throttle=args.throttle, stall=args.stall)
            with FaultProxy(server.endpoint_url, faults, seed=7) as proxy:
                ctx = Context(proxy.endpoint_url, server.access_key, server.secret_key, workdir)
                rows = [run_client(client, ctx, proxy, digests, args) for client in clients]
        finally:
            server.stop()
    report = {
        "files": args.files,
        "size": args.size,
        "faults": {"throttle": args.throttle, "stall": args.stall},
        "read_deadline_s": args.read_deadline,
        "clients": rows,
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    columns = ("exact", "wrong", "failed", "hung", "not_reached", "seconds")
    print(f"{'client':<12}" + "".join(f"{c:>13}" for c in columns) + "  errors")
    for r in rows:
        cells = "".join(f"{r.get(c, 0):>13g}" for c in columns)
        print(f"{r['client']:<12}{cells}  {r.get('errors') or r.get('error', '')}")
    print(f"results: {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
