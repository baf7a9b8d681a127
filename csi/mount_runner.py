"""Runs the node's mount processes: starts each (pffs.fuse.launch), gives it a metrics port nobody else
holds, reaps it when it ends, copies its log lines to this process's stderr with the volume named (so
`kubectl logs` shows them), and serves every mount's metrics through one /metrics with a `volume` label.

The node plugin runs one itself when it starts mounts in its own container (tests, a plugin on the host);
`pffs csi-mounter` runs one in a pod of its own, so that mounts outlive restarts of the plugin (mounter.py).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from pffs.csi.metrics import MounterMetrics
from pffs.csi.ports import can_bind
from pffs.fuse.ending import describe_exit_code
from pffs.fuse.launch import start_mount_process
from pffs.fuse.options import MountOptions
from pffs.log_lines import logs_json, relayed_line

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
LOG_POLL_S = 0.5


@dataclass
class RunningMount:
    volume: str
    mountpoint: str
    pid: int
    popen: subprocess.Popen[bytes]
    metrics_port: int | None
    log_file: Path
    followed: Followed


class MountRunner:
    def __init__(self, metrics_ports: tuple[int, int] | None, metrics: MounterMetrics | None = None) -> None:
        self.metrics_ports = metrics_ports
        self.metrics = metrics or MounterMetrics()
        self._lock = threading.Lock()
        self._running: dict[int, RunningMount] = {}  # by the serving process's pid
        self._reserved: set[int] = set()  # ports of mounts being started
        self._relay = LogRelay()

    def start(self, options: MountOptions, volume: str, ready_timeout_s: float) -> int:
        """Starts a mount of `options` and waits until it serves; its pid. Raises MountStartError."""
        port = self._reserve_port()
        try:
            if port is not None:
                options = options.model_copy(update={"metrics_port": port, "metrics_address": "127.0.0.1"})
            assert options.log_file is not None
            followed = self._relay.follow(options.log_file, volume)
            try:
                process = start_mount_process(options, ready_timeout_s)
            except BaseException:
                self._relay.forget(options.log_file, followed)
                raise
            with self._lock:
                self._running[process.pid] = RunningMount(
                    volume,
                    str(options.mountpoint),
                    process.pid,
                    process.popen,
                    port,
                    options.log_file,
                    followed,
                )
                self.metrics.mounts.set(len(self._running))
            return process.pid
        finally:
            with self._lock:
                if port is not None:
                    self._reserved.discard(port)

    def _reserve_port(self) -> int | None:
        """A port of the range that no running or starting mount holds and that binds now: two volumes
        staged at once never get the same one."""
        if self.metrics_ports is None:
            return None
        first, last = self.metrics_ports
        with self._lock:
            taken = self._reserved | {m.metrics_port for m in self._running.values() if m.metrics_port}
            for port in range(first, last + 1):
                if port not in taken and can_bind("127.0.0.1", port):
                    self._reserved.add(port)
                    return port
        log.warning("no port left in %d-%d for a mount's /metrics; this mount serves none", first, last)
        return None

    def reap(self) -> list[tuple[RunningMount, int]]:
        """The mounts whose supervisor exited since the last call, with its exit status."""
        ended = []
        with self._lock:
            for pid, mount in list(self._running.items()):
                code = mount.popen.poll()
                if code is not None:
                    del self._running[pid]
                    ended.append((mount, code))
            self.metrics.mounts.set(len(self._running))
        for mount, code in ended:
            how = "clean" if code == 0 else "killed" if code < 0 or code >= 128 else "failed"
            self.metrics.mount_exits.labels(how).inc()
            self._relay.forget(mount.log_file, mount.followed, drain=True)
            if code != 0:
                log.warning(
                    "mount of volume %s (pid %d) exited %d: %s",
                    mount.volume,
                    mount.pid,
                    code,
                    describe_exit_code(code),
                )
        return ended

    def running(self) -> list[RunningMount]:
        with self._lock:
            return list(self._running.values())

    def collector(self) -> Collector:
        return MountsCollector(self)

    def close(self) -> None:
        self._relay.stop()


class MountsCollector(Collector):
    """Every running mount's /metrics, each series with the label `volume` added; a mount that does not
    answer within SCRAPE_TIMEOUT_S is left out of this scrape (and counted)."""

    def __init__(self, runner: MountRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        for mount in self.runner.running():
            if mount.metrics_port is None:
                continue
            try:
                families = _scrape(mount.metrics_port)
            except Exception:  # refused, timed out, cut short or garbled: this mount sits this scrape out
                self.runner.metrics.scrape_failures.inc()
                continue
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = type(family)(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = {**sample.labels, "volume": mount.volume}  # no mount series has its own
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from merged.values()


def _scrape(port: int) -> list[Any]:
    """A mount's metric families, but for its process's own runtime figures (not per volume)."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as answer:
        text = answer.read().decode()
    return [
        family
        for family in text_string_to_metric_families(text)
        if not family.name.startswith(("python_", "process_", "platform_"))
    ]


@dataclass
class Followed:
    """One mount's log being copied: which volume, and how far it has been read."""

    volume: str
    offset: int


class LogRelay:
    """Copies the lines mount processes append to their log files onto this process's stderr, each line
    prefixed with the volume, from a thread that looks every LOG_POLL_S."""

    def __init__(self) -> None:
        self._files: dict[Path, Followed] = {}  # log file → the mount now writing it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mount-logs", daemon=True)
        self._thread.start()

    def follow(self, log_file: Path, volume: str) -> Followed:
        try:
            offset = log_file.stat().st_size  # what earlier mounts of the volume wrote was shown then
        except OSError:
            offset = 0
        followed = Followed(volume, offset)
        with self._lock:
            self._files[log_file] = followed
        return followed

    def forget(self, log_file: Path, followed: Followed, drain: bool = False) -> None:
        """Stops copying `log_file` for the mount `followed` (not for a newer mount of the same volume,
        which writes the same file)."""
        if drain:
            self._copy(log_file)  # the last words of a mount that ended
        with self._lock:
            if self._files.get(log_file) is followed:
                del self._files[log_file]

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(LOG_POLL_S):
            with self._lock:
                files = list(self._files)
            for log_file in files:
                self._copy(log_file)

    def _copy(self, log_file: Path) -> None:
        with self._lock:
            followed = self._files.get(log_file)
            if followed is None:
                return
            try:
                with open(log_file, "rb") as source:
                    source.seek(followed.offset)
                    data = source.read(1 << 20)
            except OSError:
                return  # gone, or unreadable this time: the next round tries again
            end = data.rfind(b"\n") + 1  # whole lines only; the rest next time
            if not end and len(data) == 1 << 20:
                end = len(data)  # a line longer than the read: pass it on in pieces
            if not end:
                return
            followed.offset += end
        as_json = logs_json()  # `--log-format json`: the mounts' lines too, one JSON object each
        for line in data[:end].decode(errors="replace").splitlines():
            sys.stderr.write(relayed_line(line, followed.volume, as_json) + "\n")
        sys.stderr.flush()
