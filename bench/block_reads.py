"""The disk tier's block reads (issue 44: the block format read natively, without the GIL) against the
physical ceiling, a plain os.pread of the same bytes with no checking, and against the pure-Python reader
of an earlier commit, in one run:

    .venv/bin/python bench/block_reads.py                          # the native reader and the ceiling
    .venv/bin/python bench/block_reads.py --python-from 2d9142b    # and the Python reader of that commit

16 block files of 4 MiB (pffs's default block size) in a folder on the disk the cache would use (--dir,
/var/tmp by default), read by 1 and 4 threads (`rounds` reads per thread) whole (a FUSE mount's or the
SDK's read of a cached block) and in 128 KiB ranges (random reads), through the page cache (the SDK) and
with O_DIRECT (the mount). Figures: GiB/s and CPU seconds per GiB of the process (getrusage). Each reader's
bytes are compared with what was written (exit 1 on a mismatch). Results: bench/results/block_reads.json
and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from pffs.cache import block_format
from pffs.cache.aligned import aligned_buffer

RESULTS = Path(__file__).parent / "results"
BLOCK = 4 << 20
RANGE = 128 << 10
FILES = 16


def python_reader(commit: str, folder: Path) -> ModuleType:
    """cache/block_format.py (and the aligned.py it imports) of `commit`, loaded as a module of its own."""
    package = folder / "old_cache"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("block_format.py", "aligned.py"):
        source = subprocess.run(
            ["git", "show", f"{commit}:cache/{name}"], capture_output=True, text=True, check=True
        ).stdout
        (package / name).write_text(source)
    sys.path.insert(0, str(folder))
    spec = importlib.util.find_spec("old_cache.block_format")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ceiling_whole(path: str, direct: bool) -> bytes:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        if direct:
            buffer = aligned_buffer(block_format.header_size(BLOCK) + BLOCK + 4096)
            got = os.preadv(fd, [buffer], 0)
            return bytes(buffer[block_format.header_size(BLOCK) : got])
        return os.pread(fd, block_format.header_size(BLOCK) + BLOCK + 1, 0)[block_format.header_size(BLOCK) :]
    finally:
        os.close(fd)


def ceiling_range(path: str, start: int, end: int, direct: bool) -> bytes:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        offset = block_format.header_size(BLOCK) + start
        if direct:
            buffer = aligned_buffer(end - start)
            os.preadv(fd, [buffer], offset)
            return bytes(buffer)
        return os.pread(fd, end - start, offset)
    finally:
        os.close(fd)


def readers(module: ModuleType | None) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(whole(path, direct), ranged(path, start, end, headers, direct)) of a reader; None: the ceiling."""
    if module is None:
        return ceiling_whole, lambda path, start, end, _, direct: ceiling_range(path, start, end, direct)

    def ranged(path: str, start: int, end: int, headers: dict[str, Any], direct: bool) -> Any:
        data, headers[path] = module.read_block_range(path, start, end, headers.get(path), direct)
        return data

    return lambda path, direct: module.read_block_file(path, BLOCK, direct), ranged


def run(
    module: ModuleType | None, paths: list[str], payloads: list[bytes], case: dict[str, Any]
) -> dict[str, Any]:
    whole, ranged = readers(module)
    wrong: list[str] = []

    def work(worker: int) -> None:
        headers: dict[str, Any] = {}
        for n in range(case["rounds"]):
            index = (worker * 5 + n) % len(paths)
            if case["kind"] == "whole":
                if bytes(whole(paths[index], case["direct"])) != payloads[index]:
                    wrong.append(paths[index])
                continue
            for start in range(0, BLOCK, RANGE):
                got = ranged(paths[index], start, start + RANGE, headers, case["direct"])
                if bytes(got) != payloads[index][start : start + RANGE]:
                    wrong.append(f"{paths[index]}@{start}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(case["threads"])]
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    if wrong:
        raise SystemExit(f"wrong bytes from {wrong[:3]}")
    gib = case["threads"] * case["rounds"] * BLOCK / (1 << 30)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"gib_per_s": round(gib / wall, 3), "cpu_s_per_gib": round(cpu / gib, 3)}


def figures(result: dict[str, Any]) -> str:
    return f"{result['gib_per_s']:.2f} GiB/s {result['cpu_s_per_gib']:.2f} CPU-s/GiB"


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    names = [name for name in ("ceiling", "native", "python") if name in cases[0]]
    labels = [f"{c['kind']}\n{'direct' if c['direct'] else 'cached'} x{c['threads']}" for c in cases]
    figure, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [n + i * width for n in range(len(cases))]
        axes[0].bar(xs, [c[name]["gib_per_s"] for c in cases], width, label=name)
        axes[1].bar(xs, [c[name]["cpu_s_per_gib"] for c in cases], width, label=name)
    axes[0].set_ylabel("GiB/s")
    axes[1].set_ylabel("CPU s per GiB")
    axes[1].set_xticks([n + width * (len(names) - 1) / 2 for n in range(len(cases))], labels, fontsize=8)
    axes[0].legend()
    axes[0].set_title("disk-tier block reads: pffs's native reader, the pread ceiling, the Python reader")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/var/tmp", help="where the block files go (default: /var/tmp)")
    parser.add_argument("--python-from", metavar="COMMIT", help="also the pure-Python reader of COMMIT")
    parser.add_argument("--rounds", type=int, default=40, help="block reads per thread (default: 40)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pffs-block-reads-") as folder:
        modules: dict[str, ModuleType | None] = {"ceiling": None, "native": block_format}
        if args.python_from:
            modules["python"] = python_reader(args.python_from, Path(folder))
        payloads = [random.Random(i).randbytes(BLOCK) for i in range(FILES)]
        paths = []
        for i, payload in enumerate(payloads):
            path = os.path.join(folder, f"block-{i}")
            with open(path, "wb") as f:
                f.write(block_format.pack_block(payload))
            paths.append(path)
        cases: list[dict[str, Any]] = []
        for kind in ("whole", "ranges"):
            for direct in (False, True):
                for threads in (1, 4):
                    case: dict[str, Any] = {"kind": kind, "direct": direct, "threads": threads}
                    case["rounds"] = args.rounds if kind == "whole" else max(1, args.rounds // 2)
                    for name, module in modules.items():
                        case[name] = run(module, paths, payloads, case)
                    print(
                        f"{kind:6} {'direct' if direct else 'cached'} x{threads}: "
                        + ", ".join(f"{name} {figures(case[name])}" for name in modules),
                        flush=True,
                    )
                    cases.append(case)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["bench/block_reads.py", *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "block": BLOCK,
        "range": RANGE,
        "python_from": args.python_from,
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "block_reads.json").write_text(json.dumps(results, indent=2) + "\n")
    chart(results, RESULTS / "block_reads.png")
    print(f"results: {RESULTS / 'block_reads.json'}, {RESULTS / 'block_reads.png'}")


if __name__ == "__main__":
    main()
