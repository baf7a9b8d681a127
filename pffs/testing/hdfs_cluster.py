"""A real HDFS on loopback for tests, the bench and trying pffs by hand: Hadoop's MiniDFSCluster (one
NameNode, two DataNodes, WebHDFS on) in a JVM of its own, run through our small Java main
(scripts/hdfs/PffsMiniDfs.java, built with the jars by scripts/build_hdfs.sh, which `make setup` runs).

    with MiniDfs(workdir) as hdfs:
        hdfs.url            # hdfs://127.0.0.1:PORT
        hdfs.webhdfs_url    # webhdfs://127.0.0.1:HTTP_PORT
        hdfs.stop_datanode(0); hdfs.start_datanode()
        hdfs.stop_namenode(); hdfs.start_namenode()
        hdfs.freeze(): ...  # the whole JVM stopped (SIGSTOP) inside the block: NameNode and DataNodes hang

By hand: `python -m pffs.testing.hdfs_cluster /tmp/hdfs` prints the URLs and runs until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

from pffs.testing.faults import frozen
from pffs.testing.s3_server import free_ports

HADOOP_VERSION = "3.4.2"
HADOOP_DIR = Path(
    os.environ.get("PFFS_HADOOP_DIR") or Path.home() / f".cache/pffs-tools/hadoop-{HADOOP_VERSION}"
)
LOG4J = """\
log4j.rootLogger=INFO, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File={log}
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=%d %p %c{{1}}: %m%n
"""


def missing_pieces() -> list[str]:
    """What running a MiniDfs needs and this machine lacks (empty: it can run)."""
    missing = [] if shutil.which("java") else ["java (a JDK 17)"]
    if not (HADOOP_DIR / "classes" / "PffsMiniDfs.class").exists():
        missing.append(f"Hadoop's MiniDFSCluster in {HADOOP_DIR} (scripts/build_hdfs.sh)")
    return missing


class MiniDfs:
    def __init__(self, workdir: str | Path, startup_timeout_s: float = 120.0) -> None:
        self.workdir = Path(workdir)
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[str] | None = None
        self.rpc_port = self.http_port = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._jetty_before: set[str] = set()

    @property
    def url(self) -> str:
        return f"hdfs://127.0.0.1:{self.rpc_port}"

    @property
    def webhdfs_url(self) -> str:
        return f"webhdfs://127.0.0.1:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "minidfs.log"

    def start(self) -> MiniDfs:
        missing = missing_pieces()
        if missing:
            raise RuntimeError(f"cannot start MiniDFSCluster: missing {', '.join(missing)}; run `make setup`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "log4j.properties").write_text(LOG4J.format(log=self.log_path))
        self._jetty_before = _jetty_folders()
        rpc, http = free_ports(2)
        classpath = f"{HADOOP_DIR / 'lib'}/*:{HADOOP_DIR / 'classes'}"
        self.process = subprocess.Popen(
            [
                "java",
                f"-Dlog4j.configuration=file:{self.workdir / 'log4j.properties'}",
                "-cp",
                classpath,
                "PffsMiniDfs",
                str(self.workdir / "data"),
                str(rpc),
                str(http),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.workdir / "minidfs.stderr", "w"),  # noqa: SIM115 (the child keeps it)
            text=True,
            cwd=self.workdir,
            start_new_session=True,  # a test's Ctrl-C reaches pytest, which stops us in order
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        try:
            ready = self._answer(self.startup_timeout_s)
            if not ready.startswith("READY "):
                raise RuntimeError(f"MiniDFSCluster did not start: {ready}\n{self.log_tail()}")
            _, rpc_port, http_port = ready.split()
            self.rpc_port, self.http_port = int(rpc_port), int(http_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _answer(self, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"MiniDFSCluster did not answer within {timeout_s:.0f} s") from None
        if line is None:
            raise RuntimeError(f"MiniDFSCluster exited\n{self.log_tail()}")
        return line

    def command(self, line: str, timeout_s: float = 120.0) -> None:
        """One command of PffsMiniDfs (see its source); RuntimeError if it fails."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self._answer(timeout_s)
        if answer != "OK":
            raise RuntimeError(f"MiniDFSCluster {line}: {answer}")

    def stop_datanode(self, index: int) -> None:
        self.command(f"stop-datanode {index}")

    def start_datanode(self) -> None:
        self.command("start-datanode")

    def make_files(self, directory: str, count: int, size: int) -> None:
        """`count` files directory/f00000... of `size` bytes, file i all bytes i % 251, written in-process.
        Empty files take about a millisecond each; a file with bytes costs a block write (~30 ms)."""
        self.command(f"make-files {directory} {count} {size}", timeout_s=600)

    def stop_namenode(self) -> None:
        self.command("stop-namenode")

    def start_namenode(self) -> None:
        self.command("start-namenode")

    def freeze(self) -> contextlib.AbstractContextManager[None]:
        """Every HDFS process stopped (SIGSTOP) inside the block, resumed after it, even on failure."""
        assert self.process is not None
        return frozen(self.process.pid)

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGCONT)  # a frozen JVM cannot shut down
            with contextlib.suppress(OSError, ValueError):
                assert process.stdin is not None
                process.stdin.write("quit\n")
                process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for folder in _jetty_folders() - self._jetty_before:  # what the DataNodes' web servers left
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> MiniDfs:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _jetty_folders() -> set[str]:
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    return {str(p) for p in tmp.glob("jetty-localhost-*")}


def main() -> int:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pffs-hdfs")
    with MiniDfs(workdir) as hdfs:
        print(f"HDFS: {hdfs.url}  WebHDFS: {hdfs.webhdfs_url}  (logs: {hdfs.log_path}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
