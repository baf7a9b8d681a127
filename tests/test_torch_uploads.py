"""Checkpoints uploaded while they are written (pffs.torch.uploads, under pffs.torch.save and the DCP
writer) against the local S3 server: parts leave while the file is written, the object changes only when
the file is closed without an error, byte for byte; a failure, a rewrite and a stopped server leave the
previous object exact and no upload behind."""

from __future__ import annotations

import hashlib
import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, require, server_options, sha256

from pffs.testing.s3_server import SeaweedS3

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

PART = 5 << 20  # S3's least part size: several parts from small files


@pytest.fixture(autouse=True)
def _torch() -> None:
    require([] if importlib.util.find_spec("torch") else ["torch (the dev extra: make setup)"], "pffs.torch")


@pytest.fixture
def options(s3_options: dict[str, Any], cache_dir: Path) -> dict[str, Any]:
    return {**s3_options, "cache_dir": str(cache_dir)}


def filesystem(url: str, options: dict[str, Any]) -> Any:
    """The pffs filesystem pffs.torch uses for `url`, its uploads in small parts."""
    from pffs.sdk.helpers import filesystem_for

    fs, _ = filesystem_for(url, **options)
    fs.vfs.backend.upload_part_size = PART
    return fs


def pending_uploads(raw: Any, bucket: str) -> list[Any]:
    return list(raw.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))


def test_parts_leave_while_the_file_is_written_and_the_object_changes_only_at_the_end(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch.uploads import uploading

    old, new = pattern(3_000_000, seed=1), pattern(4 * PART + 12345, seed=2)
    raw_s3.pipe(f"{bucket}/ckpt/model.pt", old)
    fs = filesystem(f"s3://{bucket}/ckpt/model.pt", options)
    requests = fs.vfs.backend.requests
    before = requests.snapshot()["put"]["requests"]
    with uploading(fs, f"{bucket}/ckpt/model.pt") as f:
        for start in range(0, len(new), 1 << 20):
            f.write(new[start : start + (1 << 20)])
        # 3 whole parts written past: the upload is made and they are on their way (or in) ...
        assert fs.vfs.backend.requests.snapshot()["put"]["requests"] >= before + 1
        assert len(pending_uploads(raw_s3, bucket)) == 1
        # ... and the object is still the old one
        assert sha256(raw_s3.cat_file(f"{bucket}/ckpt/model.pt")) == sha256(old)
    assert sha256(raw_s3.cat_file(f"{bucket}/ckpt/model.pt")) == sha256(new)
    assert requests.snapshot()["put"]["requests"] == before + 5 + 2  # create, 5 parts, complete
    assert pending_uploads(raw_s3, bucket) == []
    assert list((Path(options["cache_dir"]) / "staging").iterdir()) == []


def test_a_write_that_fails_after_parts_were_sent_leaves_the_object_exact_and_no_upload(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    from pffs.torch.uploads import uploading

    old = pattern(2_000_000, seed=3)
    raw_s3.pipe(f"{bucket}/ckpt/model.pt", old)
    fs = filesystem(f"s3://{bucket}/ckpt/model.pt", options)
    with pytest.raises(RuntimeError, match="injected"), uploading(fs, f"{bucket}/ckpt/model.pt") as f:
        f.write(pattern(3 * PART, seed=4))
        f.write(pattern(1_000_000, seed=5))
        raise RuntimeError("injected: the writer fails midway")
    assert sha256(raw_s3.cat_file(f"{bucket}/ckpt/model.pt")) == sha256(old)
    assert pending_uploads(raw_s3, bucket) == []
    assert list((Path(options["cache_dir"]) / "staging").iterdir()) == []


def test_a_writer_that_goes_back_into_what_it_wrote_gets_its_final_bytes(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    """A seek back after parts were sent (a zip writer patching a header, say): the parts sent are
    dropped and the file is uploaded whole when it closes."""
    from pffs.torch.uploads import uploading

    data = bytearray(pattern(3 * PART + 7, seed=6))
    fs = filesystem(f"s3://{bucket}/ckpt/patched.bin", options)
    with uploading(fs, f"{bucket}/ckpt/patched.bin") as f:
        f.write(bytes(data))
        f.seek(100)
        f.write(b"patched")
        f.seek(0, io.SEEK_END)
        f.write(b"tail")
    data[100:107] = b"patched"
    data += b"tail"
    assert sha256(raw_s3.cat_file(f"{bucket}/ckpt/patched.bin")) == sha256(bytes(data))
    assert pending_uploads(raw_s3, bucket) == []


def test_pffs_torch_save_streams_a_checkpoint_byte_exact(
    raw_s3: Any, bucket: str, options: dict[str, Any]
) -> None:
    """pffs.torch.save of a checkpoint of several parts: the object is what torch.save writes to a
    buffer, byte for byte, and loads back equal."""
    import torch

    from pffs.torch import load, save

    url = f"s3://{bucket}/runs/model.pt"
    filesystem(url, options)
    state = {f"w{i}": torch.randn(1_000_000, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    save(state, url, **options)
    expected = io.BytesIO()
    torch.save(state, expected)
    assert sha256(raw_s3.cat_file(f"{bucket}/runs/model.pt")) == sha256(expected.getvalue())
    loaded = load(url, **options)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert fs_puts(url, options) > 3  # in parts


def fs_puts(url: str, options: dict[str, Any]) -> int:
    return int(filesystem(url, options).vfs.backend.requests.snapshot()["put"]["requests"])


def test_a_save_cut_off_by_the_server_stopping_leaves_the_previous_checkpoint_exact(tmp_path: Path) -> None:
    """The S3 server stops while pffs.torch.save is uploading: the save fails (within the backend
    deadline), and once the server is back the previous checkpoint is there, byte for byte."""
    import torch

    from pffs.torch import save

    with SeaweedS3(tmp_path / "own-server") as server:
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        raw.mkdir("stops")
        options = {**server_options(server), "cache_dir": str(tmp_path / "cache"), "backend_timeout": 2}
        url = "s3://stops/model.pt"
        save({"step": 1, "w": torch.zeros(10)}, url, **options)
        previous = hashlib.sha256(raw.cat_file("stops/model.pt")).hexdigest()
        fs = filesystem(url, options)
        native = fs.vfs.backend._native_getter()
        send = native.upload_part

        def upload_part(bucket: str, key: str, upload_id: str, number: int, body: Any) -> str:
            if number == 2 and server.process is not None and server.process.poll() is None:
                server.stop()
            return send(bucket, key, upload_id, number, body)

        native.upload_part = upload_part
        with pytest.raises(OSError, match=r"s3://stops/model\.pt"):
            save({"step": 2, "w": torch.randn(4_000_000)}, url, **options)
        server.start()
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())
        assert hashlib.sha256(raw.cat_file("stops/model.pt")).hexdigest() == previous
        assert list((tmp_path / "cache" / "staging").iterdir()) == []
