"""bench/pjdfstest.py's reading of prove's output and its usage errors (the suite itself is not run here: it
is built outside this repository, and its counts are a figure in the README, not a test)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _import_bench(name: str) -> Any:
    """bench/<name>.py, with the bench modules it imports by their plain names (`mounts`, `sdk`) kept to
    itself: tests/mounts.py goes by the same name, and the other test modules must go on finding theirs."""
    shadowed = {m: sys.modules.pop(m) for m in ("mounts", "sdk") if m in sys.modules}
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
        for m in ("mounts", "sdk"):
            sys.modules.pop(m, None)
        sys.modules.update(shadowed)


pjdfstest = _import_bench("pjdfstest")

pytestmark = pytest.mark.timeout(60)

TESTS = "/suite/tests"
# prove -rv's output, abridged from real runs: a clean file, failures with pjdfstest's messages, the suite's
# own Linux TODOs and SKIPs, a file killed by timeout(1) half-way, a file that died before its plan. prove
# ends a file's header and some verdicts with a space; they are put back below.
PROVE_TEXT = f"""\
{TESTS}/chmod/00.t ............
1..4
ok 1
ok 2
ok 3
ok 4
ok
{TESTS}/link/00.t .............
1..5
ok 1
not ok 2 - tried 'link pjdfstest_a pjdfstest_b', expected 0, got EPERM
not ok 3 # TODO nlink is not updated on Linux
ok 4 # SKIP no hard links here
not ok 5 - tried 'lstat pjdfstest_a nlink', expected 2, got 1
Failed 2/5 subtests
	(less 1 skipped subtest: 2 okay)
{TESTS}/open/07.t .............
1..6
ok 1
ok 2
Dubious, test returned 124 (wstat 31744, 0x7c00)
Failed 4/6 subtests
{TESTS}/mknod/11.t ............
Dubious, test returned 1 (wstat 256, 0x100)
No subtests run

Test Summary Report
-------------------
{TESTS}/link/00.t (Wstat: 0 Tests: 5 Failed: 2)
  Failed tests:  2, 5
Files=4, Tests=11, 3 wallclock secs
Result: FAIL
"""
PROVE_OUTPUT = re.sub(r"^(.*(?:\.t \.+|subtests|subtests run))$", r"\1 ", PROVE_TEXT, flags=re.MULTILINE)


def read(output: str) -> list:
    reader = pjdfstest.TapReader(Path(TESTS), "test")
    for line in output.splitlines(keepends=True):
        reader.feed(line)
    return reader.close()


def test_reads_each_files_subtests_from_prove_output() -> None:
    files = {f.name: f for f in read(PROVE_OUTPUT)}
    assert list(files) == ["chmod/00.t", "link/00.t", "open/07.t", "mknod/11.t"]
    clean, link, killed, died = files.values()
    assert (clean.passed, clean.total, clean.failed) == (4, 4, 0)
    # a SKIP is a pass (TAP), a TODO failure a failure the suite expects here
    assert (link.passed, link.total, link.skipped, link.todo_failed) == (2, 5, 1, 1)
    assert link.failed_numbers == [2, 3, 5]
    assert link.messages[0] == "not ok 2 - tried 'link pjdfstest_a pjdfstest_b', expected 0, got EPERM"
    # subtests a file never reached count as failed: its plan is the total
    assert (killed.passed, killed.total, killed.failed, killed.timed_out) == (2, 6, 4, True)
    assert (died.passed, died.total, died.planned, died.returned, died.timed_out) == (0, 0, None, 1, False)


def test_tally_adds_up_per_directory_and_lists_the_failing_files() -> None:
    report = pjdfstest.tally(read(PROVE_OUTPUT))
    assert (report["passed"], report["total"], report["todo_failed"], report["skipped"]) == (8, 15, 1, 1)
    assert report["by_dir"]["link"] == {"passed": 2, "total": 5, "files": 1}
    assert report["timed_out_files"] == ["open/07.t"]
    assert report["test_files_all_passed"] == 1
    assert set(report["failing_files"]) == {"link/00.t", "open/07.t"}
    assert report["failing_files"]["link/00.t"]["failed_subtests"] == "2-3,5"


def test_compact_writes_runs_of_subtests_as_ranges() -> None:
    assert pjdfstest.compact([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    assert pjdfstest.compact([]) == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--suite", "/nonexistent"], "no built pjdfstest there"),
        (["--clients", "pffs,nfs"], "unknown client(s) ['nfs']"),
        (["--test-timeout", "0"], "must be positive"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "pjdfstest.py"), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert says in done.stderr
    assert "Traceback" not in done.stderr
