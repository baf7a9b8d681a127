"""A real pffs mount for tests: `pffs mount` in a subprocess, always unmounted and stopped afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PFFS = [sys.executable, "-m", "pffs.cli.main"]


def pffs(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PFFS, *args], env=env, capture_output=True, text=True, timeout=timeout)


class Mount:
    def __init__(
        self, source: str, mountpoint: Path, cache_dir: Path, env: dict[str, str], *extra: str
    ) -> None:
        self.source = source
        self.path = mountpoint
        self.cache_dir = cache_dir
        self.env = env
        self.extra = extra
        self.pid: int | None = None
        self.log_file = cache_dir.parent / f"{mountpoint.name}.log"

    def start(self) -> Mount:
        if not _stale(self.path):  # a dead mount there is pffs mount's to clean up
            self.path.mkdir(parents=True, exist_ok=True)
        result = pffs(
            "mount",
            self.source,
            str(self.path),
            "--cache-dir",
            str(self.cache_dir),
            "--log-file",
            str(self.log_file),
            *self.extra,
            env=self.env,
        )
        if result.returncode != 0:
            raise RuntimeError(f"pffs mount failed ({result.returncode}): {result.stderr}\n{self.log()}")
        found = re.search(r"\(pid (\d+)", result.stderr)
        self.pid = int(found.group(1)) if found else None
        assert os.path.ismount(self.path), "pffs mount returned before the mount was ready"
        return self

    def log(self) -> str:
        try:
            return self.log_file.read_text()[-4000:]
        except OSError:
            return ""

    def stats(self) -> dict[str, Any]:
        import json

        return json.loads(os.getxattr(self.path, "user.pffs.stats"))

    def umount(self) -> subprocess.CompletedProcess[str]:
        return pffs("umount", str(self.path), env=self.env)

    def kill(self) -> None:
        """Whatever state it is in: unmounted, the process gone."""
        if os.path.ismount(self.path) or _stale(self.path):
            with contextlib.suppress(Exception):
                self.umount()
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _exists(self.pid):
                time.sleep(0.05)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def __enter__(self) -> Mount:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stale(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno in (107, 5)
    return False


@contextlib.contextmanager
def mounted(
    source: str, tmp_path: Path, env: dict[str, str], *extra: str, name: str = "mnt"
) -> Iterator[Mount]:
    with Mount(source, tmp_path / name, tmp_path / "cache", env, *extra) as mount:
        yield mount


def drop_page_cache() -> None:
    """Drops the kernel's page, dentry and inode caches (needs root; the tests run as root here)."""
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
