"""The tools ML engineers read data with, through pffs, against the local S3 server: Hugging Face
`datasets` (both URL forms the README shows, and streaming) and pandas. Each compares with the source."""

from __future__ import annotations

import io
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


def test_hugging_face_datasets_reads_parquet_through_both_url_forms(
    parquet: tuple[str, Any], s3_server: SeaweedS3, cache_dir: Path, tmp_path: Path
) -> None:
    prefix, frame = parquet
    s3 = s3_server.storage_options()
    # The chained form: datasets rewrites it (pffs::s3://...::s3://...) and passes a chained filesystem's
    # options on as the next layer's; this used to end in a TypeError inside aiobotocore.
    chained = datasets.load_dataset(
        "parquet",
        data_files=f"pffs::s3://{prefix}/*.parquet",
        storage_options={"s3": s3, "pffs": {"cache_dir": str(cache_dir)}},
        split="train",
        cache_dir=str(tmp_path / "hf1"),
    )
    assert _rows(chained) == _expected(frame)
    # pffs://, the backend named in pffs's own options: also streams.
    options = {"pffs": {"target_protocol": "s3", "target_options": s3, "cache_dir": str(cache_dir)}}
    own = datasets.load_dataset(
        "parquet",
        data_files=f"pffs://{prefix}/*.parquet",
        storage_options=options,
        split="train",
        cache_dir=str(tmp_path / "hf2"),
    )
    assert _rows(own) == _expected(frame)
    streamed = datasets.load_dataset(
        "parquet",
        data_files=f"pffs://{prefix}/*.parquet",
        storage_options=options,
        split="train",
        streaming=True,
    )
    assert _rows(streamed) == _expected(frame)


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
