"""The tools ML engineers read data with, through pffs, against the local S3 server: Hugging Face
`datasets` (both URL forms the README shows, and streaming) and pandas. Each compares with the source."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import require

from pffs.testing.s3_server import SeaweedS3

try:
    import datasets
    import pandas as pd
except ImportError:  # a plain pytest without the dev extra: said by the fixture below
    datasets = pd = None


@pytest.fixture(autouse=True)
def _ml_tools() -> None:
    require([] if datasets else ["pandas and datasets (the dev extra: make setup)"], "the ML tools")


@pytest.fixture
def parquet(raw_s3: Any, bucket: str) -> tuple[str, Any]:
    """A two-part parquet dataset in the bucket, and the frame it holds."""
    frame = pd.DataFrame({"id": range(3000), "text": [f"row {i}" for i in range(3000)]})
    for part, rows in enumerate((frame.iloc[:1500], frame.iloc[1500:])):
        buffer = io.BytesIO()
        rows.to_parquet(buffer, index=False)
        raw_s3.pipe(f"{bucket}/pq/part-{part}.parquet", buffer.getvalue())
    return f"{bucket}/pq", frame


def _rows(dataset: Any) -> list[tuple[int, str]]:
    return sorted((row["id"], row["text"]) for row in dataset)


def _expected(frame: Any) -> list[tuple[int, str]]:
    return sorted(zip(frame["id"].tolist(), frame["text"].tolist(), strict=True))


def _landed(cache: Path, prefix: str, s3: dict[str, Any]) -> dict[str, float]:
    """The share of each parquet file's bytes in the pffs cache `cache` (what the load put there)."""
    import fsspec

    fs = fsspec.filesystem(
        "pffs", target=f"s3://{prefix}", cache_dir=str(cache), skip_instance_cache=True, **s3
    )  # fmt: skip
    return {name: fs.cached_fraction(name) for name in fs.find("")}


def test_hugging_face_datasets_reads_through_pffs_with_its_options_in_every_form(
    parquet: tuple[str, Any],
    s3_server: SeaweedS3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each form the ML-tools page shows, with a real `load_dataset`: the rows exact, and the data read
    into the pffs cache_dir given, none into the default one. (Without streaming, the chained form used to
    put everything in the default cache: `datasets` drops storage_options["pffs"] for the `pffs` hop.)"""
    from pffs.cache.stats import read_totals

    prefix, frame = parquet
    s3 = s3_server.storage_options()
    default = tmp_path / "default-pffs-cache"
    monkeypatch.setenv("PFFS_CACHE_DIR", str(default))  # where pffs options dropped on the way would go
    whole = {"part-0.parquet": 1.0, "part-1.parquet": 1.0}

    # The chained form: datasets rewrites it (pffs::s3://...::s3://...) and passes a chained filesystem's
    # options on as the next layer's; this used to end in a TypeError inside aiobotocore.
    chained = datasets.load_dataset(
        "parquet",
        data_files=f"pffs::s3://{prefix}/*.parquet",
        storage_options={"s3": s3, "pffs": {"cache_dir": str(tmp_path / "c1")}},
        split="train",
        cache_dir=str(tmp_path / "hf1"),
    )
    assert _rows(chained) == _expected(frame)
    assert _landed(tmp_path / "c1", prefix, s3) == whole

    # pffs://, the backend named in pffs's own options: without streaming, and streaming.
    def own(cache: str) -> dict[str, Any]:
        return {"pffs": {"target_protocol": "s3", "target_options": s3, "cache_dir": str(tmp_path / cache)}}

    loaded = datasets.load_dataset(
        "parquet",
        data_files=f"pffs://{prefix}/*.parquet",
        storage_options=own("c2"),
        split="train",
        cache_dir=str(tmp_path / "hf2"),
    )
    assert _rows(loaded) == _expected(frame)
    assert _landed(tmp_path / "c2", prefix, s3) == whole
    streamed = datasets.load_dataset(
        "parquet",
        data_files=f"pffs://{prefix}/*.parquet",
        storage_options=own("c3"),
        split="train",
        streaming=True,
        cache_dir=str(tmp_path / "hf3"),
    )
    assert _rows(streamed) == _expected(frame)
    fetched = read_totals(tmp_path / "c3" / "stats.sqlite")["bytes_fetched"]
    assert fetched >= sum(raw for raw in _sizes(prefix, s3).values()) * 0.9, fetched  # the columns read
    assert not (tmp_path / "hf3").exists() or not any((tmp_path / "hf3").rglob("*.arrow"))
    assert not default.exists(), sorted(default.rglob("*"))
    # The one form datasets cannot stream says which form works (datasets alone fails with 'pffs' as a path)
    with pytest.raises(ValueError, match=r"with streaming=True use data_files='pffs://"):
        datasets.load_dataset(
            "parquet",
            data_files=f"pffs::s3://{prefix}/*.parquet",
            storage_options={"s3": s3, "pffs": {"cache_dir": str(tmp_path / "c4")}},
            split="train",
            streaming=True,
        )


def test_hugging_face_datasets_loads_16_files_or_more_through_pffs_with_its_options(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From 16 files on, `datasets` downloads through another path, which hands the URL's first layer its
    Hub's options (`hf={...}`) too: pffs leaves another layer's options alone (it refused them as unknown
    before), and still takes its own. Both forms, the rows exact, the data in the cache_dir given."""
    frame = pd.DataFrame({"id": range(1600), "text": [f"row {i}" for i in range(1600)]})
    for part in range(16):
        buffer = io.BytesIO()
        frame.iloc[part::16].to_parquet(buffer, index=False)
        raw_s3.pipe(f"{bucket}/many/part-{part:02d}.parquet", buffer.getvalue())
    s3 = s3_server.storage_options()
    default = tmp_path / "default-pffs-cache"
    monkeypatch.setenv("PFFS_CACHE_DIR", str(default))
    own = {"pffs": {"target_protocol": "s3", "target_options": s3, "cache_dir": str(tmp_path / "c2")}}
    forms = [
        (f"pffs::s3://{bucket}/many/*.parquet", {"s3": s3, "pffs": {"cache_dir": str(tmp_path / "c1")}}),
        (f"pffs://{bucket}/many/*.parquet", own),
    ]
    for n, (url, options) in enumerate(forms, 1):
        hf_cache = str(tmp_path / f"hf{n}")
        loaded = datasets.load_dataset(
            "parquet", data_files=url, storage_options=options, split="train", cache_dir=hf_cache
        )  # fmt: skip
        assert _rows(loaded) == _expected(frame)
        assert set(_landed(tmp_path / f"c{n}", f"{bucket}/many", s3).values()) == {1.0}
    assert not default.exists(), sorted(default.rglob("*"))


def _sizes(prefix: str, s3: dict[str, Any]) -> dict[str, int]:
    import s3fs

    raw = s3fs.S3FileSystem(**s3)
    return {path: raw.size(path) for path in raw.find(prefix)}


def test_pandas_reads_parquet_and_csv_through_pffs(
    parquet: tuple[str, Any], raw_s3: Any, bucket: str, s3_server: SeaweedS3, cache_dir: Path
) -> None:
    prefix, frame = parquet
    s3 = s3_server.storage_options()
    got = pd.read_parquet(
        f"pffs::s3://{prefix}/part-1.parquet",
        storage_options={"s3": s3, "pffs": {"cache_dir": str(cache_dir)}},
    )
    assert got.reset_index(drop=True).equals(frame.iloc[1500:].reset_index(drop=True))
    raw_s3.pipe(f"{bucket}/t.csv", frame.to_csv(index=False).encode())
    table = pd.read_csv(
        f"pffs::s3://{bucket}/t.csv", storage_options={"s3": s3, "pffs": {"cache_dir": str(cache_dir)}}
    )
    assert table.equals(frame)


LOADER = """
import sys, fsspec, torch
from pffs.cache.stats import read_totals

class Shards(torch.utils.data.Dataset):  # the README's example
    def __init__(self, target, cache_dir, options):
        self.fs = fsspec.filesystem("pffs", target=target, cache_dir=cache_dir, **options)
        self.names = self.fs.find("")

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        import hashlib
        return self.names[i], hashlib.sha256(self.fs.cat_file(self.names[i])).hexdigest()

if __name__ == "__main__":
    import json
    target, cache_dir, start, persistent, options = sys.argv[1:6]
    loader = torch.utils.data.DataLoader(
        Shards(target, cache_dir, json.loads(options)), batch_size=None, num_workers=2,
        multiprocessing_context=start, persistent_workers=persistent == "persistent",
    )
    epochs = [dict(loader) for _ in range(2)]
    print(json.dumps({"epochs": epochs, "totals": read_totals(cache_dir + "/stats.sqlite")}))
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
@pytest.mark.parametrize("persistent", ["persistent", "new-workers"])
def test_a_torch_dataloader_reads_exactly_and_every_block_is_counted_once(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, tmp_path: Path, start: str, persistent: str
) -> None:
    """The README's Shards dataset, 2 epochs, 2 workers: exact bytes, one miss per block (the first
    epoch), a hit for every other read, and nothing printed by a worker (no traceback at exit)."""
    import hashlib
    import importlib.util
    import json
    import subprocess
    import sys

    require([] if importlib.util.find_spec("torch") else ["torch (the dev extra: make setup)"], "DataLoader")
    shards = {f"s{i:02d}.bin": bytes([i]) * (50_000 + i) for i in range(24)}
    raw_s3.pipe({f"{bucket}/shards/{name}": data for name, data in shards.items()})
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    options = {k: v for k, v in s3_server.storage_options().items() if k != "skip_instance_cache"}
    result = subprocess.run(
        [sys.executable, str(script), f"s3://{bucket}/shards", str(tmp_path / "c"), start, persistent,
         json.dumps(options)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in shards.items()}
    assert report["epochs"] == [expected, expected]
    totals = report["totals"]
    assert totals["misses"] == len(shards), totals
    assert totals["memory_hits"] + totals["disk_hits"] == len(shards), totals
    worker_noise = [line for line in result.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert not [line for line in worker_noise if "Traceback" in line or "exception" in line.lower()], (
        result.stderr[-3000:]
    )


def test_pyarrow_dataset_reads_a_prefix_through_a_pffs_filesystem(
    parquet: tuple[str, Any], s3_server: SeaweedS3, cache_dir: Path
) -> None:
    """The README's pyarrow.dataset example: a pffs filesystem rooted at the prefix, one column read."""
    import fsspec
    import pyarrow.dataset as pads

    prefix, frame = parquet
    fs = fsspec.filesystem(
        "pffs", target=f"s3://{prefix}", cache_dir=str(cache_dir), skip_instance_cache=True,
        **s3_server.storage_options(),
    )  # fmt: skip
    table = pads.dataset("", filesystem=fs, format="parquet").to_table(columns=["id", "text"])
    assert sorted(zip(table["id"].to_pylist(), table["text"].to_pylist(), strict=True)) == _expected(frame)


def test_a_tar_shard_streams_through_pffs_cat_as_webdataset_pipe_reads_it(
    raw_s3: Any, bucket: str, s3_server: SeaweedS3, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """webdataset's `pipe:pffs cat s3://...` reads a shard as a tar stream from the command's stdout:
    every member comes out exact, and the second read is served from the cache."""
    import hashlib
    import subprocess
    import sys
    import tarfile

    members = {f"sample-{i:03d}.jpg": bytes([i % 251]) * (20_000 + 997 * i) for i in range(40)}
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw_s3.pipe(f"{bucket}/shards/shard-0000.tar", shard.getvalue())
    cache = str(tmp_path / "cache")
    for _ in range(2):
        with subprocess.Popen(
            [sys.executable, "-m", "pffs.cli.main", "--cache-dir", cache,
             "--endpoint-url", s3_server.endpoint_url, "cat", f"s3://{bucket}/shards/shard-0000.tar"],
            stdout=subprocess.PIPE, env=s3_env, stdin=subprocess.DEVNULL,
        ) as cat:  # fmt: skip
            assert cat.stdout is not None
            with tarfile.open(fileobj=cat.stdout, mode="r|") as stream:  # a stream: no seeking back
                got = {m.name: hashlib.sha256(stream.extractfile(m).read()).hexdigest() for m in stream}  # type: ignore[union-attr]
            assert cat.wait(timeout=60) == 0
        assert got == {name: hashlib.sha256(data).hexdigest() for name, data in members.items()}
    stats = subprocess.run(
        [sys.executable, "-m", "pffs.cli.main", "--cache-dir", cache, "stats", "--json"],
        capture_output=True, env=s3_env, timeout=60, check=True,
    )  # fmt: skip
    totals = json.loads(stats.stdout)["cache"]
    assert totals["misses"] == 1 and totals["memory_hits"] + totals["disk_hits"] == 1, totals
