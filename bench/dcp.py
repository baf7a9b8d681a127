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

Then, in the same run, one torch.save of --save-size bytes (8 tensors) per round by each of (a process of
its own each, checked after the clock stops by loading what the store holds):

    local_disk       torch.save to a local file (page cache, no fsync): what a training job sees locally
    pffs_save        pffs.torch.save to s3:// (uploaded while torch.save writes)
    peer_checkpoint  s3torchconnector's S3Checkpoint writer (client made before the clock)
    mount            torch.save onto a read-write pffs mount of s3://dcp-bench/mount: the writes, then the
                     close that uploads (both timed); once more under strace, untimed, for the sizes of the
                     WRITE requests the kernel sends the mount
    upload_only      the ceiling: the same bytes, written to disk beforehand, uploaded by pffs's S3 client
    upload_only_2x   the DCP ceiling: two files of --size-per-rank uploaded at once (as two ranks do)

--clients picks some of all these. PFFS_BENCH_PROFILE=<folder> runs rank 0 and each save under py-spy
(collapsed stacks, idle threads included; slower).

Writes bench/results/dcp.json and bench/results/dcp.png, and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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


# -- one torch.save of one state dict (runs in the client's python) -----------------------------------------
SAVERS = ("local_disk", "pffs_save", "peer_checkpoint", "mount", "upload_only", "upload_only_2x")


def save_main(spec_path: str, client: str, round_: int) -> None:
    """One save of --save-size bytes of tensors by `client`, timed; prints one JSON line. The bytes are
    checked after the clock stops: the object read back (s3fs, or the peer's own reader) against the
    state dict saved."""
    import io

    import torch

    spec = json.loads(Path(spec_path).read_text())
    count = spec["tensors"]
    g = torch.Generator().manual_seed(round_)
    size = spec["size_per_rank"] if client == "upload_only_2x" else spec["save_size"]
    state = {f"t{i}": torch.randn(size // 4 // count, generator=g) for i in range(count)}
    key = f"save/{client}/{round_}.pt"
    url = f"s3://{BUCKET}/{key}"
    result: dict[str, Any] = {}
    if client == "peer_checkpoint":
        os.environ.update(AWS_ACCESS_KEY_ID=spec["key"], AWS_SECRET_ACCESS_KEY=spec["secret"],
                          AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        checkpoint = S3Checkpoint(PEER_REGION, spec["endpoint_url"], S3ClientConfig(force_path_style=True))
        start = time.perf_counter()
        with checkpoint.writer(url) as writer:
            torch.save(state, writer)
        result["save_s"] = time.perf_counter() - start
        with checkpoint.reader(url) as reader:
            back = torch.load(io.BytesIO(reader.read()))
        result["exact"] = all(torch.equal(back[k], state[k]) for k in state)
        print(json.dumps(result))
        return

    import s3fs

    raw = s3fs.S3FileSystem(
        skip_instance_cache=True,
        use_listings_cache=False,
        key=spec["key"],
        secret=spec["secret"],
        client_kwargs={"endpoint_url": spec["endpoint_url"]},
    )
    s3 = {"endpoint_url": spec["endpoint_url"], "key": spec["key"], "secret": spec["secret"]}
    local = Path(spec["work"]) / f"local-{client}-{round_}.pt"
    if client == "local_disk":  # torch.save's own file, in the page cache (no fsync), as a training job
        start = time.perf_counter()
        torch.save(state, local)
        result["save_s"] = time.perf_counter() - start
        back = torch.load(local)
        local.unlink()
    elif client == "pffs_save":
        import pffs.torch

        start = time.perf_counter()
        pffs.torch.save(state, url, **s3, cache_dir=spec["cache_dir"])
        result["save_s"] = time.perf_counter() - start
        back = torch.load(io.BytesIO(raw.cat_file(f"{BUCKET}/{key}")))
    elif client == "mount":  # the mount's files: torch.save's writes, then the close that uploads
        target = Path(spec["mountpoint"]) / f"{client}-{round_}.pt"
        start = time.perf_counter()
        f = target.open("wb")
        torch.save(state, f)
        f.flush()
        result["write_s"] = time.perf_counter() - start
        f.close()
        result["save_s"] = time.perf_counter() - start
        result["close_s"] = result["save_s"] - result["write_s"]
        back = torch.load(io.BytesIO(raw.cat_file(f"{BUCKET}/mount/{client}-{round_}.pt")))
    else:  # the upload alone: the file written beforehand (untimed), put by pffs's S3 client, one or two
        from concurrent.futures import ThreadPoolExecutor

        from pffs.backends.options import BackendOptions
        from pffs.backends.urls import open_backend

        copies = 2 if client == "upload_only_2x" else 1  # as two DCP ranks do at once
        torch.save(state, local)
        options = BackendOptions(endpoint_url=spec["endpoint_url"], access_key_id=spec["key"],
                                 secret_access_key=spec["secret"])  # fmt: skip
        backends = [open_backend(url, options)[0] for _ in range(copies)]
        start = time.perf_counter()
        with ThreadPoolExecutor(copies) as pool:
            list(pool.map(lambda i: backends[i].upload(str(local), f"{BUCKET}/{key}.{i}"), range(copies)))
        result["save_s"] = time.perf_counter() - start
        expected = hashlib.sha256(local.read_bytes()).hexdigest()
        result["exact"] = all(
            hashlib.sha256(raw.cat_file(f"{BUCKET}/{key}.{i}")).hexdigest() == expected for i in range(copies)
        )
        local.unlink()
        print(json.dumps(result))
        return
    result["exact"] = all(torch.equal(back[k], state[k]) for k in state)
    print(json.dumps(result))


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


def run_saver(python: str, spec_path: Path, client: str, round_: int, logs: Path) -> dict[str, Any]:
    err = logs / f"save-{client}-{round_}.err"
    cmd = [python, "-W", "ignore", __file__, "--save", str(spec_path), client, str(round_)]
    if PROFILE_DIR:
        out_stacks = Path(PROFILE_DIR) / f"save-{client}-{round_}.txt"
        cmd = ["py-spy", "record", "--idle", "--threads", "--rate", "200", "--format", "raw",
               "-o", str(out_stacks), "--", *cmd]  # fmt: skip
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                          stderr=err.open("w"), text=True, timeout=RANK_TIMEOUT_S, check=False)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"save {client} round {round_} exited {done.returncode}:\n{err.read_text()[-3000:]}"
        )
    return dict(json.loads(lines[-1]))


def start_mount(s3: Any, work: Path) -> tuple[Path, dict[str, str]]:
    """A read-write pffs mount of s3://dcp-bench/mount, its cache in the run's folder."""
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    pffs = str(Path(sys.executable).parent / "pffs")
    subprocess.run([pffs, "mount", f"s3://{BUCKET}/mount", str(mountpoint), "--cache-dir",
                    str(work / "mount-cache"), "--endpoint-url", s3.endpoint_url],
                   check=True, env=env, timeout=120)  # fmt: skip
    return mountpoint, env


def fuse_write_sizes(mountpoint: Path, spec_path: Path, logs: Path) -> dict[str, Any]:
    """What the kernel hands the mount for one torch.save onto it (untimed: under strace): the sizes of
    the requests the mount reads from /dev/fuse while the file is written, and their count."""
    pid = int(os.getxattr(mountpoint, "user.pffs.pid"))
    fuse_fds = {fd.name for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd) == "/dev/fuse"}
    trace = logs / "mount-strace.txt"
    spy = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=read", "-e", "read=none", "-s", "0",
                            "-o", str(trace), "-p", str(pid)])  # fmt: skip
    time.sleep(1.0)  # attached
    try:
        run_saver(sys.executable, spec_path, "mount", 99, logs)
    finally:
        spy.terminate()
        spy.wait(timeout=60)
    sizes: dict[int, int] = {}
    for line in trace.read_text().splitlines():
        parts = line.split("read(", 1)
        if len(parts) < 2 or parts[1].split(",", 1)[0] not in fuse_fds or "= " not in parts[1]:
            continue
        size = int(parts[1].rsplit("= ", 1)[1].split()[0]) if parts[1].rsplit("= ", 1)[1][0].isdigit() else 0
        if size > 4096:  # WRITE requests carrying data (header 80 bytes)
            sizes[size - 80] = sizes.get(size - 80, 0) + 1
    total = sum(size * n for size, n in sizes.items())
    return {"write_requests": sum(sizes.values()), "bytes": total,
            "by_size": {str(k): v for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:5]}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-per-rank", default="256M")
    parser.add_argument("--tensors", type=int, default=8, help="tensors per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--clients", default=",".join(CLIENTS + SAVERS), help="which to run (comma-separated)"
    )
    parser.add_argument("--save-size", default="200M", help="bytes of the single-process torch.save")
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
    savers = {c: sys.executable for c in SAVERS if c in chosen}
    if "peer_checkpoint" in savers:
        if peer is None:
            del savers["peer_checkpoint"]
            skipped["peer_checkpoint"] = peer_note
        else:
            savers["peer_checkpoint"] = peer
    rounds: dict[str, list[list[Any]]] = {client: [] for client in pythons}
    saves: dict[str, list[dict[str, Any]]] = {client: [] for client in savers}
    failures: dict[str, str] = {}
    fuse_writes: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pffs-bench-dcp-"))
        s3 = stack.enter_context(SeaweedS3(Path(tmp) / "s3"))
        work = Path(tmp)
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
        raw.mkdir(BUCKET)
        save_spec = work / "spec-save.json"
        save_spec.touch(mode=0o600)
        spec = {"endpoint_url": s3.endpoint_url, "key": s3.access_key, "secret": s3.secret_key,
                "size_per_rank": size_per_rank, "save_size": parse_size(args.save_size),
                "tensors": args.tensors, "cache_dir": str(work / "cache-save"),
                "work": str(work)}  # fmt: skip
        if "mount" in savers:
            raw.pipe(f"{BUCKET}/mount/.keep", b"")
            mountpoint, _ = start_mount(s3, work)
            pffs_cli = str(Path(sys.executable).parent / "pffs")
            stack.callback(subprocess.run, [pffs_cli, "umount", str(mountpoint)], check=False, timeout=120)
            spec["mountpoint"] = str(mountpoint)
        save_spec.write_text(json.dumps(spec))
        for round_ in range(args.repeats):
            for client, python in savers.items():
                if client in failures:
                    continue
                size = f"2 x {args.size_per_rank}" if client == "upload_only_2x" else args.save_size
                log(f"save {client} round {round_}: {size}")
                try:
                    saves[client].append(run_saver(python, save_spec, client, round_, work))
                except RuntimeError as exc:
                    failures[client] = str(exc)
                    log(str(exc))
                if raw.exists(f"{BUCKET}/save"):
                    raw.rm(f"{BUCKET}/save", recursive=True)
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
        if "mount" in savers and "mount" not in failures:
            log("save mount under strace: the sizes of the writes the kernel sends the mount")
            fuse_writes = fuse_write_sizes(Path(spec["mountpoint"]), save_spec, work)
    exact = True
    save_results = {}
    for client, runs in saves.items():
        if not runs:
            continue
        mb = (2 * size_per_rank if client == "upload_only_2x" else parse_size(args.save_size)) / 1e6
        keys = [k for k in runs[0] if k.endswith("_s")]
        medians = {k: statistics.median(run[k] for run in runs) for k in keys}
        ok = all(run["exact"] for run in runs)
        exact = exact and ok
        save_results[client] = {
            **{k: round(v, 3) for k, v in medians.items()},
            "save_MBps": round(mb / medians["save_s"], 1),
            "MB": round(mb, 1),
            "exact": ok,
            "rounds": runs,
        }
    results = {}
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
        "save_size": parse_size(args.save_size),
        "saves": save_results,
        "mount_fuse_writes": fuse_writes,
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
    print(f"\none torch.save of {args.save_size} (upload_only_2x: 2 x {args.size_per_rank} at once)")
    for client, r in save_results.items():
        extra = f"  (writes {r['write_s']} s, close {r['close_s']} s)" if "close_s" in r else ""
        print(f"{client:18} {r['save_s']:8} s {r['save_MBps']:7} MB/s exact={r['exact']}{extra}")
    if fuse_writes:
        print(f"mount: {fuse_writes}")
    for client, why in {**skipped, **failures}.items():
        print(f"{client}: not measured: {why.splitlines()[0]}")
    return 0 if exact and not (failures.keys() - {PEER}) else 1


def chart(report: dict[str, Any], path: Path) -> None:
    """Two panels: the DCP save and loads per client; one torch.save per saver, with the ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, saves = report["results"], report.get("saves") or {}
    phases = [("save", "save"), ("load (cold / direct)", "load_cold"), ("load (warm cache)", "load_warm")]
    fig, axes = plt.subplots(1, 2 if saves else 1, figsize=(15 if saves else 9, 4.5), squeeze=False)
    ax = axes[0][0]
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
    ax.legend(fontsize=8)
    if saves:
        ax = axes[0][1]
        names = list(saves)
        bars = ax.bar(range(len(names)), [saves[n]["save_MBps"] for n in names], color="tab:gray")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
        ax.set_ylabel("MB/s")
        save_mb = report["save_size"] / 1e6
        ax.set_title(f"one torch.save of {save_mb:.0f} MB (upload_only_2x: 2 x {mb / 2:.0f} MB at once)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--save":
        save_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
