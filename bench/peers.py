"""Cache groups: N nodes reading one dataset cold at the same time, sharing off and on.

    .venv/bin/python bench/peers.py                                        # 256 MiB file + 500 x 128 KiB
    .venv/bin/python bench/peers.py --large-size 64M --small-count 100     # quick run

One local SeaweedFS holds the dataset. Each "node" is a process of its own: the pffs SDK with its own cache
directory and, with sharing on, its own listener on an address of its own (127.0.0.N+1), every node a
member of the group. For N = 1, 2 and 3, sharing off (no group) and on, the N nodes start together and
each reads the whole dataset once, as a job's first epoch does: the large file in 4 MiB reads, then the
small files by 8 threads; every byte is checked by sha256. Per run: each node's MB/s (wall time of its
epoch), the bytes all nodes fetched from the backend, the bytes they got from members, and their CPU
seconds. The ceiling: one loopback TCP stream's MB/s on this machine, measured in the same run (what a
member's answers travel over). A node keeps serving after its epoch until every node has finished.
Then the transport alone: a member that read the whole dataset serves all of it to a consume-only member
(the reader's MB/s against the loopback stream, and against its own first read from S3).

Writes bench/results/peers.json and bench/results/peers.png (--out-dir), and prints a table.
Exit code 1 if a read did not match its sha256 or a node failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MB = 1_000_000
CHUNK = 4 << 20
THREADS = 8
BUCKET = "peers-bench"
RESULT = "NODE_RESULT "


def log(message: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


# -- a node (its own process) --------------------------------------------------------------------------------
def run_node(spec_path: str) -> int:
    import fsspec

    spec = json.loads(Path(spec_path).read_text())
    group = {}
    if spec["members"]:
        group = {
            "peers": ",".join(spec["members"]),
            "peer_listen": spec["listen"],
            "peer_token": spec["token"],
        }
    fs = fsspec.filesystem(
        "pffs",
        target=f"s3://{BUCKET}",
        cache_dir=spec["cache_dir"],
        skip_instance_cache=True,
        key=spec["key"],
        secret=spec["secret"],
        endpoint_url=spec["endpoint_url"],
        **group,
    )
    names = sorted(spec["small"])
    fs.ls("small")  # outside the clock: one listing, as a training job's dataset index
    while time.time() < spec["start_at"]:
        time.sleep(0.005)
    cpu, wall = os.times(), time.perf_counter()
    large = hashlib.sha256()
    with fs.open("large.bin", "rb") as f:
        while chunk := f.read(CHUNK):
            large.update(chunk)
    with ThreadPoolExecutor(THREADS) as pool:
        small = list(pool.map(lambda n: hashlib.sha256(fs.cat(f"small/{n}")).hexdigest(), names))
    wall = time.perf_counter() - wall
    after = os.times()
    verified = large.hexdigest() == spec["large_sha256"] and small == [spec["small"][n] for n in names]
    counts = fs.vfs.cache.stats.snapshot()
    peers = fs.peers.counts.snapshot() if fs.peers is not None else {}
    total = spec["large_size"] + spec["small_size"] * len(names)
    result = {
        "seconds": round(wall, 3),
        "mb_per_s": round(total / MB / wall, 1),
        "cpu_seconds": round(after.user - cpu.user + after.system - cpu.system, 3),
        "bytes_fetched": counts.get("bytes_fetched", 0),
        "bytes_from_peers": peers.get("fetched_bytes", 0),
        "peer_failures": peers.get("failures", 0),
        "backend_gets": backend_gets(fs),
        "verified": verified,
    }
    print(RESULT + json.dumps(result), flush=True)
    sys.stdin.read()  # serve the other members until the bench closes our stdin
    if fs.peers is not None:  # what it fetched for the others after its own epoch counts too
        result["bytes_served"] = fs.peers.counts.snapshot().get("served_bytes", 0)
        result["bytes_fetched"] = fs.vfs.cache.stats.snapshot().get("bytes_fetched", 0)
        result["backend_gets"] = backend_gets(fs)
        print(RESULT + json.dumps(result), flush=True)
    return 0


def backend_gets(fs: Any) -> int:
    return int(fs.vfs.backend.requests.snapshot()["get"]["requests"])


# -- the bench ---------------------------------------------------------------------------------------------
def loopback_ceiling(size: int = 1 << 30) -> float:
    """MB/s of one TCP stream over loopback (sendall of 1 MiB buffers, recv_into)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        buf = bytearray(1 << 20)
        with conn:
            while n := conn.recv_into(buf):
                received[0] += n

    thread = threading.Thread(target=sink)
    thread.start()
    payload = os.urandom(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as client:
        started = time.perf_counter()
        for _ in range(size // len(payload)):
            client.sendall(payload)
    thread.join()
    seconds = time.perf_counter() - started
    server.close()
    return round(received[0] / MB / seconds, 1)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_node(base: dict[str, Any], workdir: Path, name: str, **spec: Any) -> subprocess.Popen[str]:
    """A node's process, reading the dataset at `start_at`; its result is a RESULT line on its stdout."""
    path = workdir / f"node-{name}.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps({**base, "cache_dir": str(workdir / f"cache-{name}"), **spec}))
    return subprocess.Popen(
        [sys.executable, __file__, "--node", str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def first_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(RESULT):
        raise RuntimeError(f"a node failed (exit {proc.poll()})")
    return dict(json.loads(line.removeprefix(RESULT)))


def run_group(base: dict[str, Any], workdir: Path, nodes: int, sharing: bool, run: int) -> dict[str, Any]:
    token = secrets.token_hex(32)
    hosts = [f"127.0.0.{i + 2}" for i in range(nodes)]
    members = [f"{h}:{free_port(h)}" for h in hosts] if sharing else []
    start_at = time.time() + 3.0
    procs = [
        start_node(
            base,
            workdir,
            f"{run}-{nodes}-{int(sharing)}-{i}",
            members=members,
            listen=members[i] if sharing else None,
            token=token,
            start_at=start_at,
        )
        for i in range(nodes)
    ]
    results: list[dict[str, Any]] = []
    try:
        for proc in procs:  # each node's epoch result, then everyone may stop serving
            results.append(first_result(proc))
        for i, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=60)
            lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
            if lines:
                results[i] = json.loads(lines[-1].removeprefix(RESULT))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return {
        "nodes": nodes,
        "sharing": sharing,
        "per_node": results,
        "mb_per_s_per_node": round(sum(r["mb_per_s"] for r in results) / nodes, 1),
        "backend_bytes": sum(r["bytes_fetched"] - r["bytes_from_peers"] for r in results),
        "peer_bytes": sum(r["bytes_from_peers"] for r in results),
        "backend_gets": sum(r["backend_gets"] for r in results),
        "cpu_seconds": round(sum(r["cpu_seconds"] for r in results), 2),
        "peer_failures": sum(r["peer_failures"] for r in results),
        "verified": all(r["verified"] for r in results),
    }


def run_transport(base: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The transport alone: a member whose cache holds the whole dataset (it read it first) serves all of
    it to a consume-only member, whose every block then comes from the group."""
    token = secrets.token_hex(32)
    owner = f"127.0.0.2:{free_port('127.0.0.2')}"
    procs = [
        start_node(base, workdir, "transport-owner", members=[owner], listen=owner, token=token, start_at=0)
    ]
    try:
        warm = first_result(procs[0])
        procs.append(
            start_node(
                base, workdir, "transport-reader", members=[owner], listen=None, token=token, start_at=0
            )
        )
        reader = first_result(procs[1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"owner_cold": warm, "reader_from_group": reader}


def write_dataset(s3: Any, args: argparse.Namespace) -> dict[str, Any]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
    fs.mkdir(BUCKET)
    large = os.urandom(args.large_size)
    small = {f"{i:05d}.bin": os.urandom(args.small_size) for i in range(args.small_count)}
    fs.pipe({f"{BUCKET}/large.bin": large, **{f"{BUCKET}/small/{n}": d for n, d in small.items()}})
    return {
        "endpoint_url": s3.endpoint_url,
        "key": s3.access_key,
        "secret": s3.secret_key,
        "large_size": args.large_size,
        "large_sha256": hashlib.sha256(large).hexdigest(),
        "small_size": args.small_size,
        "small": {n: hashlib.sha256(d).hexdigest() for n, d in small.items()},
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (speed, fetched) = plt.subplots(1, 2, figsize=(11, 4))
    for sharing, color in ((False, "tab:gray"), (True, "tab:green")):
        picked = [r for r in runs if r["sharing"] == sharing]
        label = "sharing on" if sharing else "sharing off"
        xs = [r["nodes"] + (0.18 if sharing else -0.18) for r in picked]
        speed.bar(xs, [r["mb_per_s_per_node"] for r in picked], width=0.35, color=color, label=label)
        fetched.bar(xs, [r["backend_bytes"] / MB for r in picked], width=0.35, color=color, label=label)
    speed.axhline(report["loopback_ceiling_mb_s"], color="black", linestyle=":", linewidth=1)
    speed.set_title("each node's first epoch, MB/s (dotted: one loopback TCP stream)", fontsize=9)
    fetched.set_title("MB fetched from the backend, all nodes", fontsize=9)
    for ax in (speed, fetched):
        ax.set_xlabel("nodes")
        ax.set_xticks([1, 2, 3])
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-size", type=size_arg, default=256 << 20, help="the large file (256M)")
    parser.add_argument("--small-count", type=int, default=500, help="small files (500)")
    parser.add_argument("--small-size", type=size_arg, default=128 << 10, help="each small file (128K)")
    parser.add_argument("--max-nodes", type=int, default=3, help="largest group (3)")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument("--node", help=argparse.SUPPRESS)  # internal: run one node
    args = parser.parse_args()
    if args.node:
        return run_node(args.node)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pffs.testing.s3_server import SeaweedS3

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="pffs-peers-") as tmp, SeaweedS3(Path(tmp) / "s3") as s3:
        workdir = Path(tmp)
        base = write_dataset(s3, args)
        ceiling = loopback_ceiling()
        log(f"loopback, one TCP stream: {ceiling} MB/s")
        runs = []
        for run, (nodes, sharing) in enumerate(
            (n, s) for n in range(1, args.max_nodes + 1) for s in (False, True) if n > 1 or not s
        ):
            result = run_group(base, workdir, nodes, sharing, run)
            runs.append(result)
            log(
                f"{nodes} node(s), sharing {'on' if sharing else 'off'}: {result['mb_per_s_per_node']} MB/s "
                f"per node, {result['backend_bytes'] / MB:.0f} MB from the backend, "
                f"{result['peer_bytes'] / MB:.0f} MB from members ({'ok' if result['verified'] else 'BAD'})"
            )
        transport = run_transport(base, workdir)
        log(
            f"transport: a consume-only member read the dataset from a warm member at "
            f"{transport['reader_from_group']['mb_per_s']} MB/s (its first read from S3: "
            f"{transport['owner_cold']['mb_per_s']} MB/s)"
        )
    dataset_bytes = args.large_size + args.small_size * args.small_count
    block = 4 << 20  # the SDK's default block size
    dataset_blocks = -(-args.large_size // block) + args.small_count * -(-args.small_size // block)
    report = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_seconds": round(time.time() - started, 1),
        "nproc": os.cpu_count(),
        "dataset_bytes": dataset_bytes,
        "dataset_blocks": dataset_blocks,
        "loopback_ceiling_mb_s": ceiling,
        "runs": runs,
        "transport": transport,
        "verified": all(r["verified"] for r in runs) and transport["reader_from_group"]["verified"],
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "peers.png")
    print(
        f"\n{'nodes':>5} {'sharing':>7} {'MB/s/node':>9} {'backend MB':>10} {'x dataset':>9} {'peers MB':>8} "
        f"{'GETs':>6} {'x blocks':>8}"
    )
    for r in runs:
        print(
            f"{r['nodes']:>5} {'on' if r['sharing'] else 'off':>7} {r['mb_per_s_per_node']:>9} "
            f"{r['backend_bytes'] / MB:>10.0f} {r['backend_bytes'] / dataset_bytes:>9.2f} "
            f"{r['peer_bytes'] / MB:>8.0f} {r['backend_gets']:>6} {r['backend_gets'] / dataset_blocks:>8.2f}"
        )
    reader = transport["reader_from_group"]
    print(
        f"transport: {reader['mb_per_s']} MB/s from a warm member ({reader['mb_per_s'] / ceiling:.2f} of one "
        f"loopback TCP stream, {reader['backend_gets']} GETs); the same node from S3 cold: "
        f"{transport['owner_cold']['mb_per_s']} MB/s"
    )
    print(f"loopback ceiling (one TCP stream): {ceiling} MB/s; all reads verified: {report['verified']}")
    print(f"wrote {out / 'peers.json'} and {out / 'peers.png'}")
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
