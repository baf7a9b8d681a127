"""The native core (native/, the extension module pffs._core): the same checksums as the pure-Python
xxhash package it replaced (so block files written before it stay valid), the GIL released while it works,
and a wheel that installs and runs where no Rust toolchain is."""

from __future__ import annotations

import json
import mmap
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
import venv
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from pffs import _core
from pffs.cache.block_format import (
    CorruptBlockError,
    check_block,
    header_size,
    pack_block,
    read_block_file,
    read_block_range,
    unpack_block,
)

REPO = Path(__file__).resolve().parents[1]
# The block layout as block_format wrote it in Python before the native core: magic, payload length,
# segment count, then one xxh3-64 per segment.
MAGIC = b"PFB3"
FIXED = struct.Struct("<4sQI")
SEGMENT = 32 << 10
SIZES = [0, 1, 3, 16, 17, 128, 129, 240, 241, 4095, 4097, SEGMENT - 1, SEGMENT, SEGMENT + 1, 100_003]


def reference(data: bytes | memoryview, segment: int) -> list[int]:
    """What block_format computed before the native core: xxhash's xxh3-64 of each segment."""
    view = memoryview(data).cast("B")
    return [xxhash.xxh3_64_intdigest(view[i : i + segment]) for i in range(0, len(view), segment)]


def old_block_header(payload: bytes) -> bytes:
    """A block header exactly as block_format wrote it with the xxhash package."""
    digests = reference(payload, SEGMENT)
    header = FIXED.pack(MAGIC, len(payload), len(digests)) + struct.pack(f"<{len(digests)}Q", *digests)
    return header.ljust(header_size(len(payload)), b"\0")


@pytest.mark.parametrize("size", [*SIZES, (3 << 20) + 12_345])
def test_digests_are_xxhash_xxh3_64_of_each_segment(size: int) -> None:
    data = random.Random(size).randbytes(size)
    for segment in (SEGMENT, 4096, max(size, 1), *((1, 7) if size < SEGMENT * 4 else ())):
        assert _core.xxh3_64_segments(data, segment) == reference(data, segment), segment


def test_any_contiguous_buffer_at_any_offset() -> None:
    data = random.Random(1).randbytes(5 * SEGMENT + 333)
    with mmap.mmap(-1, len(data)) as mapped:
        mapped[:] = data
        for offset in (0, 1, 3, 4095):
            want = reference(data[offset:], SEGMENT)
            assert _core.xxh3_64_segments(memoryview(data)[offset:], SEGMENT) == want
            assert _core.xxh3_64_segments(bytearray(data)[offset:], SEGMENT) == want
            view = memoryview(mapped)[offset:]
            assert _core.xxh3_64_segments(view, SEGMENT) == want
            view.release()
    assert _core.xxh3_64_segments(data=b"abc", segment=2) == reference(b"abc", 2)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(BufferError):
        _core.xxh3_64_segments(memoryview(b"abcdef")[::2], SEGMENT)  # not contiguous
    with pytest.raises(ValueError, match="positive"):
        _core.xxh3_64_segments(b"abc", 0)
    with pytest.raises(OverflowError):
        _core.xxh3_64_segments(b"abc", -1)
    with pytest.raises(TypeError):
        _core.xxh3_64_segments("abc", SEGMENT)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, 1, SEGMENT, 4 * SEGMENT + 5, 4 << 20])
def test_blocks_written_before_the_native_core_stay_valid(size: int) -> None:
    payload = random.Random(size).randbytes(size)
    old = old_block_header(payload)
    assert pack_block(payload) == old + payload
    check_block(old, payload)
    assert bytes(unpack_block(old + payload)) == payload
    if size:
        flipped = bytearray(payload)
        flipped[size // 2] ^= 0x40
        with pytest.raises(CorruptBlockError, match="checksum"):
            check_block(old, bytes(flipped))


def python_ran_during(call: Callable[[], object]) -> bool:
    """Whether a Python thread ran while `call()` (repeated up to 50 times) ran: it runs only while a native
    call has the GIL released. With a switch interval of minutes, a thread holding the GIL is never made to
    hand it over, so if the call kept it, the counting thread, woken just before the call, could not run
    one line until the call returned and the main thread went on to read the count."""
    count = [0]
    go = threading.Event()

    def counter() -> None:
        go.wait()
        for _ in range(10_000):  # then it ends, and so hands the GIL back
            count[0] += 1

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=counter, daemon=True)
    thread.start()
    sys.setswitchinterval(300)
    try:
        go.set()
        for _ in range(50):  # each call works for milliseconds; the thread wakes within far less
            call()
            if count[0]:
                break
        counted = count[0]
    finally:
        sys.setswitchinterval(interval)
    thread.join(timeout=60)
    return counted > 0


@pytest.mark.timeout(120)
def test_the_gil_is_released_while_it_hashes() -> None:
    data = bytes(64 << 20)
    ran = python_ran_during(lambda: _core.xxh3_64_segments(data, SEGMENT))
    assert ran, "no Python code ran while pffs._core hashed 64 MiB: the GIL was held"


@pytest.mark.parametrize("direct", [False, True])
def test_a_block_file_is_read_and_verified_natively(direct: bool, tmp_path: Path) -> None:
    """The disk tier's reads (pffs.cache.block_format over native/core/src/cache/block_file.rs): a whole
    block comes back as a view of the buffer it was read into; a range verifies only its
    segments and hands its header back for the next read; every kind of damage is refused."""
    size = 3 * SEGMENT + 77
    payload = random.Random(5).randbytes(size)
    path = tmp_path / "block"
    path.write_bytes(old_block_header(payload) + payload)
    for expected in (size, None):
        got = read_block_file(str(path), expected, direct)
        assert bytes(got) == payload
        assert isinstance(got, memoryview) and got.nbytes == size
    whole = read_block_file(str(path), size, direct)
    first, header = read_block_range(str(path), SEGMENT - 10, 2 * SEGMENT + 10, None, direct)
    again, same = read_block_range(str(path), 0, size + 100, header, direct)  # past the end: to the end
    assert first == payload[SEGMENT - 10 : 2 * SEGMENT + 10] and again == payload
    assert same is header and header.length == size
    assert bytes(whole) == payload
    stored = path.read_bytes()
    flipped = bytearray(stored)
    flipped[-9] ^= 1
    damaged = {
        "truncated": stored[:-1],
        "longer": stored + b"\0",
        "flipped": bytes(flipped),
        "foreign": b"PK\x03\x04" + bytes(8192),
        "empty": b"",
    }
    for name, content in damaged.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        for expected in (size, None):
            with pytest.raises(CorruptBlockError):
                read_block_file(str(bad), expected, direct)
    with pytest.raises(CorruptBlockError, match="expected"):
        read_block_file(str(path), size - 1, direct)
    with pytest.raises(FileNotFoundError):
        read_block_file(str(tmp_path / "missing"), size, direct)


@pytest.mark.timeout(120)
def test_the_gil_is_released_while_a_block_file_is_read(tmp_path: Path) -> None:
    payload = bytes(32 << 20)
    path = tmp_path / "block"
    path.write_bytes(pack_block(payload))
    ran = python_ran_during(lambda: read_block_file(str(path), len(payload)))
    assert ran, "no Python code ran while pffs._core read a 32 MiB block: the GIL was held"


def test_a_checkout_without_the_native_core_says_how_to_build_it() -> None:
    code = (
        "import sys\n"
        "class Unbuilt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'pffs._core':\n"
        "            raise ImportError('No module named pffs._core')\n"
        "sys.meta_path.insert(0, Unbuilt())\n"
        "import pffs.cache.block_format\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "native core (pffs._core) is not built" in result.stderr
    assert "make setup" in result.stderr


def cargo_cache_env() -> dict[str, str]:
    """The environment scripts/setup.sh builds the native core in: the same cached target folder, so the
    wheel's cargo build finds everything compiled already."""
    env = dict(os.environ)
    env.setdefault("CARGO_TARGET_DIR", str(Path.home() / ".cache/pffs-tools/cargo-target"))
    cargo_home = Path(env.get("CARGO_HOME", Path.home() / ".cargo")) / "bin"
    if shutil.which("cargo", path=env["PATH"]) is None and (cargo_home / "cargo").exists():
        env["PATH"] = f"{cargo_home}{os.pathsep}{env['PATH']}"
    return env


@pytest.mark.timeout(600)
def test_the_wheel_installs_and_runs_without_a_rust_toolchain(tmp_path: Path) -> None:
    """CI's wheel: `pip wheel .` builds an abi3 wheel with pffs._core in it, which installs into a clean
    virtualenv on a PATH with no cargo or rustc, and hashes there."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
        check=True,
        env=cargo_cache_env(),
        timeout=570,
    )
    (wheel,) = (tmp_path / "dist").glob("pffs-*.whl")
    assert wheel.name.endswith("-cp311-abi3-linux_x86_64.whl"), wheel.name

    venv.create(tmp_path / "venv", with_pip=True)  # pip from the standard library's ensurepip: no network
    python = tmp_path / "venv/bin/python"
    bare = {"PATH": f"{tmp_path / 'venv/bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    assert shutil.which("cargo", path=bare["PATH"]) is None
    assert shutil.which("rustc", path=bare["PATH"]) is None
    run = {"env": bare, "cwd": tmp_path, "check": True, "timeout": 120}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], **run)
    data = random.Random(7).randbytes(3 * SEGMENT + 11)
    smoke = (
        "import json, sys\n"
        "import pffs._core as core\n"
        "assert core.__file__.startswith(sys.prefix), core.__file__\n"
        "data = bytes.fromhex(sys.stdin.read())\n"
        f"print(json.dumps([core.xxh3_64_segments(d, {SEGMENT}) for d in (b'abc', data)]))\n"
    )
    result = subprocess.run(
        [python, "-I", "-c", smoke], input=data.hex(), capture_output=True, text=True, **run
    )
    assert json.loads(result.stdout) == [reference(b"abc", SEGMENT), reference(data, SEGMENT)]
