"""Benchmark of distributed checkpoints (torch.distributed.checkpoint) on a local SeaweedFS S3 server: save
and load of one state dict by several ranks (gloo, one process each) through

    pffs             pffs.torch.dcp's Writer and Reader (shards staged on local disk, uploaded whole; loads
                     through the pffs cache: "cold" the first load, "warm" a second one in the same process)
    torch_fsspec     torch's own FsspecWriter/FsspecReader on "pffs::s3://..." (the pffs filesystem; shards
                     streamed to S3 through s3fs; loads through the pffs cache, cold and warm as above)
    s3torchconnector AWS's s3torchconnector.dcp S3StorageWriter/S3StorageReader (CRT client, no cache)

    .venv/bin/python bench/dcp.py                                  # 2 ranks x 256 MiB, 2 rounds
    .venv/bin/python bench/dcp.py --size-per-rank 32M --repeats 1  # quick run

Each rank's part of the state dict is --tensors float32 tensors of random bytes (seeded by rank), saved to
s3://dcp-bench/<client>/<round>; the clock runs from a barrier before dcp.save/dcp.load to a barrier after
it, on rank 0. After the clock stops, every loaded tensor is compared with the saved one (torch.equal); a
mismatch fails the run. The median over --repeats rounds is reported; MB/s is the whole state dict (all
ranks) over that time.

s3torchconnector pins torch, so it runs in its own virtualenv, ~/.cache/pffs-tools/venvs/s3torchconnector
(as bench/sdk.py's peer; its DCP part also needs `tenacity`, its `dcp` extra). Its DCP writer and reader
take a region but no endpoint: each is given an S3 client of its own for the local server (path-style,
region us-east-1), put in place of the one it made (`.fs._client`). The ranks' credentials come from a
0600 spec file, never argv or the environment. Where it cannot run, the JSON's "skipped" says why.

Writes bench/results/dcp.json and bench/results/dcp.png, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUCKET = "dcp-bench"
PEER = "s3torchconnector"
PEER_VENV = Path.home() / ".cache" / "pffs-tools" / "venvs" / PEER
REPO = Path(__file__).resolve().parent.parent
PEER_REGION = "us-east-1"  # SeaweedFS takes any region; the CRT client needs one
CLIENTS = ("pffs", "torch_fsspec", PEER)
RANK_TIMEOUT_S = 900
PROFILE_DIR = os.environ.get("PFFS_BENCH_PROFILE")  # a folder: rank 0 of each run under py-spy (slower)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


# -- one rank (runs in the client's python: the peer's virtualenv has no pffs, so it is imported lazily) ----
def rank_main(spec_path: str, client: str, round_: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    url = f"s3://{BUCKET}/{client}/{round_}"
    count = spec["tensors"]
    numel = spec["size_per_rank"] // 4 // count
    g = torch.Generator().manual_seed(1000 * rank + round_)
    saved = {f"rank{rank}.t{i}": torch.randn(numel, generator=g) for i in range(count)}
    writer, reader = storage(client, spec, url)

    def timed(step: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        return time.perf_counter() - start

    result: dict[str, Any] = {"save_s": timed(lambda: dcp.save(saved, storage_writer=writer))}
    loads = ["cold", "warm"] if client != PEER else ["direct"]
    for variant in loads:
        loaded = {k: torch.empty_like(v) for k, v in saved.items()}
        result[f"load_{variant}_s"] = timed(lambda: dcp.load(loaded, storage_reader=reader()))  # noqa: B023
        result[f"load_{variant}_exact"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
    all_results: list[Any] = [None] * world
    dist.all_gather_object(all_results, result)
    if rank == 0:
        print(json.dumps(all_results))
    dist.destroy_process_group()


def storage(client: str, spec: dict[str, Any], url: str) -> tuple[Any, Any]:
    """The client's writer, and a maker of readers."""
    if client == PEER:
        os.environ.update(
            AWS_ACCESS_KEY_ID=spec["key"],
            AWS_SECRET_ACCESS_KEY=spec["secret"],
            AWS_EC2_METADATA_DISABLED="true",
        )
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        def local_client() -> Any:
            config = S3ClientConfig(force_path_style=True)
            return S3Client(PEER_REGION, endpoint=spec["endpoint_url"], s3client_config=config)

        peer_writer = S3StorageWriter(PEER_REGION, url, S3ClientConfig(force_path_style=True))
        peer_writer.fs._client = local_client()  # its DCP API takes no endpoint

        def peer_reader() -> Any:
            made = S3StorageReader(PEER_REGION, url, S3ClientConfig(force_path_style=True))
            made.fs._client = local_client()
            return made

        return peer_writer, peer_reader
    s3 = {"endpoint_url": spec["endpoint_url"], "key": spec["key"], "secret": spec["secret"]}
    pffs = {"cache_dir": spec["cache_dir"]}
    if client == "pffs":
        from pffs.torch.dcp import Reader, Writer

        return Writer(url, **s3, **pffs), lambda: Reader(url, **s3, **pffs)
    from torch.distributed.checkpoint import FsspecReader, FsspecWriter

    chained = f"pffs::{url}"
    return FsspecWriter(chained, s3=s3, pffs=pffs), lambda: FsspecReader(chained, s3=s3, pffs=pffs)


# -- the run ------------------------------------------------------------------------------------------------
def peer_python() -> tuple[str | None, str]:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        return None, f"no virtualenv at {PEER_VENV} (bench/sdk.py makes it)"
    probe = subprocess.run(
        [str(python), "-W", "ignore", "-c", "import s3torchconnector.dcp, torch; print(torch.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode != 0:
        return None, f"s3torchconnector.dcp does not import there: {probe.stderr.strip().splitlines()[-1]}"
    return str(python), probe.stdout.strip()


def run_ranks(python: str, spec_path: Path, client: str, round_: int, ranks: int, logs: Path) -> list[Any]:
    from pffs.testing.s3_server import free_ports

    port = free_ports(1)[0]
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}  # fmt: skip
        out = (logs / f"{client}-{round_}-{rank}.out").open("w")
        err = (logs / f"{client}-{round_}-{rank}.err").open("w")
        cmd = [python, "-W", "ignore", __file__, "--rank", str(spec_path), client, str(round_)]
        if PROFILE_DIR and rank == 0:  # py-spy's collapsed stacks of rank 0, idle threads included
            out_stacks = Path(PROFILE_DIR) / f"{client}-{round_}-{rank}.txt"
            cmd = ["py-spy", "record", "--idle", "--threads", "--rate", "200", "--format", "raw",
                   "-o", str(out_stacks), "--", *cmd]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
    try:
        for proc in procs:
            proc.wait(timeout=RANK_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        if proc.returncode != 0:
            tail = (logs / f"{client}-{round_}-{rank}.err").read_text()[-3000:]
            raise RuntimeError(f"{client} round {round_} rank {rank} exited {proc.returncode}:\n{tail}")
    lines = (logs / f"{client}-{round_}-0.out").read_text().strip().splitlines()
    return list(json.loads([line for line in lines if line.startswith("[")][-1]))  # py-spy prints too


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-per-rank", default="256M")
    parser.add_argument("--tensors", type=int, default=8, help="tensors per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--clients", default=",".join(CLIENTS), help="which to run (comma-separated)")
    args = parser.parse_args()
    size_per_rank = parse_size(args.size_per_rank)
    total_mb = size_per_rank * args.ranks / 1e6

    import s3fs

    from pffs.testing.s3_server import SeaweedS3

    chosen = args.clients.split(",")
    pythons: dict[str, str] = {c: sys.executable for c in CLIENTS if c != PEER and c in chosen}
    skipped: dict[str, str] = {}
    peer, peer_note = peer_python() if PEER in chosen else (None, "not chosen (--clients)")
    if peer is None:
        skipped[PEER] = peer_note
        log(f"{PEER} skipped: {peer_note}")
    else:
        pythons[PEER] = peer
    rounds: dict[str, list[list[Any]]] = {client: [] for client in pythons}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="pffs-bench-dcp-") as tmp, SeaweedS3(Path(tmp) / "s3") as s3:
        work = Path(tmp)
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
        raw.mkdir(BUCKET)
        for round_ in range(args.repeats):
            for client, python in pythons.items():
                if client in failures:
                    continue
                spec_path = work / f"spec-{client}-{round_}.json"
                spec_path.touch(mode=0o600)
                spec_path.write_text(json.dumps({
                    "endpoint_url": s3.endpoint_url, "key": s3.access_key, "secret": s3.secret_key,
                    "size_per_rank": size_per_rank, "tensors": args.tensors,
                    "cache_dir": str(work / f"cache-{client}-{round_}"),
                }))  # fmt: skip
                log(f"{client} round {round_}: {args.ranks} ranks x {args.size_per_rank}")
                try:
                    rounds[client].append(run_ranks(python, spec_path, client, round_, args.ranks, work))
                except RuntimeError as exc:
                    failures[client] = str(exc)
                    log(str(exc))
                with_prefix = f"{BUCKET}/{client}/{round_}"
                if raw.exists(with_prefix):
                    raw.rm(with_prefix, recursive=True)  # keep the server's disk small
    results = {}
    exact = True
    for client, runs in rounds.items():
        if not runs:
            continue
        keys = [k for k in runs[0][0] if k.endswith("_s")]
        medians = {k: statistics.median(run[0][k] for run in runs) for k in keys}
        ok = all(v for run in runs for rank in run for k, v in rank.items() if k.endswith("_exact"))
        exact = exact and ok
        results[client] = {
            **{k: round(v, 3) for k, v in medians.items()},
            **{k.removesuffix("_s") + "_MBps": round(total_mb / v, 1) for k, v in medians.items()},
            "exact": ok,
            "rounds": [run[0] for run in runs],
        }
    report = {
        "bench": "dcp",
        "command": " ".join([Path(sys.executable).name, "bench/dcp.py", *sys.argv[1:]]),
        "ranks": args.ranks,
        "size_per_rank": size_per_rank,
        "tensors_per_rank": args.tensors,
        "repeats": args.repeats,
        "results": results,
        "failed": failures,
        "skipped": skipped,
        "peer": {"python": pythons.get(PEER), "torch": peer_note if peer else None,
                 "note": "endpoint set by replacing S3StorageWriter/Reader.fs._client "
                         "(path-style, us-east-1)"},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dcp.json").write_text(json.dumps(report, indent=2) + "\n")
    chart(report, out / "dcp.png")
    header = ("client", "save s", "MB/s", "load cold/direct s", "MB/s", "warm s", "MB/s")
    print("{:18} {:>8} {:>7} {:>19} {:>7} {:>8} {:>7}".format(*header))
    for client, r in results.items():
        load = r.get("load_cold_s", r.get("load_direct_s"))
        load_mbps = r.get("load_cold_MBps", r.get("load_direct_MBps"))
        warm = r.get("load_warm_s", "-")
        warm_mbps = r.get("load_warm_MBps", "-")
        print(
            f"{client:18} {r['save_s']:8} {r['save_MBps']:7} {load:19} {load_mbps:7} {warm:>8} {warm_mbps:>7}"
        )
    for client, why in {**skipped, **failures}.items():
        print(f"{client}: not measured: {why.splitlines()[0]}")
    return 0 if exact and not (failures.keys() - {PEER}) else 1


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    phases = [("save", "save"), ("load (cold / direct)", "load_cold"), ("load (warm cache)", "load_warm")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(results))
    for i, (client, r) in enumerate(results.items()):
        values = []
        for _, key in phases:
            value = r.get(f"{key}_MBps")
            if value is None and key == "load_cold":
                value = r.get("load_direct_MBps")
            values.append(value or 0)
        bars = ax.bar([p + i * width for p in range(len(phases))], values, width, label=client)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([p + width * (len(results) - 1) / 2 for p in range(len(phases))], [p for p, _ in phases])
    ax.set_ylabel("MB/s (whole state dict)")
    mb = report["ranks"] * report["size_per_rank"] / 1e6
    ax.set_title(f"torch.distributed.checkpoint, {report['ranks']} ranks, {mb:.0f} MB, local SeaweedFS")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
