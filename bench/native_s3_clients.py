"""S3 clients for pffs's native core, measured side by side (issue 44: "Candidates: object_store, ..., or
the AWS CRT client that Mountpoint uses; measure before you choose"): cold GETs from one local SeaweedFS,
8 threads, every byte checked.

    .venv/bin/python bench/native_s3_clients.py                 # 2000 x 128 KiB, 8 x 64 MiB; 3 rounds
    .venv/bin/python bench/native_s3_clients.py --cold-build    # also time each Rust client's cold build
    .venv/bin/python bench/native_s3_clients.py --small-count 200 --large-size 16M --repeats 1 \
        --out /tmp/q.json                                       # a quick run

Clients (each runs in a process of its own, which reports the wall and the user + system CPU seconds of its
GETs alone, from getrusage, every thread):
    rust_hand          bench/native_s3/ `--client hand`: std::net::TcpStream, one keep-alive HTTP/1.1
                       connection per OS thread, SigV4 with hmac + sha2, the body read straight into its
                       buffer (pffs/backends/s3_native.py's design, in Rust)
    rust_object_store  bench/native_s3/ `--client object_store`: the Arrow project's object_store (aws
                       feature: reqwest, hyper, rustls) on a multi-thread tokio runtime with 8 workers and
                       8 tasks, each body's chunks copied into its buffer
    py_pffs            pffs's client, pffs.backends.s3_native.NativeS3Getter, 8 threads: since issue 44's
                       native S3 step its GETs over http are the native core's (s3_get.rs, called from
                       Python with the GIL released)
    py_pffs_sockets    the same with native_http=False: its Python sockets (what https still uses, and
                       what every GET was before)
    py_botocore        botocore's get_object (boto3's client is botocore's), 8 threads, the body read whole
The AWS CRT client (mountpoint-s3-client) is not built: its -sys crate generates its bindings with bindgen,
which needs libclang, and this machine has none (docs/design/native_s3_clients.md says more).

Workloads, uploaded once (seeded random bytes) before the first round:
    small         --small-count objects of --small-size, each read whole in one GET (a Range of all of it)
    large_whole   --large-count objects of --large-size, each read whole in one GET
    large_ranged  the same objects in --range ranges (8 MiB: 64 GETs for 8 x 64 MiB)
Every body is received into a buffer allocated and touched before the clock starts (botocore returns its own
bytes), and its sha256 is checked against the upload's after the clock stops: a client that returns one
wrong byte is refused (its figures are not reported; exit 1). Rounds are interleaved (round 1 of every
client and workload, then round 2, ...) and medians reported. The server runs on the same cores as the
clients, so throughput is capped by it (and by whatever else the machine runs): its CPU per object over
each client's run is reported beside the client's, and a client's own CPU per object (or per GiB) is the
figure that compares clients.

The Rust binary is built with `nice -n 19 cargo build --release --locked` into one target directory per
client under $CARGO_TARGET_DIR (default ~/.cache/pffs-tools/cargo-target-bench), so each client's build time
and crate count are its own; --cold-build empties that directory first (crates already downloaded are not
downloaded again: the time is compiling). Crates: `cargo tree -e normal,build` of the binary with the
client's feature, the harness's own (libc, sha2) included.

Writes bench/results/native_s3_clients.json and .png and prints a table. SeaweedFS (pffs.testing.s3_server)
listens on 127.0.0.1 only and is stopped, with every client process, on any exit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CRATE = HERE / "native_s3"
RESULTS = HERE / "results"
BUCKET = "bench-data"
REGION = "us-east-1"
MiB = 1 << 20
GiB = 1 << 30
RUST_CLIENTS = {"rust_hand": "hand", "rust_object_store": "object_store"}  # name -> cargo feature
PY_CLIENTS = ("py_pffs", "py_pffs_sockets", "py_botocore")
CLIENTS = (*RUST_CLIENTS, *PY_CLIENTS)
WORKLOADS = ("small", "large_whole", "large_ranged")
UNITS = {
    "objects_per_s": "objects/s",
    "mib_per_s": "MiB/s",
    "cpu_ms_per_object": "CPU ms per object",
    "cpu_s_per_gib": "CPU s per GiB",
}
RUN_TIMEOUT_S = 600.0
BUILD_TIMEOUT_S = 1800.0
SEED = 20261128
Result = dict[str, Any]
Job = tuple[str, int, int]  # key, first byte, length


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def size_arg(text: str) -> int:
    """128K, 64M, 1G or a number of bytes."""
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(match[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[match[2]]


# -- the request every client reads on stdin, and the Python clients ----------------------------------------
def request_text(endpoint: str, key: str, secret: str, threads: int, jobs: list[Job]) -> str:
    head = [f"endpoint {endpoint}", f"bucket {BUCKET}", f"access_key {key}", f"secret_key {secret}"]
    head += [f"region {REGION}", f"threads {threads}"]
    return "\n".join(head + [f"job {k} {start} {length}" for k, start, length in jobs]) + "\n"


def parse_request(text: str) -> tuple[dict[str, str], list[Job]]:
    spec: dict[str, str] = {}
    jobs: list[Job] = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "job":
            jobs.append((words[1], int(words[2]), int(words[3])))
        else:
            spec[words[0]] = words[1]
    return spec, jobs


def touched(length: int) -> bytearray:
    """A buffer whose pages are mapped before the clock starts (as a cache's blocks already are)."""
    buffer = bytearray(length)
    buffer[::4096] = b"\1" * len(range(0, length, 4096))
    return buffer


def py_phase(client: str) -> int:
    """One Python client's run: the request on stdin, one line of JSON (as s3get prints) on stdout."""
    spec, jobs = parse_request(sys.stdin.read())
    threads = int(spec["threads"])
    buffers = [touched(length) for _, _, length in jobs]
    if client in ("py_pffs", "py_pffs_sockets"):
        from pffs.backends.s3_native import Credentials, NativeS3Getter

        creds = Credentials(spec["access_key"], spec["secret_key"])
        base = spec["endpoint"].rstrip("/")
        getter = NativeS3Getter(
            lambda bucket: f"{base}/{bucket}/",
            REGION,
            lambda: creds,
            10.0,
            60.0,
            native_http=client == "py_pffs",
        )

        def get(i: int) -> bytes | bytearray:
            key, start, _ = jobs[i]
            getter.get(spec["bucket"], key, start, memoryview(buffers[i]))
            return buffers[i]

    elif client == "py_botocore":
        import botocore.config
        import botocore.session

        config = botocore.config.Config(max_pool_connections=threads, retries={"max_attempts": 1})
        s3 = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=spec["endpoint"],
            region_name=REGION,
            aws_access_key_id=spec["access_key"],
            aws_secret_access_key=spec["secret_key"],
            config=config,
        )

        def get(i: int) -> bytes | bytearray:
            key, start, length = jobs[i]
            answer = s3.get_object(
                Bucket=spec["bucket"], Key=key, Range=f"bytes={start}-{start + length - 1}"
            )
            return bytes(answer["Body"].read())

    else:
        raise SystemExit(f"unknown client {client!r}")
    with ThreadPoolExecutor(threads) as pool:
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        bodies = list(pool.map(get, range(len(jobs))))
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    answer = {
        "client": client,
        "threads": threads,
        "objects": len(jobs),
        "bytes": sum(len(b) for b in bodies),
        "wall_seconds": wall,
        "user_seconds": after.ru_utime - before.ru_utime,
        "system_seconds": after.ru_stime - before.ru_stime,
        "sha256": [hashlib.sha256(b).hexdigest() for b in bodies],
    }
    print(json.dumps(answer))
    return 0


# -- the Rust side: builds and crate counts ------------------------------------------------------------------
def target_root() -> Path:
    default = Path.home() / ".cache" / "pffs-tools" / "cargo-target-bench"
    return Path(os.environ.get("CARGO_TARGET_DIR") or default)


def build(feature: str, cold: bool) -> Result:
    """s3get with one client's feature, in that client's own target directory: its path, the build's wall
    seconds, whether it was cold, and the crates in its tree."""
    target = target_root() / feature
    if cold and target.exists():
        shutil.rmtree(target)
    was_cold = not (target / "release").exists()
    command = ["nice", "-n", "19", "cargo", "build", "--release", "--locked", "--features", feature]
    command += ["--manifest-path", str(CRATE / "Cargo.toml"), "--target-dir", str(target)]
    log(f"building s3get --features {feature} ({'cold' if was_cold else 'incremental'})")
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"cargo build --features {feature} failed:\n{done.stderr[-3000:]}")
    binary = target / "release" / "s3get"
    return {
        "binary": str(binary),
        "build_seconds": round(seconds, 1),
        "build_cold": was_cold,
        "binary_bytes": binary.stat().st_size,
        "crates": crate_count(feature),
        "crates_harness": crate_count(None),
    }


def crate_count(feature: str | None) -> int:
    """Crates compiled into s3get (normal and build dependencies, each name and version once)."""
    command = ["cargo", "tree", "--locked", "-e", "normal,build", "--prefix", "none"]
    command += ["--manifest-path", str(CRATE / "Cargo.toml")]
    if feature:
        command += ["--features", feature]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    crates = {" ".join(line.split()[:2]) for line in done.stdout.splitlines() if line.strip()}
    return len({c for c in crates if not c.startswith("native-s3-bench ")})


def crate_version(name: str) -> str:
    lock = (CRATE / "Cargo.lock").read_text()
    match = re.search(rf'name = "{re.escape(name)}"\nversion = "([^"]+)"', lock)
    return match[1] if match else "?"


# -- the run -------------------------------------------------------------------------------------------------
def upload(server: Any, args: argparse.Namespace) -> tuple[dict[str, list[Job]], dict[str, list[str]]]:
    """The workloads' objects, written with 8 threads: per workload its jobs and their bodies' sha256."""
    import botocore.session

    s3 = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=REGION,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
    )
    s3.create_bucket(Bucket=BUCKET)
    rng = random.Random(SEED)
    small = [(f"small/{n:05d}.bin", rng.randbytes(args.small_size)) for n in range(args.small_count)]
    jobs: dict[str, list[Job]] = {w: [] for w in WORKLOADS}
    digests: dict[str, list[str]] = {w: [] for w in WORKLOADS}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3.put_object(Bucket=BUCKET, Key=kv[0], Body=kv[1]), small))
        for key, data in small:
            jobs["small"].append((key, 0, len(data)))
            digests["small"].append(hashlib.sha256(data).hexdigest())
        del small
        for n in range(args.large_count):
            key, data = f"large/{n}.bin", rng.randbytes(args.large_size)
            # A multipart upload of 8 MiB parts, as large objects are written in practice.
            multipart = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
            offsets = range(0, len(data), 8 * MiB)

            def part(
                i: int, key: str = key, data: bytes = data, upload: str = multipart, offsets: range = offsets
            ) -> dict[str, Any]:
                body = data[offsets[i] : offsets[i] + 8 * MiB]
                answer = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=i + 1, Body=body)
                return {"PartNumber": i + 1, "ETag": answer["ETag"]}

            parts = list(pool.map(part, range(len(offsets))))
            s3.complete_multipart_upload(
                Bucket=BUCKET, Key=key, UploadId=multipart, MultipartUpload={"Parts": parts}
            )
            jobs["large_whole"].append((key, 0, len(data)))
            digests["large_whole"].append(hashlib.sha256(data).hexdigest())
            for start in range(0, len(data), args.range):
                piece = data[start : start + args.range]
                jobs["large_ranged"].append((key, start, len(piece)))
                digests["large_ranged"].append(hashlib.sha256(piece).hexdigest())
    return jobs, digests


def run_client(client: str, binary: str | None, request: str) -> Result:
    if binary is not None:
        command = [binary, "--client", RUST_CLIENTS[client]]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--phase", client]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(
        command, input=request, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (every thread), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(answer: Result) -> Result:
    cpu = answer["user_seconds"] + answer["system_seconds"]
    wall, count, size = answer["wall_seconds"], answer["objects"], answer["bytes"]
    return {
        "objects_per_s": count / wall,
        "mib_per_s": size / MiB / wall,
        "cpu_ms_per_object": 1000 * cpu / count,
        "cpu_s_per_gib": cpu / (size / GiB),
        "cpu_cores": cpu / wall,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "system_seconds": answer["system_seconds"],
    }


def summarize(runs: list[Result]) -> Result:
    """Medians of each figure over the runs, with the runs' spread of objects/s."""
    keys = runs[0].keys()
    out: Result = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    rates = [r["objects_per_s"] for r in runs]
    out["objects_per_s_min"], out["objects_per_s_max"] = round(min(rates), 1), round(max(rates), 1)
    return out


def measure(args: argparse.Namespace, clients: list[str], builds: dict[str, Result]) -> Result:
    from pffs.testing.s3_server import SeaweedS3

    runs: dict[tuple[str, str], list[Result]] = {}
    refused: dict[str, str] = {}
    failures: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="pffs-s3clients-") as tmp:
        server = SeaweedS3(Path(tmp) / "s3")
        try:
            server.start()
            assert server.process is not None
            log(f"SeaweedFS at {server.endpoint_url}; uploading the workloads")
            jobs, digests = upload(server, args)
            for round_ in range(1, args.repeats + 1):
                for workload in WORKLOADS:
                    request = request_text(
                        server.endpoint_url,
                        server.access_key,
                        server.secret_key,
                        args.threads,
                        jobs[workload],
                    )
                    for client in clients:
                        if client in refused:
                            continue
                        binary = builds[client]["binary"] if client in builds else None
                        try:
                            server_cpu = process_cpu_seconds(server.process.pid)
                            answer = run_client(client, binary, request)
                            server_cpu = process_cpu_seconds(server.process.pid) - server_cpu
                        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                            log(f"  {client} {workload} round {round_}: FAILED {str(exc)[:500]}")
                            failures.append(
                                {"client": client, "workload": workload, "error": str(exc)[-2000:]}
                            )
                            continue
                        if answer["sha256"] != digests[workload]:
                            wrong = sum(
                                a != b for a, b in zip(answer["sha256"], digests[workload], strict=False)
                            )
                            refused[client] = f"{workload} round {round_}: {wrong} bodies with wrong bytes"
                            log(f"  {client}: REFUSED, {refused[client]}")
                            continue
                        row = figures(answer)
                        # The server's CPU over the client's whole process (start-up included): where the
                        # rest of the two cores went.
                        row["server_cpu_ms_per_object"] = 1000 * server_cpu / answer["objects"]
                        runs.setdefault((client, workload), []).append(row)
                        log(
                            f"  round {round_} {workload:<12} {client:<18} "
                            f"{row['objects_per_s']:>8.1f} obj/s {row['mib_per_s']:>8.1f} MiB/s "
                            f"{row['cpu_ms_per_object']:>7.3f} CPU ms/obj"
                        )
        finally:
            server.stop()
    results = [
        {"client": c, "workload": w, "runs": len(r), **summarize(r), "all_runs": r}
        for (c, w), r in runs.items()
        if c not in refused
    ]
    return {"results": results, "refused": refused, "failures": failures}


# -- output --------------------------------------------------------------------------------------------------
def print_table(report: Result) -> None:
    print(
        f"{'workload':<13}{'client':<19}{'obj/s':>9}{'MiB/s':>9}"
        f"{'CPU ms/obj':>11}{'CPU s/GiB':>10}{'cores':>7}{'server ms/obj':>14}"
    )
    for r in report["results"]:
        print(
            f"{r['workload']:<13}{r['client']:<19}{r['objects_per_s']:>9.1f}{r['mib_per_s']:>9.1f}"
            f"{r['cpu_ms_per_object']:>11.3f}{r['cpu_s_per_gib']:>10.3f}{r['cpu_cores']:>7.2f}"
            f"{r['server_cpu_ms_per_object']:>14.3f}"
        )
    for client, build in report["builds"].items():
        state = "cold" if build["build_cold"] else "incremental"
        print(
            f"{client}: build {build['build_seconds']} s ({state}), {build['crates']} crates "
            f"(harness alone {build['crates_harness']}), binary {build['binary_bytes'] >> 10} KiB"
        )
    for client, why in report["refused"].items():
        print(f"REFUSED {client}: {why}")
    for f in report["failures"]:
        print(f"FAILED {f['client']} {f['workload']}: {f['error'][:300]}")
    print(f"command: {report['command']}")


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "rust_hand": "tab:green",
        "rust_object_store": "tab:blue",
        "py_pffs": "tab:olive",
        "py_pffs_sockets": "tab:brown",
        "py_botocore": "tab:gray",
    }
    cfg = report["config"]
    titles = {
        "small": f"{cfg['small_count']} x {cfg['small_size'] >> 10} KiB, whole",
        "large_whole": f"{cfg['large_count']} x {cfg['large_size'] >> 20} MiB, whole",
        "large_ranged": f"{cfg['large_count']} x {cfg['large_size'] >> 20} MiB"
        f" in {cfg['range'] >> 20} MiB ranges",
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for col, workload in enumerate(WORKLOADS):
        rows = [r for r in report["results"] if r["workload"] == workload]
        names = [r["client"] for r in rows]
        speed = "objects_per_s" if workload == "small" else "mib_per_s"
        cost = "cpu_ms_per_object" if workload == "small" else "cpu_s_per_gib"
        for row, key in ((0, speed), (1, cost)):
            ax = axes[row][col]
            bars = ax.bar(names, [r[key] for r in rows], color=[colors[n] for n in names])
            ax.bar_label(bars, labels=[f"{r[key]:#.3g}".rstrip(".") for r in rows], fontsize=8)
            unit = UNITS[key]
            ax.set_title(f"{titles[workload]}: {unit}", fontsize=9)
            ax.tick_params(axis="x", labelsize=7, rotation=15)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"S3 clients for the native core: cold GETs from one local SeaweedFS, {cfg['threads']} threads, "
        f"{report['machine']['nproc']} cores (medians of {cfg['repeats']}; lower row: CPU, lower is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--small-count", type=int, default=2000, help="small objects (default 2000)")
    parser.add_argument("--small-size", type=size_arg, default="128K", help="small object size (128K)")
    parser.add_argument("--large-count", type=int, default=8, help="large objects (default 8)")
    parser.add_argument("--large-size", type=size_arg, default="64M", help="large object size (64M)")
    parser.add_argument("--range", type=size_arg, default="8M", help="range of large_ranged's GETs (8M)")
    parser.add_argument("--threads", type=int, default=8, help="threads (tasks) per client (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--only", help="comma-separated clients (default all: " + ",".join(CLIENTS) + ")")
    parser.add_argument("--cold-build", action="store_true", help="empty each Rust client's target dir first")
    parser.add_argument("--out", type=Path, default=RESULTS / "native_s3_clients.json")
    parser.add_argument("--phase", choices=PY_CLIENTS, help=argparse.SUPPRESS)  # a Python client's process
    args = parser.parse_args()
    if args.phase:
        return py_phase(args.phase)
    clients = args.only.split(",") if args.only else list(CLIENTS)
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    sys.path.insert(0, str(HERE.parent))
    started = time.monotonic()
    builds = {c: build(RUST_CLIENTS[c], args.cold_build) for c in clients if c in RUST_CLIENTS}
    measured = measure(args, clients, builds)
    import botocore

    rustc = subprocess.run(["rustc", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    report: Result = {
        "command": " ".join(
            shlex.quote(a) for a in [".venv/bin/python", "bench/native_s3_clients.py", *sys.argv[1:]]
        ),
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "config": {
            k: getattr(args, k)
            for k in ("small_count", "small_size", "large_count", "large_size", "range", "threads", "repeats")
        },
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "rustc": rustc},
        "versions": {"object_store": crate_version("object_store"), "botocore": botocore.__version__},
        "builds": {c: {k: v for k, v in b.items() if k != "binary"} for c, b in builds.items()},
        "not_built": {
            "rust_crt (mountpoint-s3-client)": "mountpoint-s3-crt-sys runs bindgen, which needs libclang "
            "(libclang.so); this machine has none (only libclang-cpp.so.14), and the CRT's cmake build of "
            "aws-lc, s2n-tls and nine aws-c-* libraries comes before that"
        },
        **measured,
        "total_seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print_table(report)
    print(f"results: {args.out} and {args.out.with_suffix('.png')}")
    return 1 if measured["refused"] or measured["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
