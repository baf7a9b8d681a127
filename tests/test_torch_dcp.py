"""torch.distributed.checkpoint through pffs against the local S3 server, on 2 ranks (gloo, one process
each): pffs.torch.dcp's Writer and Reader, torch's own FsspecWriter/FsspecReader on "pffs::s3://...", saves
that fail on one rank (the previous checkpoint stays loadable, exactly), and the SDK's copy and move that
torch's writer needs. Every tensor loaded is compared with the one saved (torch.equal)."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
from helpers import pattern, require, sha256

from pffs.testing.s3_server import free_ports

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

WORLD_SIZE = 2
RANK_TIMEOUT_S = 180  # a rank still running then is killed (and the test fails)


@pytest.fixture(autouse=True)
def _torch() -> None:
    require([] if importlib.util.find_spec("torch") else ["torch (the dev extra: make setup)"], "pffs.torch")


@pytest.fixture
def options(s3_options: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    return {**s3_options, "cache_dir": str(cache_dir), "block_size": "256K"}


# One rank: runs the steps it is given (saves, loads, failing saves) in one process group and prints what
# it saw as one JSON line. Rank 0 also reads each step's .metadata from the store (plain s3fs).
RANK = r"""
import hashlib, json, os, pickle, sys
from datetime import timedelta

import s3fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from pffs.torch import DcpReader, DcpWriter

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
mesh = init_device_mesh("cpu", (world,))
config = json.loads(sys.argv[1])
raw = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **config["raw"])


def state(seed):
    # a tensor sharded over the ranks (DTensor), one every rank holds, one of this rank's own, a number
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(96, 1001, generator=g)
    replicated = torch.randn(4097, generator=g)
    own = [torch.randint(0, 1 << 40, (300_000,), generator=g) for _ in range(world)]
    return {"sharded": distribute_tensor(full, mesh, [Shard(0)]), "replicated": replicated,
            f"rank{rank}": own[rank], "step": seed}


def empty():
    return {"sharded": distribute_tensor(torch.zeros(96, 1001), mesh, [Shard(0)]),
            "replicated": torch.zeros(4097), f"rank{rank}": torch.zeros(300_000, dtype=torch.int64),
            "step": -1}


def same(loaded, expected):
    tensors = [k for k in expected if k != "step"]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    return loaded["step"] == expected["step"] and all(
        torch.equal(local(loaded[k]), local(expected[k])) for k in tensors)


class FailingWriter(DcpWriter):
    # rank `fail_rank` fails in write_data: "raise" after its shards are uploaded; "shard_gone" returns
    # its results but its shards vanish before the coordinator's finish
    def __init__(self, url, fail, fail_rank, **options):
        super().__init__(url, **options)
        self.fail, self.fail_rank = fail, fail_rank

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if self.rank == self.fail_rank:
            if self.fail == "raise":
                raise RuntimeError("injected: this rank fails after uploading its shards")
            if self.fail == "shard_gone":
                for result in future.value():
                    raw.rm(self.storage.concat_path(self.path, result.storage_data.relative_path))
        return future


def writer(step):
    if step["with"] == "fsspec":
        return FsspecWriter(step["url"], **config["layered"])
    if step.get("fail") in ("raise", "shard_gone"):
        return FailingWriter(step["url"], step["fail"], step["fail_rank"], **config["flat"])
    return DcpWriter(step["url"], **config["flat"])


def reader(step):
    if step["with"] == "fsspec":
        return FsspecReader(step["url"], **config["layered"])
    return DcpReader(step["url"], **config["flat"])


def metadata_of(url):
    path = url.split("://", 1)[1] + "/.metadata"
    try:
        data = raw.cat_file(path)
    except FileNotFoundError:
        return None
    names = sorted({info.relative_path for info in pickle.loads(data).storage_data.values()})
    return {"sha256": hashlib.sha256(data).hexdigest(), "shards": names}


seen = []
for step in config["steps"]:
    record = {"step": step}
    if step["do"] == "save":
        sd = state(step["seed"])
        if step.get("fail") == "unpicklable" and rank == step["fail_rank"]:
            sd["unpicklable"] = lambda: None  # torch.save of it fails in write_data
        try:
            dcp.save(sd, storage_writer=writer(step))
            record["saved"] = True
        except CheckpointException as exc:
            record["saved"], record["error"] = False, str(exc)[:2000]
    else:
        loaded = empty()
        dcp.load(loaded, storage_reader=reader(step))
        record["equal"] = same(loaded, state(step["seed"]))
    dist.barrier()
    if rank == 0:
        record["metadata"] = metadata_of(step["url"])
        record["listing"] = sorted(p.rsplit("/", 1)[1] for p in raw.find(step["url"].split("://", 1)[1]))
    dist.barrier()
    seen.append(record)
print(json.dumps({"rank": rank, "seen": seen}))
dist.destroy_process_group()
"""


def run_ranks(
    tmp_path: Path, steps: list[dict[str, Any]], options: dict[str, Any], raw: dict[str, Any]
) -> Any:
    """Runs `steps` on WORLD_SIZE ranks; returns each rank's records. Every rank is stopped on return."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    s3 = {k: v for k, v in options.items() if k in ("endpoint_url", "key", "secret")}
    # torch's reader opens the same names again, rewritten in place by other processes: pffs's metadata
    # (trusted for metadata_ttl, 60 s by default) would show it the save before. pffs.torch.dcp's Reader
    # needs no such setting: it stats what it opens.
    pffs = {k: v for k, v in options.items() if k not in s3} | {"metadata_ttl": 0}
    config = json.dumps({"steps": steps, "flat": options, "layered": {"s3": s3, "pffs": pffs}, "raw": raw})
    port = free_ports(1)[0]
    procs = []
    for rank in range(WORLD_SIZE):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        out = (tmp_path / f"rank{rank}.out").open("w")
        err = (tmp_path / f"rank{rank}.err").open("w")
        procs.append(subprocess.Popen([sys.executable, str(script), config], env=env, stdout=out, stderr=err))
    try:
        for proc in procs:
            proc.wait(timeout=RANK_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for rank, proc in enumerate(procs):
        stderr = (tmp_path / f"rank{rank}.err").read_text()
        assert proc.returncode == 0, f"rank {rank}: {stderr[-4000:]}"
        reports.append(json.loads((tmp_path / f"rank{rank}.out").read_text().strip().splitlines()[-1]))
    return [r["seen"] for r in reports]


def shards(listing: list[str]) -> list[str]:
    return [name for name in listing if name.endswith(".distcp")]


def test_writer_and_reader_round_trip_on_two_ranks_and_a_new_save_replaces_the_old_shards(
    bucket: str, options: dict[str, Any], s3_server: Any, tmp_path: Path
) -> None:
    """Saves on 2 ranks (a sharded DTensor, a replicated tensor, one per rank, a number), loads them back on
    2 ranks exactly; a second save to the same path gets shards of new names, loads back as itself (no
    stale .metadata from the cache), and leaves no shard of the first behind."""
    url = f"s3://{bucket}/runs/ckpt"
    steps = [
        {"do": "save", "with": "pffs", "url": url, "seed": 1},
        {"do": "load", "with": "pffs", "url": url, "seed": 1},
        {"do": "save", "with": "pffs", "url": url, "seed": 2},
        {"do": "load", "with": "pffs", "url": url, "seed": 2},
    ]
    ranks = run_ranks(tmp_path, steps, options, s3_server.storage_options())
    for seen in ranks:
        assert [r.get("saved", r.get("equal")) for r in seen] == [True] * 4
    first, _, second, _ = ranks[0]
    assert len(first["metadata"]["shards"]) == WORLD_SIZE  # one file per rank
    assert not set(first["metadata"]["shards"]) & set(second["metadata"]["shards"])
    # the store holds exactly what each .metadata names, and nothing staged
    assert shards(first["listing"]) == first["metadata"]["shards"]
    assert shards(second["listing"]) == second["metadata"]["shards"]
    assert sorted(second["listing"]) == sorted([".metadata", *second["metadata"]["shards"]])


def test_torch_fsspec_writer_and_reader_through_pffs_on_two_ranks(
    bucket: str, options: dict[str, Any], s3_server: Any, tmp_path: Path, raw_s3: Any
) -> None:
    """torch's own FsspecWriter/FsspecReader on "pffs::s3://..." (storage options per layer): a save, its
    load, a second save over it (its finish renames .metadata.tmp over .metadata: pffs's mv) and its load,
    exact, with no .metadata.tmp left."""
    url = f"pffs::s3://{bucket}/runs/torch"
    steps = [
        {"do": "save", "with": "fsspec", "url": url, "seed": 3},
        {"do": "load", "with": "fsspec", "url": url, "seed": 3},
        {"do": "save", "with": "fsspec", "url": url, "seed": 4},
        {"do": "load", "with": "fsspec", "url": url, "seed": 4},
    ]
    ranks = run_ranks(tmp_path, steps, options, s3_server.storage_options())
    for seen in ranks:
        assert [r.get("saved", r.get("equal")) for r in seen] == [True] * 4, seen
    for record in ranks[0]:
        assert ".metadata.tmp" not in record["listing"]
        assert sorted(record["listing"]) == sorted([".metadata", *record["metadata"]["shards"]])
    assert sorted(raw_s3.ls(f"{bucket}/runs/torch", detail=False)) == [
        f"{bucket}/runs/torch/.metadata",
        *(f"{bucket}/runs/torch/__{rank}_0.distcp" for rank in range(WORLD_SIZE)),
    ]


def test_a_save_that_fails_on_one_rank_leaves_the_previous_checkpoint_loadable_exactly(
    bucket: str, options: dict[str, Any], s3_server: Any, tmp_path: Path, raw_s3: Any
) -> None:
    """After a good save, three saves fail on rank 1: it raises after uploading its shards; an object of
    its state dict cannot be written; its shards vanish before the coordinator's finish (which checks each
    shard before it writes .metadata). After each, .metadata is the good save's, byte for byte, every
    shard it names is there, and both ranks load the good save exactly. The next good save then removes
    what the failed ones left."""
    url = f"s3://{bucket}/runs/safe"
    steps: list[dict[str, Any]] = [{"do": "save", "with": "pffs", "url": url, "seed": 5}]
    for fail in ("raise", "unpicklable", "shard_gone"):
        steps.append({"do": "save", "with": "pffs", "url": url, "seed": 6, "fail": fail, "fail_rank": 1})
        steps.append({"do": "load", "with": "pffs", "url": url, "seed": 5})
    steps.append({"do": "save", "with": "pffs", "url": url, "seed": 7})
    steps.append({"do": "load", "with": "pffs", "url": url, "seed": 7})
    ranks = run_ranks(tmp_path, steps, options, s3_server.storage_options())
    good = ranks[0][0]["metadata"]
    for seen in ranks:
        assert seen[0]["saved"] is True
        for failed, loaded in zip(seen[1:7:2], seen[2:7:2], strict=True):
            assert failed["saved"] is False, failed
            assert loaded["equal"] is True, failed
        assert seen[7]["saved"] is True and seen[8]["equal"] is True
    messages = [r["error"] for r in ranks[0][1:7:2]]
    assert "injected: this rank fails after uploading its shards" in messages[0]
    assert "a shard of this save is not in the store" in messages[2]  # the coordinator's check refused
    for record in ranks[0][1:7]:
        assert record["metadata"] == good  # the same .metadata, byte for byte
        assert set(good["shards"]) <= set(record["listing"])  # every shard it names is there
    # the failed saves did leave shards (never named by any .metadata) ...
    assert set(shards(ranks[0][5]["listing"])) > set(good["shards"])
    # ... which the next good save removed with the previous one's
    last = ranks[0][8]
    assert shards(last["listing"]) == last["metadata"]["shards"]
    data = raw_s3.cat_file(f"{bucket}/runs/safe/.metadata")
    for info in pickle.loads(data).storage_data.values():
        assert raw_s3.info(f"{bucket}/runs/safe/{info.relative_path}")["size"] >= info.offset + info.length


def test_copy_and_move_through_the_sdk_are_byte_exact_and_never_read_stale(
    bucket: str, options: dict[str, Any], raw_s3: Any
) -> None:
    """cp_file, copy, mv and rename through pffs (full "pffs::s3://" paths and paths under a target):
    byte-exact (sha256), a destination read (and cached) before an overwrite by copy or move reads the new
    bytes after it, a move leaves no source, into a folder it keeps the name; a missing source is
    FileNotFoundError."""
    big, small, other = pattern(3_000_000, seed=1), pattern(70_000, seed=2), pattern(500_001, seed=3)
    raw_s3.pipe(
        {f"{bucket}/src/big.bin": big, f"{bucket}/src/small.bin": small, f"{bucket}/src/o.bin": other}
    )
    fs = fsspec.filesystem("pffs", target_protocol="s3", skip_instance_cache=True, **options)

    fs.cp_file(f"pffs::s3://{bucket}/src/big.bin", f"pffs::s3://{bucket}/dst/a.bin")
    assert sha256(fs.cat_file(f"{bucket}/dst/a.bin")) == sha256(big)
    assert sha256(raw_s3.cat_file(f"{bucket}/src/big.bin")) == sha256(big)  # the source untouched
    # overwrite a destination pffs has read and cached: the next read is the copy
    fs.copy(f"{bucket}/src/small.bin", f"{bucket}/dst/a.bin")
    assert sha256(fs.cat_file(f"{bucket}/dst/a.bin")) == sha256(small)
    with fs.open(f"{bucket}/dst/a.bin") as f:
        assert sha256(f.read()) == sha256(small)
    # a move over a cached destination; the source is gone, for pffs and for the store
    assert fs.cat_file(f"{bucket}/src/o.bin") == other  # cached as existing
    fs.mv(f"{bucket}/src/o.bin", f"{bucket}/dst/a.bin")
    assert sha256(fs.cat_file(f"{bucket}/dst/a.bin")) == sha256(other)
    assert not fs.exists(f"{bucket}/src/o.bin") and not raw_s3.exists(f"{bucket}/src/o.bin")
    # rename (torch's finish uses it), into a folder keeping the name
    fs.rename(f"pffs::s3://{bucket}/dst/a.bin", f"pffs::s3://{bucket}/dst/b.bin")
    fs.mv(f"{bucket}/dst/b.bin", f"{bucket}/moved/")
    assert sha256(raw_s3.cat_file(f"{bucket}/moved/b.bin")) == sha256(other)
    assert not raw_s3.exists(f"{bucket}/dst/a.bin") and not raw_s3.exists(f"{bucket}/dst/b.bin")
    # a filesystem under a target: relative paths
    under = fsspec.filesystem("pffs", target=f"s3://{bucket}/src", skip_instance_cache=True, **options)
    under.cp_file("big.bin", "copy.bin")
    under.mv("copy.bin", "moved.bin")
    assert sha256(under.cat_file("moved.bin")) == sha256(big)
    assert sorted(under.ls("", detail=False)) == ["big.bin", "moved.bin", "small.bin"]
    with pytest.raises(FileNotFoundError):
        fs.cp_file(f"{bucket}/src/none.bin", f"{bucket}/dst/none.bin")
    with pytest.raises(FileNotFoundError):
        fs.mv(f"{bucket}/src/none.bin", f"{bucket}/dst/none.bin")


def test_import_pffs_torch_does_not_import_torch_distributed_checkpoint() -> None:
    code = (
        "import sys, pffs.torch; assert 'torch.distributed.checkpoint' not in sys.modules; "
        "from pffs.torch import DcpWriter; from pffs.torch.dcp import Writer; assert DcpWriter is Writer"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
