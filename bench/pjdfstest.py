"""POSIX conformance of the pffs mount against s3fs-fuse, rclone and JuiceFS: pjdfstest over one SeaweedFS.

    .venv/bin/python bench/pjdfstest.py                              # every client, the whole suite
    .venv/bin/python bench/pjdfstest.py --clients pffs               # pffs again; the others' results kept
    .venv/bin/python bench/pjdfstest.py --clients pffs --dirs chmod,symlink   # part of the suite

Needs pjdfstest, built from its source (github.com/pjd/pjdfstest), in --suite (default
~/.cache/pffs-tools/pjdfstest); this repository holds neither its code nor a recipe for building it.
Run as root: the suite changes owners and runs steps as other users.

One SeaweedFS S3 server; per client, in turn, the bucket's prefix emptied first:

    pffs      pffs mount s3://bench-data/ds MNT --allow-other (read-write, its defaults otherwise)
    s3fs      s3fs-fuse as bench/mounts.py mounts it, plus -o allow_other
    rclone    rclone mount --vfs-cache-mode full as bench/mounts.py mounts it, plus --allow-other
    juicefs   JuiceFS with SQLite metadata, its data in another bucket of the same server (bench/mounts.py's
              mount; it allows other users itself when run as root)
    local     no mount: a folder of the working directory's own file system (ext4 here), the reference for
              what a kernel file system passes of this suite on this kernel

In a fresh folder inside the mount, `prove -rv` runs the suite's test files (as root), each under
`timeout` (--test-timeout), and the whole run under a deadline; every mount is unmounted whatever happens.
A test file's subtests: passed = its `ok` lines (TAP: a SKIP is a pass; `ok # TODO` an unexpected pass),
total = its plan (`1..N`), so subtests a file never reached (it crashed, it timed out) count as failed.

Writes bench/results/pjdfstest.json (per client: passed and total, per test directory, every failing test file
with its failing subtests and pjdfstest's own "tried X, expected Y, got Z" lines; a client not run this time
keeps its previous entry, and a client run again keeps the summary of its previous run under "previous")
and bench/results/pjdfstest.png; prints a table, and progress to stderr. The counts are a figure, not a
pass/fail: exit code 0 once every client ran, 1 if a client could not be mounted or its mount died or hung
during the suite, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sdk: Any = importlib.import_module("sdk")  # bench/sdk.py: machine_info
mounts: Any = importlib.import_module("mounts")  # bench/mounts.py: how each client is mounted and unmounted

CLIENTS = ("pffs", "s3fs", "rclone", "juicefs", "local")
S3_CLIENTS = ("pffs", "s3fs", "rclone")  # they mount s3://bench-data/ds itself, emptied before each
DEFAULT_SUITE = Path.home() / ".cache" / "pffs-tools" / "pjdfstest"
TEST_TIMEOUT_S = 300  # one test file; the slowest take ~30 s on ext4 (they sleep to see times change)
RUN_TIMEOUT_S = 3 * 3600  # the whole suite through one client
BIN = Path(sys.executable).parent
Result = dict[str, Any]

# prove -v: a test file's header ("/path/tests/chmod/00.t .. "), then its TAP lines, then prove's verdict.
HEADER = re.compile(r"^(?P<file>\S+\.t) \.+ ?$")
PLAN = re.compile(r"^1\.\.(?P<count>\d+)")
RESULT = re.compile(r"^(?P<not>not )?ok (?P<number>\d+)\b(?P<rest>.*)$")
DUBIOUS = re.compile(r"Dubious, test returned (?P<code>\d+)")
TIMED_OUT_CODES = (124, 137)  # timeout(1): the test file outlived --test-timeout (137: killed after -k)
MESSAGES_KEPT = 5  # of a test file's failing lines, in the JSON (the whole TAP output stays in the logs)
MESSAGE_CHARS = 300  # of each line kept (the PATH_MAX tests' lines name 4 KiB paths)


def log(message: str) -> None:
    print(f"[pjdfstest {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class ClientFailed(RuntimeError):
    pass


# -- TAP ----------------------------------------------------------------------------------------------------
@dataclass
class TestFile:
    """One test file's outcome, from its TAP lines."""

    name: str  # relative to the suite's tests/: "chmod/00.t"
    planned: int | None = None
    passed: int = 0
    todo_failed: int = 0  # "not ok N # TODO": a failure the suite itself expects on this OS
    skipped: int = 0
    failed_numbers: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # the failing lines, as pjdfstest wrote them
    returned: int | None = None  # the file's exit status, when prove called it dubious

    @property
    def directory(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def total(self) -> int:
        return self.planned if self.planned is not None else self.passed + len(self.failed_numbers)

    @property
    def failed(self) -> int:
        return self.total - self.passed

    @property
    def timed_out(self) -> bool:
        return self.returned in TIMED_OUT_CODES

    def add(self, line: str) -> None:
        if self.planned is None and (plan := PLAN.match(line)):
            self.planned = int(plan["count"])
        elif result := RESULT.match(line):
            directive = result["rest"].upper()
            if not result["not"]:
                self.passed += 1
                self.skipped += "# SKIP" in directive
                return
            self.failed_numbers.append(int(result["number"]))
            self.todo_failed += "# TODO" in directive
            self.messages.append(line.strip())
        elif dubious := DUBIOUS.search(line):
            self.returned = int(dubious["code"])

    def summary(self) -> Result:
        out: Result = {"passed": self.passed, "total": self.total}
        if self.planned is None:
            out["no_plan"] = True
        if self.returned is not None:
            out["returned"] = self.returned
        if self.timed_out:
            out["timed_out"] = True
        if self.failed_numbers:
            out["failed_subtests"] = compact(self.failed_numbers)  # "2-5,9": short, and readable
            out["todo_failed"] = self.todo_failed
            out["messages"] = shorten(self.messages)
        return out


def shorten(messages: list[str]) -> list[str]:
    """The first MESSAGES_KEPT lines, each cut to MESSAGE_CHARS (the middle of a long path goes)."""
    half = MESSAGE_CHARS // 2
    return [m if len(m) <= MESSAGE_CHARS else f"{m[:half]}...{m[-half:]}" for m in messages[:MESSAGES_KEPT]]


def cap_messages(clients: dict[str, Result]) -> None:
    """Entries written before the cap on kept lines (and as lists of numbers) get it too."""
    for entry in clients.values():
        for failing in entry.get("failing_files", {}).values():
            if "messages" in failing:
                failing["messages"] = shorten(failing["messages"])
            if isinstance(failing.get("failed_subtests"), list):
                failing["failed_subtests"] = compact(failing["failed_subtests"])


class TapReader:
    """Reads prove -v's output line by line into TestFiles; progress to stderr at each file's end."""

    def __init__(self, tests_dir: Path, client: str) -> None:
        self.tests_dir = str(tests_dir).rstrip("/") + "/"
        self.client = client
        self.files: list[TestFile] = []

    def feed(self, line: str) -> None:
        if header := HEADER.match(line.rstrip("\n")):
            self._finish()
            self.files.append(TestFile(header["file"].removeprefix(self.tests_dir)))
        elif self.files:
            self.files[-1].add(line)

    def _finish(self) -> None:
        if self.files:
            f = self.files[-1]
            note = " (timed out)" if f.timed_out else ""
            log(f"  {self.client} {f.name}: {f.passed}/{f.total}{note}")

    def close(self) -> list[TestFile]:
        self._finish()
        return self.files


# -- mounts -------------------------------------------------------------------------------------------------
class SuiteMount(mounts.Mount):
    """bench/mounts.py's mount of a client, letting other users in (the suite runs steps as other users).
    pffs mounts read-write with its defaults: no benchmark options, nothing fixing the modes."""

    def command(self) -> tuple[list[str], dict[str, str]]:
        if self.client == "pffs":
            env = {
                **os.environ,
                "AWS_ACCESS_KEY_ID": self.ctx.key,
                "AWS_SECRET_ACCESS_KEY": self.ctx.secret,
            }
            return [
                str(BIN / "pffs"), "mount", f"s3://{mounts.BUCKET}/{mounts.PREFIX}", str(self.mountpoint),
                "--endpoint-url", self.ctx.endpoint_url, "--cache-dir", str(self.cache_dir),
                "--allow-other", "--log-file", str(self.log_path()),
            ], env  # fmt: skip
        cmd, env = super().command()
        extra = {"s3fs": ["-o", "allow_other"], "rclone": ["--allow-other"], "juicefs": []}
        return [*cmd, *extra[self.client]], env


def empty_prefix(s3: Any) -> None:
    """Makes the bucket afresh (SeaweedFS keeps a deleted object's folders as empty directories, so emptying
    the prefix is not enough) with one empty object in s3://bench-data/ds/ (ds/.keep): each client starts
    from a folder every client can mount. Not a folder marker object (the key "ds/"): pffs before its
    POSIX-metadata work failed with EIO on the root of a mount whose prefix had one."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options(), skip_instance_cache=True)
    if fs.exists(mounts.BUCKET):
        fs.rm(mounts.BUCKET, recursive=True)  # every object and then the bucket itself
    if fs.exists(mounts.BUCKET):
        fs.rmdir(mounts.BUCKET)
    fs.mkdir(mounts.BUCKET)
    fs.pipe_file(f"{mounts.BUCKET}/{mounts.PREFIX}/.keep", b"")


def mount_answers(path: Path, timeout: float = 30.0) -> bool:
    """Whether a listing of path answers in time (in a thread: a hung mount must not hang the run)."""
    done: list[bool] = []

    def listing() -> None:
        try:
            os.listdir(path)
            done.append(True)
        except OSError:
            done.append(False)

    thread = threading.Thread(target=listing, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(done and done[0])


# -- one client ---------------------------------------------------------------------------------------------
@dataclass
class Suite:
    root: Path
    dirs: list[str]
    test_timeout: int
    run_timeout: float

    @property
    def whole(self) -> bool:
        return sorted(self.dirs) == sorted(p.name for p in self.tests.iterdir() if p.is_dir())

    @property
    def tests(self) -> Path:
        return self.root / "tests"

    def prove_command(self) -> list[str]:
        # prove hands each .t to perl, which runs the script's own #!/bin/sh; --exec puts timeout in front.
        paths = [str(self.tests / d) for d in self.dirs]
        return ["prove", "-rv", "--exec", f"timeout -k 10 {self.test_timeout} /bin/sh", *paths]

    def commit(self) -> str:
        done = subprocess.run(
            ["git", "-C", str(self.root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() or "unknown (not a git checkout)"


def run_prove(suite: Suite, where: Path, client: str, tap_log: IO[str], on_timeout: Any) -> list[TestFile]:
    """prove over the suite from inside where; the whole run under suite.run_timeout (then on_timeout()
    frees whatever the run hangs on, and prove's session is killed)."""
    reader = TapReader(suite.tests, client)
    proc = subprocess.Popen(
        suite.prove_command(), cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    expired = threading.Event()

    def deadline() -> None:
        expired.set()
        log(f"  {client}: the suite did not finish within {suite.run_timeout:.0f}s: stopping it")
        on_timeout()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(suite.run_timeout, deadline)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tap_log.write(line)
            reader.feed(line)
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted: no test outlives the run
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if expired.is_set():
        raise ClientFailed(f"the suite did not finish within {suite.run_timeout:.0f}s")
    return reader.close()


def tally(files: list[TestFile]) -> Result:
    by_dir: dict[str, Result] = {}
    for f in files:
        row = by_dir.setdefault(f.directory, {"passed": 0, "total": 0, "files": 0})
        row["passed"] += f.passed
        row["total"] += f.total
        row["files"] += 1
    return {
        "passed": sum(f.passed for f in files),
        "total": sum(f.total for f in files),
        "todo_failed": sum(f.todo_failed for f in files),
        "skipped": sum(f.skipped for f in files),
        "test_files": len(files),
        "test_files_all_passed": sum(1 for f in files if f.failed == 0 and f.total > 0),
        "timed_out_files": [f.name for f in files if f.timed_out],
        "by_dir": dict(sorted(by_dir.items())),
        "failing_files": {f.name: f.summary() for f in files if f.failed > 0},
    }


def pffs_measured() -> str:
    """The commit of this repository, or where pffs came from when another copy is imported (PYTHONPATH
    pointing at an export of an older commit: the mount runs the same copy, it inherits the environment)."""
    import pffs

    package_home = Path(pffs.__file__).resolve().parent.parent
    if package_home == Path(__file__).resolve().parent.parent:
        return str(sdk.git_state())
    return f"pffs imported from {package_home}"


def fs_type(path: Path) -> str:
    done = subprocess.run(["df", "-PT", str(path)], capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    return lines[-1].split()[1] if len(lines) > 1 else "unknown"


def run_client(client: str, suite: Suite, ctx: Any, s3: Any, logs: Path) -> Result:
    started = time.monotonic()
    entry: Result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pffs_git": pffs_measured(),
        "dirs": "all" if suite.whole else suite.dirs,
    }
    tap_path = logs / f"{client}.tap"
    mount = None
    try:
        if client == "local":
            where = ctx.workdir / "local" / "pjdfstest"
            entry["command"] = "(none: a folder of the working directory's file system)"
        else:
            if client in S3_CLIENTS:
                empty_prefix(s3)
            mount = SuiteMount(client, ctx, ctx.workdir / "caches" / client, ctx.workdir / "mnt" / client)
            try:
                mount.start()
            except (mounts.PhaseFailed, OSError, subprocess.SubprocessError) as exc:
                raise ClientFailed(f"could not be mounted: {exc}") from exc
            entry["command"] = mount.commands[0].replace(str(ctx.workdir), "$WORKDIR")
            mountinfo = mounts.mount_entry(mount.mountpoint) or []
            entry["mount_options"] = " ".join(mountinfo[5:6] + mountinfo[-1:])  # per mount, per file system
            where = mount.root / "pjdfstest"
        where.mkdir(parents=True)
        entry["fs_type"] = fs_type(where)
        log(f"{client}: prove over {', '.join(suite.dirs)} in {where}")
        with tap_path.open("w") as tap_log:
            on_timeout = (lambda: mounts.force_unmount(mount.mountpoint)) if mount else (lambda: None)
            files = run_prove(suite, where, client, tap_log, on_timeout)
        if mount is not None and not mount_answers(mount.root):
            raise ClientFailed("the mount no longer answers after the suite (see its log)")
        entry.update(tally(files))
    except (ClientFailed, OSError) as exc:
        log(f"{client} FAILED: {exc}")
        entry["error"] = str(exc)
        if mount is not None:
            log(mount.tail())
    finally:
        if mount is not None:
            mount.stop()
    entry["seconds"] = round(time.monotonic() - started, 1)
    if "passed" in entry:
        log(f"{client}: {entry['passed']} of {entry['total']} subtests passed in {entry['seconds']:.0f}s")
    return entry


def run_all(args: argparse.Namespace, suite: Suite, workdir: Path, logs: Path) -> dict[str, Result]:
    from pffs.testing.s3_server import SeaweedS3

    results: dict[str, Result] = {}
    log(f"starting SeaweedFS in {workdir}")
    with SeaweedS3(workdir / "s3") as s3:
        ctx = mounts.Context(s3.endpoint_url, s3.access_key, s3.secret_key, workdir)
        for client in args.clients:
            if client == "juicefs":
                try:
                    mounts.format_juicefs(ctx)
                except (mounts.PhaseFailed, OSError, subprocess.SubprocessError) as exc:
                    log(f"juicefs: could not be formatted: {exc}")
                    results[client] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "error": str(exc)}
                    continue
            results[client] = run_client(client, suite, ctx, s3, logs)
    return results


# -- report -------------------------------------------------------------------------------------------------
def tool_versions() -> Result:
    return {
        **mounts.versions(),
        "prove": mounts.tool_version(["prove", "--version"]),
    }


def merge(previous: Result, results: dict[str, Result], suite: Suite, args: argparse.Namespace) -> Result:
    """The new results over the file's previous ones: a client run now replaces its entry (the old one's
    summary moves to "previous"), the others stay as they were."""
    clients = dict(previous.get("clients", {}))
    cap_messages(clients)
    history = dict(previous.get("previous", {}))
    keep = ("date", "pffs_git", "passed", "total")
    command = shlex.join([sys.executable, *sys.argv])
    for client, entry in results.items():
        entry["bench_command"] = command
        if client in clients and "passed" in clients[client]:
            old = {k: clients[client][k] for k in keep if k in clients[client]}
            history[client] = [*history.get(client, []), old]
        clients[client] = entry
    return {
        "suite": {
            "source": "github.com/pjd/pjdfstest",
            "commit": suite.commit(),
            "dirs": suite.dirs,
            "test_timeout_seconds": suite.test_timeout,
            "prove": shlex.join(suite.prove_command()).replace(str(suite.root), "$SUITE"),
        },
        "command": command,  # the last run's; each client's entry has the one that ran it
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": sdk.machine_info(),
        "versions": tool_versions(),
        "clients": {c: clients[c] for c in CLIENTS if c in clients},
        "previous": history,
    }


def print_table(report: Result) -> None:
    clients = report["clients"]
    dirs = sorted({d for e in clients.values() for d in e.get("by_dir", {})})
    header = ("client", "passed", "of", "date", "pffs", *dirs)
    rows = [header]
    for client, e in clients.items():
        if "passed" not in e:
            rows.append((client, "FAILED", "", e.get("date", ""), "", *[""] * len(dirs)))
            continue
        cells = [
            f"{e['by_dir'][d]['passed']}/{e['by_dir'][d]['total']}" if d in e["by_dir"] else "-" for d in dirs
        ]
        measured = commit_of(e) if client == "pffs" else ""
        rows.append((client, str(e["passed"]), str(e["total"]), e["date"][:16], measured, *cells))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for client, e in clients.items():
        if e.get("error"):
            print(f"\n{client} FAILED: {e['error']}")
        failing = e.get("failing_files", {})
        if failing:
            print(f"\n{client}: {len(failing)} test files with failures (passed/total, failing subtests):")
            for name, f in failing.items():
                note = " TIMED OUT" if f.get("timed_out") else ""
                print(f"  {name}: {f['passed']}/{f['total']}{note} {f.get('failed_subtests', '')}")
    print(f"\nsuite: pjdfstest at {report['suite']['commit']}; command: {report['command']}")


def commit_of(entry: Result) -> str:
    """The pffs an entry measured, short: its commit (exported ones: the folder's name ends with it)."""
    measured = str(entry.get("pffs_git", "?"))
    if measured.startswith("pffs imported from "):
        return measured.rsplit("-", 1)[-1][:12]
    return measured.split()[0] + ("+" if "uncommitted" in measured else "")


def compact(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3,7"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def plot(report: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pffs": "tab:green", "rclone": "tab:blue", "s3fs": "tab:orange", "juicefs": "tab:purple"}
    clients = {c: e for c, e in report["clients"].items() if "passed" in e}
    dirs = sorted({d for e in clients.values() for d in e["by_dir"]})
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1.5, 3.4]}, squeeze=True
    )
    names = list(clients)
    # Left: every client's latest run, and pffs's runs before it (hatched), labelled with their commits.
    bars: list[tuple[str, Result, str, str]] = []
    for c in names:
        if c == "pffs":
            for earlier in report.get("previous", {}).get(c, []):
                bars.append((f"pffs\n{commit_of(earlier)}", earlier, colors[c], "//"))
        tick = f"pffs\n{commit_of(clients[c])}" if c == "pffs" else c
        bars.append((tick, clients[c], colors.get(c, "tab:gray"), ""))
    for tick, entry, color, hatch in bars:
        drawn = left.bar(tick, entry["passed"], color=color, hatch=hatch, alpha=0.55 if hatch else 1.0)
        left.bar_label(drawn, labels=[f"{entry['passed']:,}\nof {entry['total']:,}"], fontsize=7)
    left.set_title("subtests passed (whole suite; hatched: pffs at earlier commits)", fontsize=10)
    left.margins(y=0.1)  # room for the labels above the bars
    left.tick_params(axis="both", labelsize=8)
    left.grid(axis="y", alpha=0.3)
    width = 0.8 / max(1, len(names))
    for i, c in enumerate(names):
        shares = [
            100 * clients[c]["by_dir"][d]["passed"] / clients[c]["by_dir"][d]["total"]
            if clients[c]["by_dir"].get(d, {}).get("total") else 0.0
            for d in dirs
        ]  # fmt: skip
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(dirs))]
        right.bar(xs, shares, width, label=c, color=colors.get(c, "tab:gray"))
    right.set_xticks(range(len(dirs)), dirs, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("% of the directory's subtests passed", fontsize=8)
    right.set_ylim(0, 118)  # room for the legend above the 100% bars
    right.set_title("per test directory (syscall)", fontsize=10)
    if names:
        right.legend(fontsize=8, ncols=len(names))
    right.grid(axis="y", alpha=0.3)
    dates = {e["date"][:10] for e in clients.values()}
    fig.suptitle(
        f"pjdfstest ({report['suite']['commit'][:7]}) through FUSE mounts over one local SeaweedFS "
        f"(local: a folder on {clients.get('local', {}).get('fs_type', 'a kernel fs')}); "
        f"{', '.join(sorted(dates))}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 every client ran (the counts are a figure, not a verdict), 1 a client could "
        "not be mounted or its mount died or hung during the suite, 2 usage error. Run as root.",
    )
    parser.add_argument(
        "--suite", type=Path, default=DEFAULT_SUITE, help=f"a built pjdfstest tree (default {DEFAULT_SUITE})"
    )
    parser.add_argument(
        "--clients",
        type=mounts.clients_arg_of(CLIENTS),
        default=list(CLIENTS),
        help=f"clients, comma-separated, run in this order: {','.join(CLIENTS)} (default all)",
    )
    parser.add_argument("--dirs", help="test directories of the suite, comma-separated (default all)")
    parser.add_argument(
        "--test-timeout",
        type=int,
        default=TEST_TIMEOUT_S,
        help=f"seconds one test file may take (default {TEST_TIMEOUT_S})",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=RUN_TIMEOUT_S,
        help=f"seconds the whole suite may take through one client (default {RUN_TIMEOUT_S})",
    )
    parser.add_argument(
        "--workdir", help="where the server data, caches and mounts go, in a temp dir (default /tmp)"
    )
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"), help="output folder")
    parser.add_argument(
        "--report-only", action="store_true", help="print the table and draw the chart again from the JSON"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        return args
    if args.test_timeout < 1 or args.run_timeout < 1:
        parser.error("--test-timeout and --run-timeout must be positive")
    tests = args.suite / "tests"
    if not (args.suite / "pjdfstest").is_file() or not (tests / "misc.sh").is_file():
        parser.error(
            f"--suite {args.suite}: no built pjdfstest there (want its pjdfstest binary and tests/ "
            "folder, built from its source: github.com/pjd/pjdfstest)"
        )
    available = sorted(p.name for p in tests.iterdir() if p.is_dir())
    args.dirs = [d.strip() for d in args.dirs.split(",") if d.strip()] if args.dirs else available
    unknown = [d for d in args.dirs if d not in available]
    if unknown or not args.dirs:
        parser.error(f"--dirs: unknown test directories {unknown}; the suite has {','.join(available)}")
    if os.geteuid() != 0:
        parser.error("run as root: the suite changes owners and runs steps as other users")
    if shutil.which("prove") is None:
        parser.error("prove (Perl's TAP harness) is not on PATH")
    return args


def report_only(out: Path) -> int:
    """The table and the chart again from the JSON, nothing run."""
    json_path = out / "pjdfstest.json"
    if not json_path.exists():
        print(f"pjdfstest.py: error: --report-only: no {json_path} yet", file=sys.stderr)
        return 2
    report = json.loads(json_path.read_text())
    cap_messages(report.get("clients", {}))
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "pjdfstest.png")
    print_table(report)
    return 0


def run_benchmark(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, mounts._terminate)  # unwinds every finally: unmounted, server stopped
    suite = Suite(args.suite.resolve(), args.dirs, args.test_timeout, args.run_timeout)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pffs-pjdfstest-", dir=args.workdir))
    logs = Path(tempfile.mkdtemp(prefix="pffs-pjdfstest-logs-", dir=args.workdir))  # kept: TAP, mount logs
    try:
        results = run_all(args, suite, workdir, logs)
    finally:
        for mnt in (workdir / "mnt").glob("*"):  # nothing may stay mounted, whatever happened
            if mounts.mount_entry(mnt) is not None:
                log(f"left mounted: {mnt}; detaching it")
                mounts.force_unmount(mnt)
        for mount_log in (workdir / "logs").glob("*"):  # the mounts' own logs stay beside the TAP output
            shutil.move(mount_log, logs / mount_log.name)
        shutil.rmtree(workdir, ignore_errors=True)
    json_path = out / "pjdfstest.json"
    previous = json.loads(json_path.read_text()) if json_path.exists() else {}
    report = merge(previous, results, suite, args)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "pjdfstest.png")
    print_table(report)
    log(f"wrote {json_path} and {out / 'pjdfstest.png'}; the TAP output of each client is in {logs}")
    return 1 if any("error" in e for e in results.values()) else 0


def main() -> int:
    args = parse_args()
    if args.report_only:
        return report_only(Path(args.out_dir))
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
