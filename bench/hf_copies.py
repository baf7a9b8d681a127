"""Which copies of a dataset Hugging Face `datasets` and pffs keep on disk, in bytes, for each way of
loading it through pffs (issue 41: the ML-tools page says exactly this, measured).

    .venv/bin/python bench/hf_copies.py            # about a minute

On a local SeaweedFS server, a parquet dataset of --files files (--rows rows in all: an id, a label and a
text of random words). Each case loads it in a fresh process with fresh cache folders (pffs's `cache_dir`,
`datasets`' `cache_dir`, and a default pffs cache folder that must stay empty) and reports the bytes in:

    pffs_blocks    pffs's block cache (the source's bytes, once: the copy every later epoch reads)
    hf_downloads   datasets' download cache (<cache_dir>/downloads: each file copied whole)
    hf_arrow       datasets' Arrow cache (the rest of <cache_dir>: the table decoded into Arrow files)
    default_pffs   a pffs cache folder nobody named (must be 0: the options given were honoured)

Cases: the chained URL (`pffs::s3://...`) and `pffs://` without streaming, `pffs://` without streaming and
keep_in_memory=True, `pffs://` with streaming=True, and pyarrow.dataset over a pffs filesystem handed to
`datasets.Dataset` (in memory). Every case's rows are compared with the source (a mismatch ends the run
with an error). Writes bench/results/hf_copies.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import s3fs

from pffs.testing.s3_server import SeaweedS3

BUCKET = "bench-hf"
SEED = 20261128
RESULTS = Path(__file__).parent / "results"
CASES = ("chained", "pffs", "pffs_keep_in_memory", "pffs_streaming", "pyarrow_in_memory")

LOAD = r"""
import hashlib, json, os, sys
case, prefix, s3, pffs_cache, hf_cache = sys.argv[1:6]
s3 = json.loads(s3)
import datasets

own = {"pffs": {"target_protocol": "s3", "target_options": s3, "cache_dir": pffs_cache}}
common = {"split": "train", "cache_dir": hf_cache}
if case == "chained":
    ds = datasets.load_dataset("parquet", data_files=f"pffs::s3://{prefix}/*.parquet",
                               storage_options={"s3": s3, "pffs": {"cache_dir": pffs_cache}}, **common)
elif case == "pffs":
    ds = datasets.load_dataset("parquet", data_files=f"pffs://{prefix}/*.parquet", storage_options=own,
                               **common)
elif case == "pffs_keep_in_memory":
    ds = datasets.load_dataset("parquet", data_files=f"pffs://{prefix}/*.parquet", storage_options=own,
                               keep_in_memory=True, **common)
elif case == "pffs_streaming":
    ds = datasets.load_dataset("parquet", data_files=f"pffs://{prefix}/*.parquet", storage_options=own,
                               streaming=True, **common)
else:
    import fsspec, pyarrow.dataset as pads
    fs = fsspec.filesystem("pffs", target=f"s3://{prefix}", cache_dir=pffs_cache, **s3)
    ds = datasets.Dataset(pads.dataset("", filesystem=fs, format="parquet").to_table())
rows = sorted((row["id"], row["label"], row["text"]) for row in ds)
print(json.dumps({"rows": len(rows), "sha256": hashlib.sha256(json.dumps(rows).encode()).hexdigest()}))
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def folder_bytes(folder: Path) -> int:
    if not folder.exists():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def source(rows: int, files: int) -> tuple[list[pd.DataFrame], str]:
    rng = np.random.default_rng(SEED)
    words = np.array([f"w{i:05d}" for i in range(20_000)])
    texts = [" ".join(rng.choice(words, 12)) for _ in range(rows)]
    frame = pd.DataFrame({"id": np.arange(rows), "label": rng.integers(0, 1000, rows), "text": texts})
    expected = sorted(zip(frame["id"].tolist(), frame["label"].tolist(), frame["text"].tolist(), strict=True))
    digest = hashlib.sha256(json.dumps([list(row) for row in expected]).encode()).hexdigest()
    return [frame.iloc[i::files] for i in range(files)], digest


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    parts, digest = source(args.rows, args.files)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pffs-hf-copies-") as tmp:
        work = Path(tmp)
        with SeaweedS3(work / "seaweedfs") as s3:
            raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
            raw.mkdir(BUCKET)
            parquet = 0
            for n, part in enumerate(parts):
                buffer = io.BytesIO()
                part.to_parquet(buffer, index=False)
                raw.pipe(f"{BUCKET}/data/part-{n}.parquet", buffer.getvalue())
                parquet += len(buffer.getvalue())
            options = {k: v for k, v in s3.storage_options().items() if k != "skip_instance_cache"}
            for case in args.cases:
                folder = work / case
                pffs_cache, hf_cache, default = folder / "pffs", folder / "hf", folder / "default-pffs"
                env = {**os.environ, "PFFS_CACHE_DIR": str(default), "HF_HOME": str(folder / "hf-home")}
                result = subprocess.run(
                    [sys.executable, "-c", LOAD, case, f"{BUCKET}/data", json.dumps(options), str(pffs_cache),
                     str(hf_cache)],
                    capture_output=True, text=True, timeout=900, env=env, cwd=folder.parent,
                )  # fmt: skip
                if result.returncode != 0:
                    raise RuntimeError(f"{case}: {result.stderr[-3000:]}")
                got = json.loads(result.stdout.strip().splitlines()[-1])
                if (got["rows"], got["sha256"]) != (args.rows, digest):
                    raise RuntimeError(f"{case}: the rows differ from the source")
                row = {
                    "case": case,
                    "parquet_bytes": parquet,
                    "pffs_blocks": folder_bytes(pffs_cache / "blocks"),
                    "hf_downloads": folder_bytes(hf_cache / "downloads"),
                    "hf_arrow": folder_bytes(hf_cache) - folder_bytes(hf_cache / "downloads"),
                    "default_pffs": folder_bytes(default),
                }
                log(describe(row))
                rows.append(row)
    return rows


def describe(row: dict[str, Any]) -> str:
    mb = 1e6
    return (
        f"{row['case']:<20} parquet {row['parquet_bytes'] / mb:6.1f} MB: "
        f"pffs blocks {row['pffs_blocks'] / mb:6.1f}, "
        f"HF downloads {row['hf_downloads'] / mb:6.1f}, HF Arrow {row['hf_arrow'] / mb:6.1f}, "
        f"default pffs cache {row['default_pffs'] / mb:4.1f} MB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_copies.json")
    args = parser.parse_args()
    rows = run(args)
    for row in rows:
        print(describe(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
