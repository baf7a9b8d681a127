"""Helpers shared by the tests: reference bytes, hashes, a pffs filesystem on a test cache, a fake HTTP
server (the Kubernetes API's stand-in) and a kubeconfig that reaches it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import fsspec
import numpy as np
import pytest


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pattern(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes where every 8-byte word differs, so a misplaced block cannot match by chance."""
    words = (size + 7) // 8
    data = (np.arange(words, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(seed * 97 + 1)).tobytes()
    return data[:size]


def pffs_fs(target: str, cache_dir: Path, **options: Any) -> Any:
    options.setdefault("block_size", "256K")
    return fsspec.filesystem(
        "pffs", target=target, cache_dir=str(cache_dir), skip_instance_cache=True, **options
    )


def server_options(server: Any) -> dict[str, Any]:
    """pffs keyword arguments that reach a SeaweedS3 server."""
    return {"endpoint_url": server.endpoint_url, "key": server.access_key, "secret": server.secret_key}


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler of a `FakeHttpServer` (its `api`) that reads and answers JSON: a GET, POST or
    PATCH goes to `_handle(method)`."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _handle(self, method: str) -> None:
        raise NotImplementedError

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _body(self) -> Any:
        """The request's JSON body, None without one."""
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _send(self, code: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeHttpServer:
    """An HTTP server on a free local port, in a thread of its own while in a `with` block, whose requests
    `handler` answers with this object as its `api`. `lock` guards what the handler and the test share."""

    def __init__(self, handler: type[JsonHandler]) -> None:
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (handler,), {"api": self}))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def poll(
    what: str,
    check: Callable[[], Any],
    timeout_s: float = 60.0,
    logs: Callable[[], str] = str,
    every_s: float = 0.2,
) -> Any:
    """`check()`'s first true result, polled every `every_s`; AssertionError naming `what` (with `logs()`,
    the logs of whatever was being waited on) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{logs()[-6000:]}")
        time.sleep(every_s)


def require(missing: list[str], what: str) -> None:
    """Skips saying what is missing, or fails where CI requires every server (PFFS_REQUIRE_SERVERS=1)."""
    if missing:
        message = f"{what} needs {', '.join(missing)}; run `make setup`"
        if os.environ.get("PFFS_REQUIRE_SERVERS") == "1":
            pytest.fail(message)
        pytest.skip(message)


# Certificates for mutual TLS (the openssl command)
def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(folder: Path) -> Path:
    folder.mkdir(parents=True)
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
        "-subj", "/CN=pffs cache group CA", "-keyout", str(folder / "ca.key"), "-out", str(folder / "ca.crt"),
    )  # fmt: skip
    return folder


def member_tls(ca: Path, folder: Path, name: str) -> Path:
    """A member's TLS folder (ca.crt, tls.crt, tls.key: a Kubernetes TLS Secret's files), signed by `ca`."""
    folder.mkdir(parents=True)
    key, request = folder / "tls.key", folder / "tls.csr"
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
        "-keyout", str(key), "-out", str(request),
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", str(request), "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
        "-CAcreateserial", "-days", "1", "-out", str(folder / "tls.crt"),
    )  # fmt: skip
    shutil.copy(ca / "ca.crt", folder / "ca.crt")
    return folder


def read_until_the_new_version(path: Path, old: bytes, new: bytes, within_s: float = 10.0) -> None:
    """Reads `path` whole until it gives `new`: every read gives the old version, the new one or ESTALE
    (a new open that pinned the old version after it changed), never a mix; fails after `within_s`."""
    import errno

    deadline = time.monotonic() + within_s
    while True:
        try:
            seen: bytes | None = path.read_bytes()
        except OSError as exc:
            assert exc.errno == errno.ESTALE
            seen = None
        assert seen in (old, new, None)
        if seen == new:
            return
        assert time.monotonic() < deadline, "the new version never showed"
        time.sleep(0.2)


def sha256_file(path: str) -> str:
    """(For a spawned worker: a module-level function.)"""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_readers_in_threads_and_processes(root: Path, files: dict[str, bytes], prefix: str) -> None:
    """Every file under `prefix`+"size-" read whole by 8 threads at once, 4 times each in a shuffled order,
    then the largest by 3 spawned processes: every read byte-exact."""
    import multiprocessing
    import random
    from concurrent.futures import ThreadPoolExecutor

    keys = [k for k in files if k.startswith(f"{prefix}size-")] * 4
    random.Random(3).shuffle(keys)

    def read(key: str) -> tuple[str, str]:
        return key, sha256((root / key.removeprefix(prefix)).read_bytes())

    with ThreadPoolExecutor(8) as pool:
        for key, digest in pool.map(read, keys):
            assert digest == sha256(files[key]), key
    largest = max(keys, key=lambda k: len(files[k]))
    with multiprocessing.get_context("spawn").Pool(3) as procs:
        digests = procs.map(sha256_file, [str(root / largest.removeprefix(prefix))] * 6)
    assert set(digests) == {sha256(files[largest])}
