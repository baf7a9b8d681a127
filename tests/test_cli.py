"""The `pffs` command, run as a user runs it: a subprocess, with credentials in the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import pattern, sha256

from pffs.testing.s3_server import SeaweedS3, free_ports

PFFS = [sys.executable, "-m", "pffs.cli.main"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*PFFS, *args], capture_output=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_help_explains_the_commands() -> None:
    result = run("--help")
    assert result.returncode == 0
    out = result.stdout.decode()
    for word in ("cat", "warmup", "stats", "cache", "AWS_ACCESS_KEY_ID", "exit codes"):
        assert word in out
    assert "--workers" in run("warmup", "--help").stdout.decode()


def test_cat_warmup_and_stats_against_s3(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    files = {f"ds/f{i}": pattern(100_000 * (i + 1), seed=i) for i in range(5)}
    for name, data in files.items():
        raw_s3.pipe(f"{bucket}/{name}", data)
    common = [
        "--endpoint-url",
        s3_server.endpoint_url,
        "--cache-dir",
        str(tmp_path / "c"),
        "--block-size",
        "128K",
    ]

    result = run("warmup", f"s3://{bucket}/ds", "--workers", "4", "--json", *common, env=s3_env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    total = sum(len(d) for d in files.values())
    assert (summary["files"], summary["bytes"], summary["bytes_fetched"]) == (5, total, total)

    again = json.loads(run("warmup", f"s3://{bucket}/ds", "--json", *common, env=s3_env).stdout)
    assert (again["bytes_fetched"], again["bytes_already_cached"]) == (0, total)

    result = run("cat", f"s3://{bucket}/ds/f3", *common, env=s3_env)
    assert result.returncode == 0 and sha256(result.stdout) == sha256(files["ds/f3"])

    report = json.loads(run("stats", "--json", *common).stdout)
    stats = report["cache"]
    blocks = sum(-(-len(d) // (128 * 1024)) for d in files.values())
    assert stats["misses"] == blocks and stats["bytes_fetched"] == total
    assert report["cache_usage"]["disk_blocks"] == blocks
    assert stats["disk_hits"] >= -(-len(files["ds/f3"]) // (128 * 1024))
    # the backend requests of every process that read through this cache: one GET per block fetched
    assert report["backend_requests"]["get"] == {"requests": blocks, "errors": 0, "not_found": 0}
    table = run("stats", *common).stdout.decode()
    assert "hit ratio" in table and "misses (fetched for a waiting reader)" in table

    assert run("cache", "gc", "--verify", *common).returncode == 0
    assert "removed" in run("cache", "clear", *common).stdout.decode()
    assert json.loads(run("stats", "--json", *common).stdout)["cache_usage"]["disk_blocks"] == 0


def test_bad_credentials_one_line_no_secret(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    raw_s3.pipe(f"{bucket}/k", b"data")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "nobody", "AWS_SECRET_ACCESS_KEY": "super-secret-value-42"}
    result = run(
        "cat",
        f"s3://{bucket}/k",
        "--endpoint-url",
        s3_server.endpoint_url,
        "--cache-dir",
        str(tmp_path),
        env=env,
    )
    err = result.stderr.decode()
    assert result.returncode == 1
    assert err.count("\n") == 1 and err.startswith("pffs: error: ") and "access denied" in err
    assert "super-secret-value-42" not in err + result.stdout.decode()


def test_credentials_file_and_profile(raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path) -> None:
    raw_s3.pipe(f"{bucket}/k", b"from a profile")
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[training]\naws_access_key_id = {s3_server.access_key}\n"
        f"aws_secret_access_key = {s3_server.secret_key}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    result = run(
        "cat",
        f"s3://{bucket}/k",
        "--endpoint-url",
        s3_server.endpoint_url,
        "--credentials-file",
        str(creds),
        "--profile",
        "training",
        "--region",
        "us-east-1",
        "--cache-dir",
        str(tmp_path / "c"),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"from a profile"


def test_unreachable_endpoint_fails_fast_with_a_clear_line(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    started = time.monotonic()
    result = run(
        "cat",
        "s3://bkt/k",
        "--endpoint-url",
        f"http://127.0.0.1:{port}",
        "--cache-dir",
        str(tmp_path),
        env=env,
    )
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "backend unavailable" in err and "is the endpoint right" in err and err.count("\n") == 1
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-size", "12Q", "stats"], "cache-size: not a size"),
        (["cat", "nosuch://x"], "unknown URL scheme 'nosuch'"),
        (["--block-size", "1K", "stats"], "block-size"),
        (["warmup", "/tmp", "--workers", "many"], "invalid int value"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["warmup", "/tmp", "--workers", "-3"], "--workers must be at least 1, not -3"),
        (["--endpoint-url", "127.0.0.1:8334", "cat", "s3://bkt/k"], "e.g. http://127.0.0.1:8334"),
        (["cat", "gs://bkt/k"], "gs:// needs a package that is not installed"),
    ],
)
def test_bad_command_lines_exit_2_with_one_clear_message(
    args: list[str], message: str, tmp_path: Path
) -> None:
    result = run(*args, "--cache-dir", str(tmp_path)) if args[0] != "frobnicate" else run(*args)
    assert result.returncode == 2
    assert message in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode() and "internal error" not in result.stderr.decode()


def test_no_credentials_at_all_is_one_line_saying_where_they_come_from(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    raw_s3.pipe(f"{bucket}/k", b"data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"HOME": str(tmp_path)}
    result = run(
        "cat", f"s3://{bucket}/k", "--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path),
        env=env,
    )  # fmt: skip
    err = result.stderr.decode()
    assert result.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith("pffs: error: ") and "no usable S3 credentials" in err and "AWS_PROFILE" in err


def test_missing_local_file(tmp_path: Path) -> None:
    result = run("cat", str(tmp_path / "nope"), "--cache-dir", str(tmp_path / "c"))
    assert result.returncode == 1
    assert result.stderr.decode().strip() == f"pffs: error: {tmp_path / 'nope'}: no such file or object"


def test_no_silent_no_ops(tmp_path: Path) -> None:
    """A command that would do nothing, or less than asked, says so (issue 15, bug 6)."""
    typo = tmp_path / "typo"
    result = run("stats", "--cache-dir", str(typo))
    assert result.returncode == 1 and "no pffs cache here" in result.stderr.decode()
    assert not typo.exists()  # not made into an empty cache that shows zeros
    (tmp_path / "data.bin").write_bytes(b"x" * 1000)
    unusable = tmp_path / "file-not-folder"
    unusable.write_bytes(b"")
    result = run("warmup", str(tmp_path / "data.bin"), "--cache-dir", str(unusable / "c"))
    assert result.returncode == 1 and "nothing would be warmed" in result.stderr.decode(), result.stderr
    result = run(
        "cat", str(tmp_path / "data.bin"), "--cache-dir", str(tmp_path / "c"),
        "--cache-size", "100000T", "--memory-cache-size", "100000T",
    )  # fmt: skip
    err = result.stderr.decode()
    assert result.returncode == 0 and result.stdout == b"x" * 1000
    assert "more than this machine's memory" in err and "more than the whole disk" in err


def test_the_disk_bound_is_the_caches_and_gc_verify_is_counted(tmp_path: Path) -> None:
    """A bound given once stays with the cache; commands that give none use it, not their default (issue
    15, bug 8). A corrupt block that `cache gc --verify` drops is counted in `pffs stats`."""
    data = tmp_path / "data.bin"
    data.write_bytes(pattern(300_000, seed=8))
    cache = ["--cache-dir", str(tmp_path / "c")]

    def capacity() -> int:
        return int(json.loads(run("stats", "--json", *cache).stdout)["cache_usage"]["disk_capacity_bytes"])

    assert run("warmup", str(data), "--cache-size", "50M", *cache).returncode == 0
    assert capacity() == 50 << 20
    assert run("cache", "gc", "--cache-size", "20M", *cache).returncode == 0
    assert capacity() == 20 << 20
    assert run("cat", str(data), *cache).stdout == data.read_bytes()  # no --cache-size: the cache's own
    assert capacity() == 20 << 20
    block = max((tmp_path / "c" / "blocks").rglob("*.blk"), key=lambda p: p.stat().st_size)
    raw = bytearray(block.read_bytes())
    raw[-100] ^= 0xFF  # one flipped bit in the block's bytes, past its header
    block.write_bytes(bytes(raw))
    report = json.loads(run("cache", "gc", "--verify", "--json", *cache).stdout)
    assert report["corrupt"] == 1
    assert json.loads(run("stats", "--json", *cache).stdout)["cache"]["corrupt_blocks"] == 1
    assert sha256(run("cat", str(data), *cache).stdout) == sha256(data.read_bytes())  # fetched again


def test_the_cli_parses_without_importing_what_only_commands_need() -> None:
    """`pffs --version`, `--help` and argument errors must start fast (tools call pffs in pipes): building
    the parser imports no backend client, no pydantic, no gRPC, no Kubernetes client, no ML library."""
    probe = (
        "import sys; from pffs.cli.main import build_parser; build_parser().format_help(); "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    heavy = {"fsspec", "s3fs", "botocore", "aiobotocore", "aiohttp", "pydantic", "grpc", "kubernetes",
             "numpy", "pyarrow", "torch", "tqdm", "diskcache", "pyfuse3", "trio", "hdfs_native"}  # fmt: skip
    assert not loaded & heavy, sorted(loaded & heavy)


CAT_PROBE = (
    "import sys; from pffs.cli.main import main; code = main(sys.argv[1:]); sys.stdout.flush(); "
    "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr); sys.exit(code)"
)
HEAVY = {"grpc", "kubernetes", "pyarrow", "numpy", "torch", "pandas", "pyfuse3", "trio", "tqdm"}


def cat_loading(*args: str, env: dict[str, str] | None = None) -> tuple[bytes, set[str]]:
    """What `pffs cat ARGS` printed, and the top-level modules it imported."""
    done = subprocess.run(
        [sys.executable, "-c", CAT_PROBE, *args], capture_output=True, env=env, timeout=60, check=True
    )
    return done.stdout, set(done.stderr.decode().split())


def test_pffs_cat_imports_no_kubernetes_grpc_or_ml_library(tmp_path: Path) -> None:
    """`pffs cat` runs once per shard in webdataset's `pipe:` URLs: what it imports is paid every time. It
    needs the cache and a backend, never the CSI or scheduler stacks or a numeric library."""
    data = tmp_path / "labels.csv"
    data.write_bytes(b"label,index\ncat,0\n")
    printed, loaded = cat_loading("--cache-dir", str(tmp_path / "c"), "cat", str(data))
    assert printed == b"label,index\ncat,0\n"
    assert not loaded & (HEAVY | {"s3fs"}), sorted(loaded & (HEAVY | {"s3fs"}))


def test_pffs_cat_of_a_cached_s3_object_imports_no_botocore(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Keys in the environment and an endpoint on an IP address: the HEAD that checks the cached copy is
    still the object's goes through pffs's own S3 client, so s3fs, botocore and aiohttp are never
    imported (about 0.45 s of every `pffs cat` before). A profile makes it botocore's business again."""
    data = pattern(300_000, seed=12)
    raw_s3.pipe(f"{bucket}/labels.bin", data)
    args = ["--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path / "c"), "cat"]
    for _ in range(2):  # cold, then from the cache
        printed, loaded = cat_loading(*args, f"s3://{bucket}/labels.bin", env=s3_env)
        assert sha256(printed) == sha256(data)
        assert not loaded & (HEAVY | {"s3fs", "botocore", "aiobotocore", "aiohttp"}), sorted(loaded)
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[team]\naws_access_key_id = {s3_server.access_key}\n"
        f"aws_secret_access_key = {s3_server.secret_key}\n"
    )
    profile_env = {k: v for k, v in s3_env.items() if not k.startswith("AWS_")}
    profile_env.update(AWS_PROFILE="team", AWS_SHARED_CREDENTIALS_FILE=str(credentials))
    printed, loaded = cat_loading(*args, f"s3://{bucket}/labels.bin", env=profile_env)
    assert sha256(printed) == sha256(data) and "botocore" in loaded
