"""Where a cold small file's CPU goes in the mount: py-spy samples of the mount process and the backend
requests it makes, read-write (the default) against --read-only (issue 31: profile first).

    .venv/bin/python bench/profile_mount.py [--count 1000] [--threads 8]

One local SeaweedFS; COUNT objects of 128 KiB; for each mode (read-write and read-only from an empty
cache; "warm": read-write from its disk cache after a remount) a fresh cache and mount, the page cache
dropped, every file read by THREADS threads while py-spy samples the mount's serving process (100 Hz, all
threads, idle ones left out). Prints and writes (bench/results/profile_mount.json) per mode: files/s, the
mount's CPU-ms per file, backend requests per file by kind, and the functions where the samples fall, by
self time (the leaf frame) and by inclusive time (any frame), as shares of the samples. Every file is
checked against its sha256.

A second py-spy samples only the thread holding the GIL: its samples over the wall time's give the share
of the time the GIL was held, work one process does on one core at most, whatever the node has. From
its ms per file and the CPU per file, a model of one mount on a 32-core node: files/s <= 1000 / GIL-ms
per file, and <= 32 x 1000 / CPU-ms per file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import s3fs

from pffs.testing.s3_server import SeaweedS3

VENV_BIN = Path(sys.executable).parent
SIZE = 128 << 10
RATE = 100  # py-spy samples per second


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_all(mountpoint: Path, expected: dict[str, str], threads: int) -> float:
    def one(name: str) -> None:
        data = (mountpoint / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != expected[name]:
            raise AssertionError(f"{name}: wrong bytes")

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, sorted(expected)))
    return time.perf_counter() - started


def frames(stack: str) -> list[str]:
    """py-spy's raw (collapsed) stack, root first, as 'function (file)' (line numbers and the leading
    thread name dropped, so a function's samples add up)."""
    out = []
    for part in stack.split(";")[1:]:
        name, _, where = part.partition(" (")
        out.append(f"{name} ({where.split(':')[0].rstrip(')')})" if where else name)
    return out


def summarize(raw: Path, top: int) -> dict[str, Any]:
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        names = frames(stack)
        if not names:
            continue
        total += count
        self_time[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    share = lambda counter: [(name, round(n / total, 3)) for name, n in counter.most_common(top)]  # noqa: E731
    return {"samples": total, "self": share(self_time), "inclusive": share(inclusive)}


def py_spy(pid: int, output: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(str(VENV_BIN / "py-spy"), "record", "--pid", str(pid), "--rate", str(RATE)),
            *("--format", "raw", "--output", str(output), "--nonblocking", *extra),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def profile_mode(
    s3: SeaweedS3, bucket: str, expected: dict[str, str], mode: str, args: Any, work: Path
) -> dict[str, Any]:
    """One mode: "read-write" or "read-only" (cold: an empty cache), or "warm" (read-write, every file
    read once, then a remount: read from the disk cache, memory and page cache cold)."""
    mountpoint, cache = work / f"mnt-{mode}", work / f"cache-{mode}"
    mountpoint.mkdir()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    command = [
        str(VENV_BIN / "pffs"),
        "mount",
        f"s3://{bucket}/small",
        str(mountpoint),
        "--cache-dir",
        str(cache),
    ]
    command += ["--endpoint-url", s3.endpoint_url] + (["--read-only"] if mode == "read-only" else [])
    subprocess.run(command, check=True, env=env)
    if mode == "warm":
        read_all(mountpoint, expected, args.threads)
        subprocess.run([str(VENV_BIN / "pffs"), "umount", str(mountpoint)], check=True)
        subprocess.run(command, check=True, env=env)
    try:
        pid = int(os.getxattr(mountpoint, "user.pffs.pid"))
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        raw, gil = work / f"py-spy-{mode}.txt", work / f"py-spy-{mode}-gil.txt"
        # Two samplers at once: every running thread, and only the thread holding the GIL. Their ratio
        # is the share of the mount's busy time spent holding the GIL: work no second core can share.
        spies = [py_spy(pid, raw), py_spy(pid, gil, "--gil")]
        time.sleep(1.0)  # py-spy attached
        stats_before = json.loads(os.getxattr(mountpoint, "user.pffs.stats"))
        cpu_before = cpu_seconds(pid)
        wall = read_all(mountpoint, expected, args.threads)
        cpu = cpu_seconds(pid) - cpu_before
        stats = json.loads(os.getxattr(mountpoint, "user.pffs.stats"))
        for spy in spies:
            spy.send_signal(2)
            spy.wait(timeout=60)
    finally:
        subprocess.run([str(VENV_BIN / "pffs"), "umount", str(mountpoint)], check=False)
    requests = {
        kind: round(
            (row["requests"] - stats_before["backend_requests"].get(kind, {}).get("requests", 0))
            / len(expected),
            3,
        )
        for kind, row in stats["backend_requests"].items()
    }
    profile, holding_gil = summarize(raw, args.top), summarize(gil, args.top)
    # py-spy samples at RATE while the files are read: the samples that found the GIL held, over all the
    # samples the wall time gives, is the share of the time some thread held it.
    gil_held = min(1.0, holding_gil["samples"] / (RATE * wall))
    gil_ms = gil_held * wall * 1000 / len(expected)
    cpu_ms = cpu * 1000 / len(expected)
    return {
        "files_per_s": round(len(expected) / wall, 1),
        "mount_cpu_ms_per_file": round(cpu_ms, 3),
        "mount_cores_busy": round(cpu / wall, 3),
        "gil_held_share_of_wall": round(gil_held, 3),
        "gil_held_ms_per_file": round(gil_ms, 3),
        # What one mount process could serve with cores enough: its GIL-held work is serial (one core at
        # most), the rest spreads. files/s <= 1000 / GIL-ms per file; and <= cores x 1000 / CPU-ms per
        # file for a node's cores (MODEL_CORES).
        "model": model(cpu_ms, gil_ms),
        "backend_requests_per_file": requests,
        "profile": profile,
        "profile_holding_gil": holding_gil,
    }


MODEL_CORES = 32


def model(cpu_ms_per_file: float, gil_ms_per_file: float) -> dict[str, float]:
    serial_cap = 1000 / gil_ms_per_file if gil_ms_per_file > 0 else float("inf")
    cores_cap = MODEL_CORES * 1000 / cpu_ms_per_file
    return {
        "files_per_s_capped_by_gil": round(serial_cap, 1),
        f"files_per_s_capped_by_{MODEL_CORES}_cores": round(cores_cap, 1),
        f"files_per_s_one_mount_{MODEL_CORES}_cores": round(min(serial_cap, cores_cap), 1),
        "cores_used_at_that_rate": round(min(serial_cap, cores_cap) * cpu_ms_per_file / 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="files of 128 KiB (default 1000)")
    parser.add_argument("--threads", type=int, default=8, help="reading threads (default 8)")
    parser.add_argument("--top", type=int, default=15, help="functions listed per view (default 15)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_mount.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pffs-profile-") as tmp:
        work = Path(tmp)
        with SeaweedS3(work / "s3") as s3:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            bucket = "profile"
            raw.mkdir(bucket)
            payloads = {f"f{i:05d}.bin": os.urandom(SIZE) for i in range(args.count)}
            raw.pipe({f"{bucket}/small/{name}": data for name, data in payloads.items()})
            expected = {name: hashlib.sha256(data).hexdigest() for name, data in payloads.items()}
            result = {
                "count": args.count,
                "threads": args.threads,
                "size": SIZE,
                "modes": {
                    mode: profile_mode(s3, bucket, expected, mode, args, work)
                    for mode in ("read-write", "read-only", "warm")
                },
            }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for mode, figures in result["modes"].items():
        print(
            f"\n{mode}: {figures['files_per_s']} files/s, "
            f"mount CPU {figures['mount_cpu_ms_per_file']} ms/file, "
            f"requests/file {figures['backend_requests_per_file']}"
        )
        print(
            f"  mount cores busy {figures['mount_cores_busy']}, "
            f"GIL held {figures['gil_held_share_of_wall']:.1%} of the time "
            f"({figures['gil_held_ms_per_file']} ms/file); model: {figures['model']}"
        )
        print("  self time:", ", ".join(f"{n} {s:.1%}" for n, s in figures["profile"]["self"][:10]))
        print("  inclusive:", ", ".join(f"{n} {s:.1%}" for n, s in figures["profile"]["inclusive"][:10]))


if __name__ == "__main__":
    main()
