"""pffs.torch objects stream through the cache (issue 41): a transform gets a seekable, read-only file that
reads blocks as it is consumed, with the reader's read-ahead, pinned to one version of the object. Against
the local S3 server; every byte compared with the source."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import pickle
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from helpers import pattern, require, sha256

from pffs.backends.errors import ObjectChangedError

BLOCK = 256 << 10


@pytest.fixture(autouse=True)
def _torch() -> None:
    require([] if importlib.util.find_spec("torch") else ["torch (the dev extra: make setup)"], "pffs.torch")


@pytest.fixture
def options(s3_options: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    # Small blocks and a small read-ahead window: a few MiB make many blocks, and the window is exceeded.
    return {**s3_options, "cache_dir": str(cache_dir), "block_size": "256K", "readahead_size": "1M"}


def _lines(count: int) -> bytes:
    return b"".join(b"line %d %s\n" % (i, b"x" * (i * 37 % 300)) for i in range(count))


def test_an_object_is_a_seekable_file_read_block_by_block(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch import MapDataset, PffsObject

    text = _lines(40_000)  # ~6.5 MiB of lines of many lengths: lines cross block boundaries
    binary = pattern(3 * BLOCK + 12_345, seed=5)
    small = pattern(BLOCK, seed=6)  # one block: held whole
    raw_s3.pipe({f"{bucket}/d/a-text": text, f"{bucket}/d/b-binary": binary, f"{bucket}/d/c-small": small})
    dataset = MapDataset(f"s3://{bucket}/d", **options)

    obj = dataset[0]
    assert isinstance(obj, PffsObject) and isinstance(obj, io.BufferedIOBase)
    assert (obj.key, obj.url, obj.size) == ("d/a-text", f"s3://{bucket}/d/a-text", len(text))
    assert obj.readable() and obj.seekable() and not obj.writable()
    assert list(obj) == text.splitlines(keepends=True)  # iteration: readline across blocks
    assert obj.read() == b"" and obj.tell() == len(text)
    obj.seek(BLOCK - 10)
    assert obj.readline() == text[BLOCK - 10 : text.index(b"\n", BLOCK - 10) + 1]
    obj.seek(5)
    assert obj.readline(3) == text[5:8] and obj.readline(0) == b""
    obj.seek(-100, io.SEEK_END)
    assert obj.read() == text[-100:]
    assert obj.getvalue() == text and obj.tell() == len(text)  # getvalue leaves the position alone
    obj.close()
    assert obj.closed
    with pytest.raises(ValueError, match="closed file"):
        obj.read()

    with dataset[1] as obj:
        got = bytearray()
        chunk = bytearray(100_003)  # readinto in pieces that straddle blocks
        while count := obj.readinto(chunk):
            got += chunk[:count]
        assert bytes(got) == binary
        for offset, length in [(0, 10), (BLOCK - 1, 2), (2 * BLOCK, BLOCK), (len(binary) - 5, 100)]:
            assert obj.seek(offset) == offset
            assert obj.read(length) == binary[offset : offset + length]
        obj.seek(10)
        obj.seek(BLOCK, io.SEEK_CUR)
        assert obj.read1(50) == binary[BLOCK + 10 : BLOCK + 60]
        assert obj.read1() == binary[BLOCK + 60 : 2 * BLOCK]  # to the end of the block it is in
        view = memoryview(bytearray(BLOCK))
        assert obj.readinto1(view) == BLOCK and bytes(view) == binary[2 * BLOCK : 3 * BLOCK]
        obj.seek(len(binary) + 10)
        assert obj.read() == b"" and obj.readinto(chunk) == 0
        with pytest.raises(ValueError, match="negative seek position"):
            obj.seek(-1)
        # Pickled (an item leaving a DataLoader worker): its version and position; read on anywhere.
        obj.seek(BLOCK + 3)
        copy = pickle.loads(pickle.dumps(obj))
        assert (copy.key, copy.url, copy.tell()) == (obj.key, obj.url, BLOCK + 3)
        assert sha256(copy.read()) == sha256(binary[BLOCK + 3 :])
        assert repr(copy) == f"PffsObject('s3://{bucket}/d/b-binary', {len(binary)} bytes)"
    assert obj.closed

    obj = dataset[2]  # held whole from the start: getvalue and read() give the bytes held, pickled with them
    assert obj.getvalue() == small and obj.read() is obj.getvalue()
    obj.seek(7)
    copy = pickle.loads(pickle.dumps(obj))
    assert (copy.key, copy.tell(), copy.read()) == ("d/c-small", 7, small[7:])


def test_decoders_read_objects_as_they_stream(raw_s3: Any, bucket: str, options: dict[str, Any]) -> None:
    """torch.load, PIL and tarfile (seekable and stream modes) over multi-block objects, as transforms
    call them: what each decodes equals what was written."""
    import torch
    from PIL import Image

    from pffs.torch import MapDataset

    tensors = {"w": torch.arange(400_000, dtype=torch.float32), "step": 7}
    saved = io.BytesIO()
    torch.save(tensors, saved)
    noise = np.random.default_rng(9).bytes(600 * 500 * 3)  # PNG cannot shrink it below a few blocks
    image = Image.frombytes("RGB", (600, 500), noise)
    png = io.BytesIO()
    image.save(png, format="PNG")
    members = {f"s{i:03d}.bin": pattern(10_000 + 37_000 * i, seed=i) for i in range(30)}
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    objects = {"a.pt": saved.getvalue(), "b.png": png.getvalue(), "c.tar": shard.getvalue()}
    assert all(len(data) > 2 * BLOCK for data in objects.values())
    raw_s3.pipe({f"{bucket}/m/{name}": data for name, data in objects.items()})
    dataset = MapDataset(f"s3://{bucket}/m", **options)

    loaded = torch.load(dataset[0])
    assert torch.equal(loaded["w"], tensors["w"]) and loaded["step"] == 7
    with Image.open(dataset[1]) as decoded:
        assert decoded.tobytes() == image.tobytes()
    with tarfile.open(fileobj=dataset[2]) as tar:  # seekable mode: members by name, in any order
        for name in reversed(members):
            extracted = tar.extractfile(name)
            assert extracted is not None and extracted.read() == members[name]
    with dataset[2] as obj, tarfile.open(fileobj=obj, mode="r|") as stream:  # webdataset's way: a stream
        got = {member.name: stream.extractfile(member).read() for member in stream}  # type: ignore[union-attr]
    assert got == members


def test_an_object_overwritten_mid_read_raises_and_never_mixes_versions(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch import IterableDataset, MapDataset

    old, new = pattern(40 * BLOCK, seed=1), pattern(40 * BLOCK, seed=2)  # 10 MiB: 40 blocks, 1 MiB ahead
    raw_s3.pipe(f"{bucket}/v/obj.bin", old)
    obj = MapDataset(f"s3://{bucket}/v", **options)[0]
    head = obj.read(BLOCK + 5)
    raw_s3.pipe(f"{bucket}/v/obj.bin", new)
    read = bytearray(head)
    with pytest.raises(ObjectChangedError, match="changed while it was being read"):
        while data := obj.read(BLOCK):
            read += data
    assert len(read) < len(old) and bytes(read) == old[: len(read)]  # the old version's bytes, and only those
    obj.close()
    # Rewritten after the listing, before its item was made: read whole as it is now (as before streaming).
    dataset = IterableDataset(f"s3://{bucket}/v", shuffle=False, rank=0, world_size=1, **options)
    raw_s3.pipe(f"{bucket}/v/obj.bin", old)
    (obj,) = list(dataset)
    assert sha256(obj.read()) == sha256(old)


ITEMS = """
import hashlib, json, sys
import torch
from pffs.torch import MapDataset

if __name__ == "__main__":
    url, start, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    loader = torch.utils.data.DataLoader(
        MapDataset(url, **options), batch_size=None, num_workers=2, multiprocessing_context=start
    )
    got = {}
    for obj in loader:  # made in a worker, pickled to this process, read here
        head = obj.read(1000)
        got[obj.key] = [type(obj).__name__, obj.tell(), hashlib.sha256(head + obj.read()).hexdigest()]
        obj.close()
    print(json.dumps(got))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_objects_made_in_dataloader_workers_are_read_in_the_training_process(
    raw_s3: Any, bucket: str, options: dict[str, Any], tmp_path: Path, start: str
) -> None:
    """Items without a transform leave their worker pickled: one held whole with its bytes, a streamed one
    as its version and position, read on in the training process through its own pffs filesystem."""
    objects = {f"w/{i}.bin": pattern(size, seed=i) for i, size in enumerate([100, BLOCK, 5 * BLOCK + 3, 0])}
    raw_s3.pipe({f"{bucket}/{key}": data for key, data in objects.items()})
    script = tmp_path / "items.py"
    script.write_text(ITEMS)
    result = subprocess.run(
        [sys.executable, str(script), f"s3://{bucket}/w", start, json.dumps(options)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {key: ["PffsObject", min(1000, len(data)), sha256(data)] for key, data in objects.items()}
    assert json.loads(result.stdout) == expected


# -- 1 GiB tar shards through a DataLoader with 4 workers -------------------------------------------------

GIB = 1 << 30
SHARDS = {"shard-0.tar": GIB, "shard-1.tar": GIB, "shard-2.tar": 64 << 20, "shard-3.tar": 64 << 20}
MEMBER = 3 << 20  # members of up to 3 MiB (as large images or short clips)
DISTINCT = 16

LOADER = """
import hashlib, json, sys, tarfile
import torch
from pffs.torch import IterableDataset


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class Hashing:
    \"\"\"What tarfile reads from the object, hashed as it passes.\"\"\"

    def __init__(self, obj):
        self.obj, self.digest = obj, hashlib.sha256()

    def read(self, size=-1):
        data = self.obj.read(size)
        self.digest.update(data)
        return data

    def drain(self):  # what follows the archive's end marker: the record's padding
        buffer = bytearray(1 << 20)
        while count := self.obj.readinto(buffer):
            self.digest.update(memoryview(buffer)[:count])


def decode(obj):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS from here on: this shard's
    base = status("VmRSS")
    source = Hashing(obj)
    members = {}
    with tarfile.open(fileobj=source, mode="r|") as stream:  # webdataset's way: one pass, no seeking
        for member in stream:
            digest = hashlib.sha256()
            extracted = stream.extractfile(member)
            while chunk := extracted.read(1 << 20):
                digest.update(chunk)
            members[member.name] = digest.hexdigest()
    source.drain()
    obj.close()
    worker = torch.utils.data.get_worker_info()
    return {"key": obj.key, "sha256": source.digest.hexdigest(), "members": members, "base": base,
            "peak": status("VmHWM"), "worker": worker.id}


if __name__ == "__main__":
    url, options = sys.argv[1], json.loads(sys.argv[2])
    dataset = IterableDataset(url, shuffle=False, rank=0, world_size=1, transform=decode, **options)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=4, multiprocessing_context="fork"
    )
    print(json.dumps(list(loader)))
"""


class _HashingWriter:
    """A file being written, hashed as the bytes pass (so a 1 GiB shard is not read back to hash it)."""

    def __init__(self, f: Any) -> None:
        self.f, self.digest, self.offset = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.offset += len(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.offset


def _write_shard(path: Path, size: int, seed: int) -> tuple[str, dict[str, str]]:
    """A tar shard of about `size` bytes of members of up to MEMBER bytes: (its sha256, member -> sha256).
    The members are DISTINCT kinds of (length, bytes) in turn, each kind hashed once (a 1 GiB shard is
    generated and hashed in one pass); a member out of place still changes the shard's sha256."""
    kinds = []
    for kind in range(DISTINCT):
        data = pattern(MEMBER - kind * 7919 * 13, seed=seed * DISTINCT + kind)
        kinds.append((data, sha256(data)))
    members: dict[str, str] = {}
    with path.open("wb") as f:
        out = _HashingWriter(f)
        with tarfile.open(fileobj=out, mode="w") as tar:  # type: ignore[call-overload]
            written, n = 0, 0
            while written < size - MEMBER:
                data, digest = kinds[n % DISTINCT]
                info = tarfile.TarInfo(f"{seed:02d}-{n:05d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                members[info.name] = digest
                written += 512 + len(data)
                n += 1
    return out.digest.hexdigest(), members


@pytest.mark.timeout(600)
def test_gib_tar_shards_stream_through_4_workers_in_bounded_memory(
    raw_s3: Any, bucket: str, s3_options: dict[str, Any], tmp_path: Path
) -> None:
    """Two 1 GiB and two 64 MiB tar shards through a DataLoader with 4 fork workers, each decoding its
    shard with tarfile's stream mode as the shard arrives: every shard's sha256 and every member's exact,
    and no worker's RSS grows by more than a quarter of a shard while it decodes. What it holds is the
    read-ahead window (64 MiB by default), the blocks still queued for the disk tier (at most 64 MiB) and
    allocator slack: 137-160 MiB measured for a 1 GiB shard, 45-49 MiB for a 64 MiB one (before issue 41
    a worker held the whole shard, and the blocks it was joined from). 38 s on a 2-core machine with
    little else to do (load average 2.6); 97-100 s while it ran other work (load 8-10), when SeaweedFS
    took in the 2.1 GiB at about 40 MB/s (50 s) and the workers decoded it in 27 s."""
    # Uploaded through pffs's own S3 client: twice as fast here as s3fs, which hashes every byte it sends
    # over plain http (SigV4 payload signing); what the workers read is checked against the sha256 of the
    # bytes written, not of what was uploaded.
    uploads = fsspec.filesystem(
        "pffs", target_protocol="s3", cache_dir=str(tmp_path / "up"), skip_instance_cache=True, **s3_options
    )  # fmt: skip

    def put(seed: int, name: str) -> tuple[str, dict[str, str]]:
        path = tmp_path / name
        digests = _write_shard(path, SHARDS[name], seed)
        uploads.put_file(str(path), f"{bucket}/shards/{name}")
        path.unlink()
        return digests

    with ThreadPoolExecutor(2) as pool:  # one shard written while another is uploaded
        made = {name: pool.submit(put, seed, name) for seed, name in enumerate(SHARDS)}
        expected = {f"shards/{name}": future.result() for name, future in made.items()}
    script = tmp_path / "loader.py"
    script.write_text(LOADER)
    options = {**s3_options, "cache_dir": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, str(script), f"s3://{bucket}/shards", json.dumps(options)],
        capture_output=True, text=True, timeout=540, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    items = json.loads(result.stdout)
    assert sorted(item["worker"] for item in items) == [0, 1, 2, 3]  # a shard per worker
    got = {item["key"]: (item["sha256"], item["members"]) for item in items}
    assert got == expected
    growth = {item["key"]: item["peak"] - item["base"] for item in items}
    print("peak RSS growth per worker, MiB:", {k: round(v / (1 << 20), 1) for k, v in growth.items()})
    assert all(grown < GIB // 4 for grown in growth.values()), growth
