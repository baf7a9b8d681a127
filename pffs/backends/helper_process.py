"""A filesystem client run in helper processes of its own: for a forked child (a PyTorch DataLoader worker)
whose parent had used a client that does not survive fork.

hdfs-native is such a client: its Rust runtime's threads are not copied by fork, and a lock one of them
held at that moment stays held in the child, so a child's HDFS calls could hang for good (1 child in 3
here, right after the parent read a block). A helper is a fresh interpreter started with subprocess (so it
also works in daemonic DataLoader workers, which may not start multiprocessing children); it makes the
client with the same options and answers one call at a time over its pipes. Several helpers serve calls
in parallel. A helper ends when its pipe closes, that is when the process that started it ends, however
it ends.

Each call waits only until the caller's backend deadline (deadline.py); a helper that has not answered by
then is killed, and the next call starts a new one.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import fsspec

from pffs.backends.deadline import timeout_left

MAX_HELPERS = 4  # calls in flight at once; a DataLoader worker reads a few blocks ahead, no more
NO_DEADLINE_S = 3600.0  # a call's wait where no deadline is set (the backend's retry layer always sets one)
_HEADER = struct.Struct("!Q")  # each message: its length, then its pickle
Request = tuple[str, tuple[Any, ...], dict[str, Any]]  # (method, args, kwargs)
_client_made_in = 0  # the process that made a client that does not survive fork (0: none)


def fork_safe_client(protocol: str, storage_options: dict[str, Any]) -> Any:
    """The fsspec client itself; in a process forked after an ancestor made one, the same client in helper
    processes."""
    global _client_made_in
    if _client_made_in not in (0, os.getpid()):
        return HelperProcessFileSystem(protocol, storage_options)
    fs = fsspec.filesystem(protocol, **storage_options)
    _client_made_in = os.getpid()
    return fs


class HelperProcessFileSystem:
    """The calls pffs makes on an fsspec filesystem, each made by a helper process's own client."""

    bounds_its_own_calls = True  # Backend: no thread of its own is needed to bound a call by the deadline

    def __init__(self, protocol: str, storage_options: dict[str, Any]) -> None:
        self.protocol = protocol
        self._setup = pickle.dumps((protocol, storage_options))
        self._cls = fsspec.get_filesystem_class(protocol)
        self._idle: list[_Helper] = []
        self._started = 0
        self._room = threading.Condition()

    def _strip_protocol(self, path: str) -> str:
        return str(self._cls._strip_protocol(path))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("timeout", None)
        helper = self._take()
        try:
            ok, answer = helper.call((method, args, kwargs), timeout_left(NO_DEADLINE_S))
        except BaseException:  # no answer in time, or the helper died: it is not reused
            helper.kill()
            self._give_back_slot()
            raise
        with self._room:
            self._idle.append(helper)
            self._room.notify()
        if not ok:
            raise answer
        return answer

    def _take(self) -> _Helper:
        with self._room:
            while not self._idle and self._started >= MAX_HELPERS:
                self._room.wait()
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            return _Helper(self._setup)
        except BaseException:
            self._give_back_slot()
            raise

    def _give_back_slot(self) -> None:
        """One helper fewer (killed, or never started): a waiting call may start another."""
        with self._room:
            self._started -= 1
            self._room.notify()

    def info(self, path: str, **kwargs: Any) -> Any:
        return self._call("info", path, **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._call("ls", path, detail=detail, **kwargs)

    def find(self, path: str, **kwargs: Any) -> Any:
        return self._call("find", path, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        return self._call("cat_file", path, start=start, end=end, **kwargs)

    def put_file(self, local_path: str, path: str, **kwargs: Any) -> None:
        self._call("put_file", local_path, path, **kwargs)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._call("pipe_file", path, value, **kwargs)

    def rm_file(self, path: str, **kwargs: Any) -> None:
        self._call("rm_file", path, **kwargs)

    def mv(self, source: str, target: str, **kwargs: Any) -> None:
        self._call("mv", source, target, **kwargs)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._call("mkdir", path, create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False, **kwargs: Any) -> None:
        self._call("makedirs", path, exist_ok=exist_ok, **kwargs)

    def rmdir(self, path: str, **kwargs: Any) -> None:
        self._call("rmdir", path, **kwargs)

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing to drop here; a helper's client keeps no listings (skip_instance_cache, as pffs makes
        every client)."""

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> IO[bytes]:
        """Writes only (pffs reads through its own cache): the bytes are kept and put whole at close."""
        if not mode.startswith(("w", "x")) or "+" in mode:
            raise NotImplementedError(f"mode {mode!r} in a forked child's helper process client")
        return _PutOnClose(self, path)


class _PutOnClose(io.BytesIO):
    def __init__(self, fs: HelperProcessFileSystem, path: str) -> None:
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._fs.pipe_file(self._path, data)


class _Helper:
    """One helper process and its two pipes."""

    def __init__(self, setup: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from pffs.backends.helper_process import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._out, self._in = self.process.stdin, self.process.stdout.fileno()
        self._send(setup)

    def _send(self, payload: bytes) -> None:
        self._out.write(_HEADER.pack(len(payload)))
        self._out.write(payload)
        self._out.flush()

    def call(self, request: Request, timeout_s: float) -> tuple[bool, Any]:
        """(True, the call's result) or (False, the exception it raised)."""
        self._send(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        give_up = time.monotonic() + timeout_s
        (size,) = _HEADER.unpack(self._receive(_HEADER.size, give_up))
        answer = self._receive(size, give_up)
        try:
            ok, value = pickle.loads(answer)
        except Exception as exc:  # an exception class that cannot be rebuilt from its pickle
            return False, OSError(f"the helper process's answer could not be read: {exc}")
        return bool(ok), value

    def _receive(self, size: int, give_up: float) -> bytes:
        buffer = bytearray()
        while len(buffer) < size:
            left = give_up - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("no answer")
            chunk = os.read(self._in, min(size - len(buffer), 1 << 20))
            if not chunk:
                raise ConnectionError(f"the helper process ended (exit code {self.process.poll()})")
            buffer += chunk
        return bytes(buffer)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._out.close()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    def receive() -> bytes | None:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None  # the process that started us is gone
        return requests.read(_HEADER.unpack(header)[0])

    setup = receive()
    if setup is None:
        return
    protocol, storage_options = pickle.loads(setup)
    fs = fsspec.filesystem(protocol, **storage_options)
    while (request := receive()) is not None:
        method, args, kwargs = pickle.loads(request)
        try:
            answer = pickle.dumps((True, getattr(fs, method)(*args, **kwargs)), protocol=5)
        except Exception as exc:  # the caller's retry layer decides what it means
            try:
                answer = pickle.dumps((False, exc), protocol=5)
            except Exception:
                answer = pickle.dumps((False, OSError(f"{type(exc).__name__}: {exc}")), protocol=5)
        answers.write(_HEADER.pack(len(answer)))
        answers.write(answer)
        answers.flush()


def main() -> None:
    """A helper's life: answers go to the pipe behind fd 1; what a library prints goes to stderr."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, answers)
