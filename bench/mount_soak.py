"""Soak: epochs of a PyTorch DataLoader over a real pffs mount on a loaded machine, for a long while.

    .venv/bin/python bench/mount_soak.py --minutes 20              # the run the README reports
    .venv/bin/python bench/mount_soak.py --minutes 2 --files 300   # quick

Issue 29: in a trial, a mount died during a second epoch on a heavily loaded machine; the DataLoader got
ENOTCONN and the mount's log held only its "mounted" line. This tries to make that happen again, with the
mount's last words now in place: one SeaweedFS server; a dataset of --files small files (128 KiB) and 4
large ones (48 MiB); `pffs mount --read-only` with a disk cache smaller than the dataset (every epoch
evicts and fetches again), a small memory tier and the page cache dropped before each epoch; a
DataLoader with --workers forked workers reading every file once per epoch in a shuffled order, each file
checked against its sha256; and load beside it: --hogs processes spinning on the CPU and one holding
--balloon of memory, touched over and over.

After each epoch: files read, wrong bytes (must stay 0), errors by errno, the mount's RSS and whether it is
alive. At the end: the mount's exit status and the last line of its log. JSON to
bench/results/mount_soak.json; no chart (there is nothing to compare: one figure, alive or not).
"""

from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import s3fs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pffs.testing.s3_server import SeaweedS3  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "mount_soak.json"
SMALL = 128 << 10
LARGE = 48 << 20


def spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


def balloon(size: int, stop: Any) -> None:
    held = bytearray(size)
    while not stop.is_set():
        for i in range(0, size, 4096):  # touched again and again: the kernel cannot leave it swapped out
            held[i] = (held[i] + 1) & 0xFF
        time.sleep(0.5)


class Files:
    """A map-style dataset of paths: item i is (index, sha256 matches, errno or 0)."""

    def __init__(self, paths: list[str], digests: list[str]) -> None:
        self.paths, self.digests = paths, digests

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, bool, int]:
        try:
            with open(self.paths[i], "rb") as f:
                data = f.read()
        except OSError as exc:
            return i, True, exc.errno or errno.EIO
        return i, hashlib.sha256(data).hexdigest() == self.digests[i], 0


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--balloon", default="2G", help="memory held and touched by the load (default 2G)")
    args = parser.parse_args()
    balloon_bytes = int(args.balloon[:-1]) << {"K": 10, "M": 20, "G": 30}[args.balloon[-1].upper()]

    import torch.utils.data

    work = Path(tempfile.mkdtemp(prefix="pffs-soak-"))
    with SeaweedS3(work / "server") as server:
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        raw.mkdir("soak")
        rng = random.Random(7)
        objects = {f"small/{i:05d}.bin": rng.randbytes(SMALL) for i in range(args.files)}
        objects.update({f"large/{i}.bin": rng.randbytes(LARGE) for i in range(4)})
        raw.pipe({f"soak/{k}": v for k, v in objects.items()})
        digests = {k: hashlib.sha256(v).hexdigest() for k, v in objects.items()}
        dataset_bytes = sum(len(v) for v in objects.values())
        del objects
        mountpoint = work / "mnt"
        mountpoint.mkdir()
        log_file = work / "mount.log"
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
        }
        cache_size = f"{dataset_bytes // 2 >> 20}M"  # half the dataset: every epoch evicts and fetches
        command = [
            sys.executable,
            "-m",
            "pffs.cli.main",
            "mount",
            "s3://soak",
            str(mountpoint),
            "--read-only",
        ]
        command += ["--endpoint-url", server.endpoint_url, "--cache-dir", str(work / "cache")]
        command += ["--cache-size", cache_size, "--memory-cache-size", "128M", "--log-file", str(log_file)]
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if started.returncode:
            print(started.stderr, file=sys.stderr)
            return 1
        pid = int(os.getxattr(mountpoint, "user.pffs.pid"))
        paths = sorted(digests)
        loader = torch.utils.data.DataLoader(
            Files([str(mountpoint / p) for p in paths], [digests[p] for p in paths]),
            batch_size=None,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=True,
        )
        stop = multiprocessing.Event()
        load = [multiprocessing.Process(target=spin, args=(stop,)) for _ in range(args.hogs)]
        load.append(multiprocessing.Process(target=balloon, args=(balloon_bytes, stop)))
        for process in load:
            process.start()
        epochs: list[dict[str, Any]] = []
        deadline = time.monotonic() + args.minutes * 60
        try:
            while time.monotonic() < deadline:
                drop_page_cache()  # a dataset larger than memory: every epoch reads through the mount
                began = time.monotonic()
                wrong, errors = 0, collections.Counter()
                for _index, matches, error in loader:
                    wrong += not matches
                    if error:
                        errors[errno.errorcode.get(int(error), str(error))] += 1
                epoch = {
                    "epoch": len(epochs) + 1,
                    "seconds": round(time.monotonic() - began, 1),
                    "files": len(paths),
                    "wrong_bytes_files": wrong,
                    "errors": dict(errors),
                    "mount_alive": os.path.ismount(mountpoint) and rss_mib(pid) is not None,
                    "mount_rss_mib": rss_mib(pid),
                    "load_1m": os.getloadavg()[0],
                }
                epochs.append(epoch)
                print(json.dumps(epoch), flush=True)
                if not epoch["mount_alive"]:
                    break
        finally:
            stop.set()
            for process in load:
                process.join(10)
            del loader
            ended = subprocess.run(
                [sys.executable, "-m", "pffs.cli.main", "umount", str(mountpoint)],
                capture_output=True,
                text=True,
            )
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
        log_lines = log_file.read_text().splitlines()
        result = {
            "minutes": args.minutes,
            "files": len(paths),
            "dataset_mib": dataset_bytes >> 20,
            "cache_size": cache_size,
            "workers": args.workers,
            "hogs": args.hogs,
            "balloon": args.balloon,
            "epochs": epochs,
            "mount_died": any(not e["mount_alive"] for e in epochs),
            "wrong_bytes_files": sum(e["wrong_bytes_files"] for e in epochs),
            "umount_status": ended.returncode,
            "last_log_line": log_lines[-1] if log_lines else "",
            "warnings_in_log": [line for line in log_lines if " WARNING " in line or " ERROR " in line][-20:],
        }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "epochs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
