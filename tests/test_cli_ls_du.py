"""`pffs ls` and `pffs du` against the real S3 server: sizes, and exactly the bytes the disk cache holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import pattern, sha256

from pffs.backends.options import BackendOptions
from pffs.backends.urls import open_backend
from pffs.cache import BlockCache
from pffs.cli.list_commands import share
from pffs.cli.main import main
from pffs.config import CacheSettings, format_size
from pffs.testing.s3_server import SeaweedS3
from pffs.vfs import Vfs
from pffs.vfs.pieces import PAGE_PIECE_SIZE

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

BLOCK = 256 * 1024  # random reads cache pieces of it: 64 KiB ones and pages (pffs.vfs.pieces)
# ds/a/f0 and ds/a/f1 (warmed), ds/a/deep/f2, ds/b/g (partly read), ds/top: sizes cut blocks unevenly.
SIZES = {"a/f0": 3 * BLOCK + 500, "a/f1": BLOCK, "a/deep/f2": 10_000, "b/g": 4 * BLOCK + 7, "top": 1_000}


def pffs(*args: str) -> subprocess.CompletedProcess[str]:
    """The `pffs` command as a user runs it, in a subprocess (credentials from s3_env)."""
    return subprocess.run(
        [sys.executable, "-m", "pffs.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def dataset(raw_s3: Any, bucket: str) -> dict[str, bytes]:
    files = {name: pattern(size, seed=i) for i, (name, size) in enumerate(SIZES.items())}
    for name, data in files.items():
        raw_s3.pipe(f"{bucket}/ds/{name}", data)
    return files


@pytest.fixture
def options(s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path) -> list[str]:
    return [
        "--endpoint-url",
        s3_server.endpoint_url,
        "--cache-dir",
        str(tmp_path / "c"),
        "--block-size",
        f"{BLOCK >> 10}K",
    ]


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    result = pffs(*args)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


def read_part(s3_server: SeaweedS3, cache_dir: Path, url: str, offset: int, length: int) -> bytes:
    """The first read of a new handle, as a program's: [offset, offset+length), left on disk."""
    backend, path = open_backend(url, BackendOptions(endpoint_url=s3_server.endpoint_url))
    cache = BlockCache(cache_dir, 1 << 30, 0)
    try:
        vfs = Vfs(backend, CacheSettings(cache_dir=cache_dir, block_size=BLOCK), cache)
        handle = vfs.open(path)
        data = handle.read(offset, length)
        handle.close()
        cache.wait_for_disk()
    finally:
        cache.close()
    return data


def test_cached_bytes_are_exactly_what_was_warmed_and_read(
    bucket: str, dataset: dict[str, bytes], options: list[str], s3_server: SeaweedS3, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/ds"
    ok("warmup", f"{url}/a", *options)
    # A random read of block 1 and the first 1,000 bytes of block 2: the cache holds block 1 and the
    # page those bytes are in (issue 34: was its 64 KiB piece), of the object's five blocks.
    data = read_part(s3_server, tmp_path / "c", f"{url}/b/g", BLOCK, BLOCK + 1_000)
    assert sha256(data) == sha256(dataset["b/g"][BLOCK : 2 * BLOCK + 1_000])

    listing = json.loads(ok("ls", "-r", "--json", url, *options).stdout)
    got = {e["name"]: (e["size"], e["cached_bytes"]) for e in listing["entries"]}
    assert got == {
        "a/f0": (SIZES["a/f0"], SIZES["a/f0"]),
        "a/f1": (SIZES["a/f1"], SIZES["a/f1"]),
        "a/deep/f2": (SIZES["a/deep/f2"], SIZES["a/deep/f2"]),
        "b/g": (SIZES["b/g"], BLOCK + PAGE_PIECE_SIZE),
        "top": (SIZES["top"], 0),
    }
    assert {e["url"] for e in listing["entries"]} == {f"{url}/{name}" for name in SIZES}
    assert all(e["type"] == "file" and e["modified"].endswith("Z") for e in listing["entries"])

    # The table says the same: warmed objects 100%, the partly read one its share rounded down.
    table = ok("ls", "-r", "--bytes", url, *options).stdout.splitlines()
    assert table[0].split() == ["SIZE", "CACHED", "%", "MODIFIED", "NAME"]
    rows = {line.split()[-1]: line.split()[:3] for line in table[1:-1]}
    assert rows["a/f0"] == [f"{SIZES['a/f0']:,}", f"{SIZES['a/f0']:,}", "100%"]
    assert rows["b/g"] == [f"{SIZES['b/g']:,}", f"{BLOCK + PAGE_PIECE_SIZE:,}", "25.3%"]  # 25.390..%
    assert rows["top"] == [f"{SIZES['top']:,}", "0", "0.0%"]
    assert len({len(line) - len(line.split()[-1]) for line in table[:-1]}) == 1  # NAME lines up
    total, cached = (
        sum(SIZES.values()),
        sum(SIZES[n] for n in SIZES if n.startswith("a/")) + BLOCK + PAGE_PIECE_SIZE,
    )
    assert table[-1] == f"5 objects: {total:,}, {cached:,} cached ({cached * 1000 // total / 10:.1f}%)"

    # One level: objects, and prefixes as folders without sizes.
    level = json.loads(ok("ls", "--json", f"{url}/", *options).stdout)
    assert [(e["name"], e["type"], e["size"]) for e in level["entries"]] == [
        ("a/", "directory", None),
        ("b/", "directory", None),
        ("top", "file", SIZES["top"]),
    ]
    assert level["total"] == {"objects": 1, "prefixes": 2, "size": SIZES["top"], "cached_bytes": 0}
    human = ok("ls", url, *options).stdout.splitlines()
    assert [line.split()[-1] for line in human[1:-1]] == ["a/", "b/", "top"]
    assert human[3].split()[:4] == ["1000", "B", "0", "B"] and human[-1].startswith("1 object, 2 prefixes: ")


def test_blocks_of_any_block_size_count_once(
    bucket: str, dataset: dict[str, bytes], options: list[str], tmp_path: Path
) -> None:
    """A mount or warm-up with another --block-size than ls's: its blocks count all the same, and bytes
    held twice (blocks of two sizes over the same stretch) count once."""
    url = f"s3://{bucket}/ds"
    other = [*options[: options.index("--block-size")], "--block-size", "96K"]  # no multiple of 64 KiB
    ok("warmup", f"{url}/b/g", *other)
    ok("warmup", f"{url}/a/f0", *options)
    ok("warmup", f"{url}/a/f0", *other)
    listing = json.loads(ok("ls", "-r", "--json", url, *options).stdout)
    got = {e["name"]: e["cached_bytes"] for e in listing["entries"]}
    assert got["b/g"] == SIZES["b/g"] and got["a/f0"] == SIZES["a/f0"] and got["top"] == 0, got


def test_du_totals_per_prefix_to_depth_n_and_the_table_agrees_with_the_json(
    bucket: str, dataset: dict[str, bytes], options: list[str], s3_server: SeaweedS3, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/ds"
    data = read_part(s3_server, tmp_path / "c", f"{url}/a/deep/f2", 0, SIZES["a/deep/f2"])
    assert sha256(data) == sha256(dataset["a/deep/f2"])
    a = ["a/f0", "a/f1", "a/deep/f2"]

    def du(*args: str) -> list[tuple[str, int, int, int]]:
        report = json.loads(ok("du", "--json", *args, f"{url}/", *options).stdout)
        return [
            (r["url"], r["depth"], r["objects"], r["size"], r["cached_bytes"]) for r in report["prefixes"]
        ]

    whole = (url, 0, 5, sum(SIZES.values()), SIZES["a/deep/f2"])
    assert du() == [whole]
    assert du("-d", "1") == [
        (f"{url}/a/", 1, 3, sum(SIZES[n] for n in a), SIZES["a/deep/f2"]),
        (f"{url}/b/", 1, 1, SIZES["b/g"], 0),
        whole,
    ]
    two = du("-d", "9")  # as -d 2: there are no deeper prefixes
    assert two[1] == (f"{url}/a/deep/", 2, 1, SIZES["a/deep/f2"], SIZES["a/deep/f2"])
    assert [r[0] for r in two] == [f"{url}/a/", f"{url}/a/deep/", f"{url}/b/", url]

    table = ok("du", "-d", "2", "--bytes", f"{url}/", *options).stdout.splitlines()
    assert table[0].split() == ["SIZE", "CACHED", "%", "OBJECTS", "URL"]
    assert [line.split() for line in table[1:]] == [
        [
            f"{size:,}",
            f"{cached:,}",
            "100%" if size == cached else f"{cached * 1000 // size / 10:.1f}%",
            f"{n:,}",
            u,
        ]
        for u, _, n, size, cached in two
    ]
    assert len({len(line) - len(line.split()[-1]) for line in table}) == 1  # the URL column lines up


def du_one(url: str, options: list[str]) -> tuple[int, int, int]:
    (row,) = json.loads(ok("du", "--json", url, *options).stdout)["prefixes"]
    return row["objects"], row["size"], row["cached_bytes"]


def test_an_overwritten_objects_old_blocks_no_longer_count(
    raw_s3: Any,
    bucket: str,
    dataset: dict[str, bytes],
    options: list[str],
    s3_server: SeaweedS3,
    tmp_path: Path,
) -> None:
    url, size = f"s3://{bucket}/ds/a/f0", SIZES["a/f0"]
    assert sha256(read_part(s3_server, tmp_path / "c", url, 0, size)) == sha256(dataset["a/f0"])
    new = pattern(size, seed=99)  # same size, other bytes: only the identity (ETag) tells them apart
    raw_s3.pipe(f"{bucket}/ds/a/f0", new)

    assert du_one(url, options) == (1, size, 0)
    stats = json.loads(ok("stats", "--json", *options).stdout)
    assert (
        stats["cache_usage"]["disk_bytes"] >= size
    )  # the old version's blocks are still there, and not counted

    assert sha256(read_part(s3_server, tmp_path / "c", url, 0, size)) == sha256(new)
    assert du_one(url, options) == (1, size, size)  # the new version's blocks, each once


def test_no_cache_shows_nothing_cached_and_makes_none(
    bucket: str, dataset: dict[str, bytes], s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "no-cache-here"
    common = ["--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(missing)]
    result = ok("ls", "-r", "--json", f"s3://{bucket}/ds", *common)
    entries = json.loads(result.stdout)["entries"]
    assert {e["name"]: e["cached_bytes"] for e in entries} == dict.fromkeys(SIZES, 0)
    assert result.stderr.count("\n") == 1 and f"no pffs cache at {missing}" in result.stderr
    result = ok("du", f"s3://{bucket}/ds", *common)
    assert result.stdout.splitlines()[1].split()[:5] == [
        *format_size(sum(SIZES.values())).split(),
        "0",
        "B",
        "0.0%",
    ]
    assert not missing.exists()


def test_a_failed_listing_is_one_line_and_exit_1(
    bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    common = ["--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(tmp_path / "c")]
    for command, url, message in [
        ("ls", "s3://pffs-no-such-bucket-here/x", "the bucket does not exist"),
        ("ls", "s3://pffs-no-such-bucket-here", "the bucket does not exist"),  # its root: no NoSuchBucket
        ("du", "s3://pffs-no-such-bucket-here/", "the bucket does not exist"),
        ("du", f"s3://{bucket}/no/such/prefix", "no such file or object"),
    ]:
        result = pffs(command, url, *common)
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(f"pffs: error: {url.rstrip('/')}: {message}"), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["du", "-d", "-1", "s3://b"], "argument -d/--max-depth: must be 0 or more, not -1"),
        (["du", "-d", "two", "s3://b"], "argument -d/--max-depth: not a whole number: 'two'"),
        (["ls", "--long", "s3://b"], "unrecognized arguments: --long"),
        (["ls"], "the following arguments are required: URL"),
    ],
)
def test_a_wrong_command_line_is_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's own exit: nothing was opened
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_help_explains_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for args, words in [
        (["--help"], ["pffs ls", "du -d 1"]),
        (["ls", "--help"], ["--recursive", "--json", "CACHED", "examples:", "pffs ls -r"]),
        (["du", "-h"], ["--max-depth", "examples:", "pffs du -d 1"]),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(args)
        text = capsys.readouterr().out
        assert exited.value.code == 0 and all(word in text for word in words), text


def test_the_cached_share_is_rounded_down_so_only_all_shows_100() -> None:
    assert [share(*pair) for pair in [(10, 10), (999_999, 1_000_000), (1, 10**6), (0, 5), (0, 0)]] == [
        "100%",
        "99.9%",
        "<0.1%",
        "0.0%",
        "-",
    ]
