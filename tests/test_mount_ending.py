"""Every way a mount can end leaves a last line in its log that says how, and an exit status of its own
(pffs.fuse.ending): a request (SIGTERM), an unmount from outside, an aborted FUSE connection, an exception in
the serving loop, and, seen by the supervisor, SIGKILL, the out-of-memory killer and a native crash; a mount
killed with its supervisor is reported by the next one. Real mounts of a local folder (no S3 server).

The mount is started as `pffs mount` starts it (pffs.fuse.launch), so this test's process is the
supervisor's parent and reads its real exit status.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mounts import pffs

from pffs.config import CacheSettings
from pffs.fuse import ending, mount_record
from pffs.fuse.launch import options_with_credentials, start_mount_process
from pffs.fuse.mount import how_serving_ended, serving_failed
from pffs.fuse.options import MountOptions
from pffs.processes import is_alive, process_title, public_url

pytestmark = pytest.mark.timeout(120)

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")


@dataclass
class Started:
    pid: int  # the serving process
    supervisor: subprocess.Popen[bytes]
    path: Path
    log_file: Path
    record: Path

    def log(self) -> str:
        return self.log_file.read_text()

    def last_line(self) -> str:
        return self.log().rstrip("\n").splitlines()[-1]

    def wait(self, timeout_s: float = 30) -> int:
        return self.supervisor.wait(timeout=timeout_s)

    def state(self) -> dict[str, object]:
        data = json.loads(self.record.read_text())
        assert isinstance(data, dict)
        return data


def options_for(tmp_path: Path, attr_ttl: float = 1.0, **overrides: object) -> MountOptions:
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "hello.txt").write_text("hello\n")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir(exist_ok=True)
    cache = CacheSettings(cache_dir=tmp_path / "cache", **overrides)  # type: ignore[arg-type]
    return MountOptions(
        source=str(source),
        mountpoint=mountpoint,
        cache=cache,
        log_file=tmp_path / "mount.log",
        attr_ttl=attr_ttl,
    )


def poll(what: str, condition: Callable[[], object], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def is_dead_mount(path: Path) -> bool:
    """ENOTCONN (ECONNABORTED, just after an abort), from a call the kernel must ask the mount about (a
    stat of the root may be answered from the attributes the kernel keeps for --attr-ttl)."""
    try:
        os.listdir(path)
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def is_listed(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


@contextlib.contextmanager
def started(
    tmp_path: Path,
    start: Callable[[MountOptions], tuple[int, subprocess.Popen[bytes]]] | None = None,
    attr_ttl: float = 1.0,
    **overrides: object,
) -> Iterator[Started]:
    """A mount of a local folder; afterwards nothing of it is left: both processes ended, nothing mounted."""
    options = options_for(tmp_path, attr_ttl, **overrides)
    if start is None:
        process = start_mount_process(options, ready_timeout_s=60)
        pid, supervisor = process.pid, process.popen
    else:
        pid, supervisor = start(options)
    record = tmp_path / "mount.state.json"
    mount = Started(pid, supervisor, options.mountpoint, tmp_path / "mount.log", record)
    try:
        assert is_listed(mount.path)  # (it may have died already: the failing one)
        yield mount
    finally:
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGTERM)  # passed on to the serving process
            with contextlib.suppress(subprocess.TimeoutExpired):
                supervisor.wait(timeout=15)
        for leftover in (pid, supervisor.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)
        supervisor.wait(timeout=15)
        poll("the serving process is gone", lambda: not is_alive(pid), timeout_s=15)
        if is_listed(mount.path):
            subprocess.run(["fusermount3", "-u", str(mount.path)], capture_output=True, timeout=30)
        if is_listed(mount.path):
            subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], capture_output=True, timeout=30)


def serving_pid_of(mountpoint: Path) -> int:
    return int(os.getxattr(mountpoint, "user.pffs.pid"))


# A request


@pytest.mark.parametrize("whom", ["serving", "supervisor"])
def test_sigterm_to_either_process_unmounts_with_exit_0_and_says_so(tmp_path: Path, whom: str) -> None:
    # attr_ttl 0: a stat of the mountpoint by the mount itself once it stopped serving would wait for ever
    with started(tmp_path, attr_ttl=0) as mount:
        assert serving_pid_of(mount.path) == mount.pid
        assert (mount.path / "hello.txt").read_text() == "hello\n"
        os.kill(mount.pid if whom == "serving" else mount.supervisor.pid, signal.SIGTERM)
        assert mount.wait() == ending.EXIT_UNMOUNTED
        assert not is_listed(mount.path)
        line = mount.last_line()
        assert f"(pid {mount.pid}) ended: SIGTERM: unmounted on request [exit 0]" in line, mount.log()
        assert mount.state()["state"] == "ended" and mount.state()["exit_code"] == 0


def test_pffs_umount_ends_with_exit_0(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        result = pffs("umount", str(mount.path), timeout=60)
        assert result.returncode == 0, result.stderr
        assert mount.wait() == ending.EXIT_UNMOUNTED
        assert "SIGTERM: unmounted on request [exit 0]" in mount.last_line()


# The kernel ends the session


def test_unmounted_from_outside_ends_with_its_own_status(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        unmount_from_outside(mount.path)
        assert mount.wait() == ending.EXIT_UNMOUNTED_OUTSIDE
        assert "ended: unmounted from outside (umount or fusermount3 -u) [exit 4]" in mount.last_line()
        assert not is_listed(mount.path)


def unmount_from_outside(path: Path, timeout_s: float = 15) -> None:
    """`fusermount3 -u`, as a user would, again while it says busy: another process on this machine (a
    kubelet or a `find` walking mounts) may hold the fresh mount for a moment, as one did in CI."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(["fusermount3", "-u", str(path)], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return
        if "busy" not in done.stderr or time.monotonic() > deadline:
            raise AssertionError(f"fusermount3 -u {path} failed ({done.returncode}): {done.stderr.strip()}")
        time.sleep(0.2)


@pytest.fixture
def fuse_connections() -> Iterator[Path]:
    """/sys/fs/fuse/connections, mounted (fusectl) for the test if it was not."""
    path = Path("/sys/fs/fuse/connections")
    mounted_here = False
    if not is_listed(path):
        if os.geteuid() != 0:
            pytest.skip("needs root to mount fusectl at /sys/fs/fuse/connections")
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(path)], check=True, capture_output=True)
        mounted_here = True
    try:
        yield path
    finally:
        if mounted_here:
            subprocess.run(["umount", str(path)], capture_output=True)


def test_aborted_fuse_connection_ends_with_its_own_status_and_leaves_the_dead_mount(
    tmp_path: Path, fuse_connections: Path
) -> None:
    with started(tmp_path) as mount:
        connection = os.minor(os.stat(mount.path).st_dev)
        (fuse_connections / str(connection) / "abort").write_text("1")
        assert mount.wait() == ending.EXIT_CONNECTION_ABORTED
        line = mount.last_line()
        assert "ended: the kernel's FUSE connection was aborted" in line and "[exit 5]" in line, mount.log()
        assert f"`pffs umount {mount.path}` detaches the dead mount" in line
        assert is_listed(mount.path) and is_dead_mount(mount.path)  # left in place: ENOTCONN, loud


# An exception in the serving loop. There is no real way to make it raise (every handler maps every
# exception to an errno), so the mount process here is the real one with pyfuse3.main replaced.

FAILING_DAEMON = """
import sys, pyfuse3
async def main(**kwargs):
    raise RuntimeError("injected by the test")
pyfuse3.main = main
from pffs.cli.mount_daemon import main as daemon
sys.exit(daemon())
"""


def start_failing(options: MountOptions) -> tuple[int, subprocess.Popen[bytes]]:
    return start_daemon(options, [sys.executable, "-c", FAILING_DAEMON])


def start_daemon(
    options: MountOptions, command: list[str], preexec: Callable[[], None] | None = None
) -> tuple[int, subprocess.Popen[bytes]]:
    """As pffs.fuse.launch starts the mount process, with another command or a hook before it runs."""
    assert options.log_file is not None
    with open(options.log_file, "ab") as log:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, preexec_fn=preexec
        )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(options_with_credentials(options))
    child.stdin.close()
    answer = child.stdout.readline().decode()
    child.stdout.close()
    found = re.fullmatch(r"ok (\d+)\n", answer)
    if not found:
        child.kill()
        child.wait()
        raise AssertionError(f"the mount did not start: {answer!r}\n{options.log_file.read_text()}")
    return int(found.group(1)), child


def test_exception_in_the_serving_loop_ends_with_its_own_status_and_a_traceback(tmp_path: Path) -> None:
    with started(tmp_path, start=start_failing) as mount:
        assert mount.wait() == ending.EXIT_INTERNAL_ERROR
        log = mount.log()
        assert (
            "the mount's serving loop failed" in log and "Traceback" in log and "injected by the test" in log
        )
        line = mount.last_line()
        assert "ended: internal error: RuntimeError: injected by the test" in line and "[exit 6]" in line, log
        assert is_listed(mount.path) and is_dead_mount(mount.path)  # left dead in place, not unmounted


def test_how_serving_ended_and_serving_failed_map_to_the_codes() -> None:
    where = Path("/mnt/x")
    assert how_serving_ended("SIGINT", True, where).code == ending.EXIT_UNMOUNTED
    assert how_serving_ended(None, False, where).code == ending.EXIT_UNMOUNTED_OUTSIDE
    assert how_serving_ended(None, True, where).code == ending.EXIT_CONNECTION_ABORTED
    # `pffs umount --lazy`: the mount detached itself, and ended when the last process let go
    lazy = how_serving_ended(None, False, where, detached=True)
    assert lazy.code == ending.EXIT_UNMOUNTED and "pffs umount --lazy" in lazy.cause
    assert how_serving_ended(None, True, where, detached=True).code == ending.EXIT_CONNECTION_ABORTED
    failed = serving_failed(KeyError("k"), where)
    assert failed.code == ending.EXIT_INTERNAL_ERROR and "KeyError" in failed.cause


# Signals, seen by the supervisor


def test_sigkill_of_the_serving_process_is_reported_by_the_supervisor_with_137(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        os.kill(mount.pid, signal.SIGKILL)
        assert mount.wait() == 128 + signal.SIGKILL == 137
        line = mount.last_line()
        assert f"pffs[{mount.supervisor.pid}] CRITICAL" in line, mount.log()
        assert f"(pid {mount.pid}) ended: killed by SIGKILL (kill -9, or the OOM killer)" in line
        assert f"`pffs umount {mount.path}` detaches the dead mount; then mount again [exit 137]" in line
        assert is_dead_mount(mount.path)  # left in place
        assert mount.state()["state"] == "ended" and mount.state()["exit_code"] == 137


def test_sigsegv_dumps_every_thread_into_the_log_and_the_supervisor_says_139(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        assert (mount.path / "hello.txt").read_text() == "hello\n"  # serving: trio's loop runs
        os.kill(mount.pid, signal.SIGSEGV)
        assert mount.wait() == 128 + signal.SIGSEGV
        log = mount.log()
        dump = log[log.index("Fatal Python error: Segmentation fault") :]
        assert "Current thread" in dump and "in _mount_and_serve" in dump and "in serve" in dump, log
        assert "ended: killed by SIGSEGV: a native crash" in mount.last_line() and "[exit 139]" in log


def test_sigusr1_dumps_stacks_into_the_log_and_goes_on(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        os.kill(mount.pid, signal.SIGUSR1)
        poll("the stacks are in the log", lambda: "in _mount_and_serve" in mount.log())
        assert (mount.path / "hello.txt").read_text() == "hello\n"


@dataclass
class MemoryCgroup:
    path: Path

    def limit(self, size: int) -> None:
        (self.path / "memory.limit_in_bytes").write_text(str(size))
        with contextlib.suppress(OSError):  # no swap to hide in, where there is swap
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(size))

    def usage(self) -> int:
        return int((self.path / "memory.usage_in_bytes").read_text())

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def join(self) -> None:
        """Moves the calling process in (for a child, between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    if os.geteuid() != 0 or not (MEMORY_CGROUPS / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and cgroup v1's memory controller")
    group = MemoryCgroup(MEMORY_CGROUPS / f"pffs-test-{uuid.uuid4().hex[:8]}")
    group.path.mkdir()
    try:
        yield group
    finally:
        for pid in group.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        poll("the cgroup is empty", lambda: not group.pids(), timeout_s=15)
        group.path.rmdir()


@pytest.mark.timeout(180)
def test_the_oom_killer_is_named_by_the_supervisor(tmp_path: Path, memory_cgroup: MemoryCgroup) -> None:
    big = tmp_path / "src" / "big.bin"
    big.parent.mkdir()
    with open(big, "wb") as f:
        for _ in range(64):  # 256 MiB, none of it in the 1 GiB memory tier yet
            f.write(os.urandom(4 << 20))

    def start(options: MountOptions) -> tuple[int, subprocess.Popen[bytes]]:
        # The supervisor and the serving process live in the cgroup from their start.
        return start_daemon(options, [sys.executable, "-m", "pffs.cli.mount_daemon"], memory_cgroup.join)

    with started(tmp_path, start=start, memory_cache_size=1 << 30) as mount:
        assert sorted(memory_cgroup.pids()) == sorted([mount.pid, mount.supervisor.pid])
        memory_cgroup.limit(memory_cgroup.usage() + (48 << 20))  # room to serve, not to cache 256 MiB
        with pytest.raises(OSError), open(mount.path / "big.bin", "rb") as f:
            while f.read(4 << 20):
                pass
        assert mount.wait() == 137
        line = mount.last_line()
        assert "killed by SIGKILL (out of memory: the kernel's OOM killer ended it" in line, mount.log()
        assert f"memory cgroup {memory_cgroup.path}: limit" in line and "see dmesg" in line
        assert "[exit 137]" in line


# Both processes killed: the next mount says what it found


def test_the_next_mount_reports_a_mount_killed_with_its_supervisor(tmp_path: Path) -> None:
    options = options_for(tmp_path)
    common = ["--cache-dir", str(tmp_path / "cache"), "--log-file", str(options.log_file)]
    first = pffs("mount", options.source, str(options.mountpoint), *common)
    assert first.returncode == 0, first.stderr
    pid = serving_pid_of(options.mountpoint)
    supervisor = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    second_pid = None
    try:
        os.kill(supervisor, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        poll("both are gone", lambda: not is_alive(pid) and not is_alive(supervisor))
        second = pffs("mount", options.source, str(options.mountpoint), *common)
        assert second.returncode == 0, second.stderr
        second_pid = serving_pid_of(options.mountpoint)
        said = f"the previous mount at {options.mountpoint} (pid {pid}, started "
        assert said in second.stderr and "ended without a last word" in second.stderr, second.stderr
        assert f"its log: {options.log_file}" in second.stderr
        assert said in options.log_file.read_text()
        assert pffs("umount", str(options.mountpoint)).returncode == 0
    finally:
        for leftover in (pid, supervisor, second_pid):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(leftover, signal.SIGKILL)  # type: ignore[arg-type]
        subprocess.run(["fusermount3", "-u", str(options.mountpoint)], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(options.mountpoint)], capture_output=True)


# What `ps` shows


def test_processes_are_titled_with_what_they_serve(tmp_path: Path) -> None:
    with started(tmp_path) as mount:
        source = tmp_path / "src"
        serving = Path(f"/proc/{mount.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
        supervisor = Path(f"/proc/{mount.supervisor.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
        assert serving == f"pffs mount {source} {mount.path}"
        assert supervisor == f"pffs mount-supervisor {source} {mount.path}"


def test_titles_and_last_lines_never_show_a_password() -> None:
    assert public_url("s3://key:secret@host:9000/bucket/p") == "s3://host:9000/bucket/p"
    assert public_url("hdfs://user@nn:8020/data") == "hdfs://nn:8020/data"
    assert public_url("/data/a@b") == "/data/a@b" and public_url("s3://b/p@q") == "s3://b/p@q"
    assert "secret" not in process_title("pffs mount", "webhdfs://u:secret@h/x", "/mnt")


def test_wait_statuses_and_exit_codes_in_words() -> None:
    killed = ending.describe_wait_status(signal.SIGKILL, 42, "/mnt/x")  # a waitpid status: killed by 9
    assert killed.code == 137 and killed.cause.startswith("killed by SIGKILL")
    assert "`pffs umount /mnt/x` detaches the dead mount" in killed.cause
    exited = ending.describe_wait_status(5 << 8, 42, "/mnt/x")
    assert exited.code == ending.EXIT_CONNECTION_ABORTED
    assert ending.describe_exit_code(-6) == "killed by SIGABRT" == ending.describe_exit_code(134)
    assert "137 SIGKILL" in pffs("mount", "--help").stdout


def test_the_record_says_nothing_while_the_supervisor_runs_and_reads_back_a_cause(tmp_path: Path) -> None:
    record = tmp_path / "mount-x.state.json"
    title = "import setproctitle, sys; setproctitle.setproctitle('pffs mount-supervisor /src /mnt'); input()"
    stand_in = subprocess.Popen([sys.executable, "-c", title], stdin=subprocess.PIPE)
    try:
        poll(
            "the title is set", lambda: Path(f"/proc/{stand_in.pid}/cmdline").read_bytes().startswith(b"pffs")
        )
        mount_record.write(record, state="running", mountpoint="/mnt", pid=2**22 + 1, supervisor=stand_in.pid)
        assert mount_record.ended_without_a_word(record) is None
    finally:
        stand_in.kill()
        stand_in.wait()
    assert "ended without a last word" in (mount_record.last_cause(record) or "")
    mount_record.ended(record, 137, "killed by SIGKILL")
    assert mount_record.ended_without_a_word(record) is None
    assert mount_record.last_cause(record) == "killed by SIGKILL [exit 137]"
