"""The mounts and the SDK against the reference model (tests/reference_model.py), with hypothesis's
rule-based state machines: random interleavings of opens, reads at offsets (pread, and seek + read),
closes, stats, listings, overwrites, deletes and creates by another writer (straight to S3), writes,
renames and unlinks through a read-write mount, TTL expiry, page-cache and block-cache eviction (a tiny
cache), remounts over the same cache, and a second mount and an SDK reader on the same cache. Every
observation is checked against the model; a failure shrinks to a short sequence of steps (hypothesis
prints it), which then becomes a plain test in test_mount_versions.py.

The budget in `.ci/run`: PFFS_MODEL_EXAMPLES examples (default 5) of up to PFFS_MODEL_STEPS steps (default
40) per configuration, with hypothesis's derandomized seed, so CI runs the same sequences every time
(about three minutes in all). A longer, random search on demand:

    PFFS_MODEL_EXAMPLES=200 PFFS_MODEL_STEPS=60 PFFS_MODEL_RANDOM=1 .venv/bin/python -m pytest \\
        tests/test_mount_model.py
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pffs_fs, server_options
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from mounts import Mount
from reference_model import Model, State, content, explain, versions_in

from pffs.testing.s3_server import SeaweedS3

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse (FUSE) on this machine"),
]

EXAMPLES = int(os.environ.get("PFFS_MODEL_EXAMPLES", "5"))
STEPS = int(os.environ.get("PFFS_MODEL_STEPS", "40"))
RANDOM = os.environ.get("PFFS_MODEL_RANDOM") == "1"

NAMES = ("a", "d/c")  # d/ and the top hold an anchor object each, so both directories always exist
# Each example works in a prefix of its own, made (with its anchors) before the mounts start: a prefix made
# later would be a new name in the bucket's top directory, which a mount with long TTLs may not show yet.
PREFIXES = 8 * EXAMPLES + 400  # shrinking a failure runs many more examples
ANCHORS = {"": {"keep", "d"}, "d": {"keep"}}
# Sizes: one word, within one 64 KiB block, across blocks, more than the 1 MiB disk cache holds; a version's
# uid is added so that a size names its version.
SIZES = (8, 3000, 70_000, 200_000, 1_300_000)
SLACK_S = 0.5  # between the model's clock readings and the mount's own: covers scheduling, not staleness
# Where a reader looks: the first mount most, so that one mount's handles meet each other's page cache.
READERS = st.sampled_from(["m1", "m1", "m2", "sdk"])
# Which name a step touches: mostly one, so that handles, changes and reads meet on it.
TOUCHED = st.sampled_from(["a", "a", "a", "d/c"])


@dataclass(frozen=True)
class Config:
    read_only: bool
    attr_ttl: float
    dir_ttl: float

    @property
    def mount_staleness(self) -> float:
        # The kernel trusts a name for attr_ttl, answered from metadata up to dir_ttl old; a missing name
        # is remembered by the kernel and by the mount for attr_ttl each.
        return 2 * self.attr_ttl + self.dir_ttl + SLACK_S

    @property
    def sdk_staleness(self) -> float:
        return self.dir_ttl + SLACK_S

    @property
    def short(self) -> bool:
        return self.mount_staleness < 3

    def mount_flags(self) -> tuple[str, ...]:
        flags = ("--attr-ttl", str(self.attr_ttl), "--dir-ttl", str(self.dir_ttl))
        flags += ("--block-size", "64K", "--cache-size", "1M", "--memory-cache-size", "256K")
        return flags + (("--read-only",) if self.read_only else ())


CONFIGS = {
    "read-only, short TTLs": Config(True, 0.2, 0.3),
    "read-write, short TTLs": Config(False, 0.2, 0.3),
    "read-only, long TTLs": Config(True, 30, 60),
    "read-write, long TTLs": Config(False, 30, 60),
}


@dataclass
class Rig:
    """What every example of one configuration shares: the bucket, two mounts and an SDK on one cache."""

    config: Config
    server: SeaweedS3
    raw: s3fs.S3FileSystem
    bucket: str
    mounts: dict[str, Mount]
    sdk: Any
    examples: int = 0
    steps: int = 0


@dataclass(eq=False)  # one handle is one handle: fsspec files compare equal by path, mode and position
class Handle:
    view: str
    name: str
    state: State  # the version it showed at open
    fd: int | None = None  # a mount's
    file: Any = None  # the SDK's
    reads: int = 0


class MountModelMachine(RuleBasedStateMachine):
    rig: Rig  # set per configuration by the test

    def __init__(self) -> None:
        super().__init__()
        self.rig.examples += 1
        assert self.rig.examples < PREFIXES, "every prefix made for the examples is used: raise PREFIXES"
        self.prefix = f"ex{self.rig.examples}"
        self.model = Model()
        self.handles: list[Handle] = []
        self.checks = 0

    # Helpers

    @property
    def config(self) -> Config:
        return self.rig.config

    def key(self, name: str) -> str:
        return f"{self.rig.bucket}/{self.prefix}/{name}"

    def mount_path(self, view: str, name: str) -> Path:
        return self.rig.mounts[view].path / self.prefix / name

    def staleness(self, view: str) -> float:
        return self.config.sdk_staleness if view == "sdk" else self.config.mount_staleness

    def allowed(self, view: str, name: str, began: float) -> list[State]:
        return self.model.allowed(view, name, began, time.monotonic(), self.staleness(view))

    def close_handles(self, view: str) -> None:
        for handle in [h for h in self.handles if h.view == view]:
            self._close(handle)

    def _close(self, handle: Handle) -> None:
        self.handles.remove(handle)
        if handle.fd is not None:
            os.close(handle.fd)
        else:
            handle.file.close()

    def busy(self, view: str, *names: str) -> bool:
        return any(h.view == view and h.name in names for h in self.handles)

    # Setup

    @initialize()
    def names(self) -> None:
        now = time.monotonic()
        for name in NAMES:
            self.model.add_name(name, now)

    # Another writer, straight to S3

    @rule(name=TOUCHED, size=st.sampled_from(SIZES), settle=st.booleans())
    def put(self, name: str, size: int, settle: bool) -> None:
        """Another writer puts a new version; with `settle` (short TTLs only), the TTLs then expire, so
        the next opens must see it while older handles are still open."""
        uid = self.model.new_uid()
        size += uid
        began = time.monotonic()
        self.rig.raw.pipe(self.key(name), content(uid, size))
        self.model.change(name, uid, size, began, time.monotonic())
        note(f"S3: put {name} = v{uid} ({size} B)")
        if settle and self.config.short:
            self.ttl_expires()

    @rule(name=TOUCHED)
    def delete(self, name: str) -> None:
        if not self.model.names[name].current.present:
            return
        began = time.monotonic()
        self.rig.raw.rm(self.key(name))
        self.model.change(name, None, 0, began, time.monotonic())
        note(f"S3: delete {name}")

    # Readers

    @rule(view=READERS, name=TOUCHED)
    def open(self, view: str, name: str) -> None:
        began = time.monotonic()
        handle = Handle(view, name, State(None, 0, 0))
        try:
            if view == "sdk":
                handle.file = self.rig.sdk.open(f"{self.prefix}/{name}", "rb")
                size = handle.file.size
            else:
                handle.fd = os.open(self.mount_path(view, name), os.O_RDONLY)
                size = os.fstat(handle.fd).st_size
        except FileNotFoundError:
            allowed = self.allowed(view, name, began)
            assert any(not s.present for s in allowed), (
                f"{view}: open {name}: ENOENT, may show {explain(allowed)}"
            )
            note(f"{view}: open {name}: ENOENT")
            return
        allowed = self.allowed(view, name, began)
        state = self.model.state_of_size(allowed, size)
        if state is None:
            (os.close(handle.fd) if handle.fd is not None else handle.file.close())
            raise AssertionError(f"{view}: open {name}: {size} B, may show {explain(allowed)}")
        handle.state = state
        self.handles.append(handle)
        note(f"{view}: open {name} -> h{len(self.handles) - 1} {state.describe()}")

    @rule(
        which=st.integers(0, 15),
        at=st.floats(0, 1.05),
        length=st.sampled_from([1, 4096, 65536, 200_000, 1 << 21]),
        seek=st.booleans(),
    )
    def read(self, which: int, at: float, length: int, seek: bool) -> None:
        if not self.handles:  # a no-op rather than a precondition: the draws never depend on the system
            return
        handle = self.handles[which % len(self.handles)]
        offset = int(at * handle.state.size)
        try:
            if handle.file is not None:
                handle.file.seek(offset)
                data = handle.file.read(length)
            elif seek:
                os.lseek(handle.fd, offset, os.SEEK_SET)
                data = os.read(handle.fd, length)
            else:
                data = os.pread(handle.fd, length, offset)
        except OSError as exc:
            # ESTALE only once its version is gone from the store; never anything else.
            superseded = not self.model.is_current(handle.name, handle.state.uid)
            assert exc.errno == errno.ESTALE and superseded, (
                f"{handle.view}: read {handle.name} {handle.state.describe()} at {offset}: {exc!r}"
                f" (its version {'was replaced' if superseded else 'is current'})"
            )
            note(f"{handle.view}: read {handle.name} at {offset}: ESTALE")
            return
        assert handle.state.uid is not None
        expected = content(handle.state.uid, handle.state.size)[offset : offset + length]
        if data != expected:
            raise AssertionError(
                f"{handle.view}: read {handle.name} pinned to {handle.state.describe()} at "
                f"{offset}+{length}: "
                f"{len(data)} B of versions {sorted(versions_in(data, offset))}, expected {len(expected)} B "
                f"of v{handle.state.uid}"
            )
        handle.reads += 1
        note(f"{handle.view}: read {handle.name} at {offset}+{length}: {len(data)} B ok")

    @rule(view=READERS, name=TOUCHED)
    def read_whole(self, view: str, name: str) -> None:
        """Open, read it all, close: what an epoch over a dataset does (and it fills the page cache)."""
        before = len(self.handles)
        self.open(view, name)
        if len(self.handles) == before:
            return  # not there
        self.read(len(self.handles) - 1, 0.0, 1 << 22, False)
        self.close(len(self.handles) - 1)

    @rule(which=st.integers(0, 15))
    def close(self, which: int) -> None:
        if not self.handles:
            return
        self._close(self.handles[which % len(self.handles)])

    @rule(which=st.integers(0, 15))
    def evict_page_cache(self, which: int) -> None:
        """The kernel drops the file's cached pages (as under memory pressure)."""
        mounted = [h for h in self.handles if h.fd is not None]
        if not mounted:
            return
        os.posix_fadvise(mounted[which % len(mounted)].fd, 0, 0, os.POSIX_FADV_DONTNEED)

    @rule(view=st.sampled_from(["m1", "m2", "sdk"]), name=TOUCHED)
    def stat(self, view: str, name: str) -> None:
        began = time.monotonic()
        try:
            if view == "sdk":
                size = self.rig.sdk.info(f"{self.prefix}/{name}")["size"]
            else:
                size = os.stat(self.mount_path(view, name)).st_size
        except FileNotFoundError:
            size = None
        allowed = self.allowed(view, name, began)
        if size is None:
            assert any(not s.present for s in allowed), (
                f"{view}: stat {name}: ENOENT, may show {explain(allowed)}"
            )
        else:
            assert self.model.state_of_size(allowed, size), (
                f"{view}: stat {name}: {size} B, may show {explain(allowed)}"
            )

    @rule(view=st.sampled_from(["m1", "m2", "sdk"]), directory=st.sampled_from(["", "d"]))
    def listdir(self, view: str, directory: str) -> None:
        began = time.monotonic()
        where = f"{self.prefix}/{directory}".rstrip("/")
        if view == "sdk":
            listed = {posixpath.basename(p.rstrip("/")) for p in self.rig.sdk.ls(where, detail=False)}
        else:
            listed = set(os.listdir(self.rig.mounts[view].path / where))
        expected_anchors = ANCHORS[directory]
        assert expected_anchors <= listed, f"{view}: ls {where!r}: {sorted(listed)} lacks an anchor"
        names = {posixpath.basename(n): n for n in NAMES if posixpath.dirname(n) == directory}
        for extra in listed - expected_anchors - names.keys():
            raise AssertionError(f"{view}: ls {where!r} shows {extra!r}, which never existed")
        for short, name in names.items():
            allowed = self.allowed(view, name, began)
            if short in listed:
                assert any(s.present for s in allowed), (
                    f"{view}: ls shows {name}, may show {explain(allowed)}"
                )
            else:
                assert any(not s.present for s in allowed), (
                    f"{view}: ls lacks {name}, may show {explain(allowed)}"
                )

    @precondition(lambda self: self.config.short)
    @rule()
    def ttl_expires(self) -> None:
        time.sleep(self.config.mount_staleness)
        note("(the TTLs expire)")

    @rule(view=st.sampled_from(["m1", "m2"]))
    def remount(self, view: str) -> None:
        """Unmount and mount again over the same cache (a restart): its handles are closed first."""
        self.close_handles(view)
        mount = self.rig.mounts[view]
        result = mount.umount()
        assert result.returncode == 0, result.stderr
        mount.start()
        note(f"{view}: remounted")

    # Changes through a read-write mount (to names it has no handle on: see the README on a file rewritten
    # while open on the same mount, which reads as a local file would)

    @precondition(lambda self: not self.config.read_only)
    @rule(view=st.sampled_from(["m1", "m2"]), name=TOUCHED, size=st.sampled_from(SIZES))
    def write(self, view: str, name: str, size: int) -> None:
        if self.busy(view, name):
            return
        uid = self.model.new_uid()
        size += uid
        data = content(uid, size)
        began = time.monotonic()
        fd = os.open(self.mount_path(view, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, size, 1 << 18):
                os.write(fd, data[start : start + (1 << 18)])
        finally:
            os.close(fd)  # uploads; a failed upload raises here
        self.model.change(name, uid, size, began, time.monotonic())
        self.model.changed_by(view, name)
        note(f"{view}: write {name} = v{uid} ({size} B)")

    @precondition(lambda self: not self.config.read_only)
    @rule(view=st.sampled_from(["m1", "m2"]), name=TOUCHED)
    def unlink(self, view: str, name: str) -> None:
        if self.busy(view, name):
            return
        began = time.monotonic()
        try:
            os.unlink(self.mount_path(view, name))
        except FileNotFoundError:
            allowed = self.allowed(view, name, began)
            assert any(not s.present for s in allowed), (
                f"{view}: rm {name}: ENOENT, may show {explain(allowed)}"
            )
            return
        self.model.change(name, None, 0, began, time.monotonic())
        self.model.changed_by(view, name)
        note(f"{view}: rm {name}")

    @precondition(lambda self: not self.config.read_only)
    @rule(view=st.sampled_from(["m1", "m2"]), source=st.sampled_from(NAMES), to=st.sampled_from(NAMES))
    def rename(self, view: str, source: str, to: str) -> None:
        target = to
        if source == target or self.busy(view, source, target):
            return
        began = time.monotonic()
        try:
            os.rename(self.mount_path(view, source), self.mount_path(view, target))
        except OSError as exc:
            allowed = self.allowed(view, source, began)
            # The mount may know an older state of the source: gone (ENOENT), or another version, which
            # the store refuses to copy (ESTALE). Neither is allowed where the source is known for sure.
            stale = len(allowed) > 1 or (exc.errno == errno.ENOENT and not allowed[0].present)
            assert exc.errno in (errno.ENOENT, errno.ESTALE) and stale, (
                f"{view}: mv {source} {target}: {exc!r}, may show {explain(allowed)}"
            )
            return
        ended = time.monotonic()
        stored = self.rig.raw.cat(self.key(target))
        uids = versions_in(stored, 0)
        assert len(uids) == 1, f"{view}: mv {source} {target} stored a mix of {sorted(uids)}"
        moved = self.model.change(target, uids.pop(), len(stored), began, ended)
        self.model.change(source, None, 0, began, ended)
        self.model.changed_by(view, source)
        self.model.changed_by(view, target)
        note(f"{view}: mv {source} {target} ({moved.describe()})")

    @invariant()
    def every_handle_reads_its_version(self) -> None:
        """After every step, each open handle reads 64 KiB somewhere (a different place each time)."""
        self.checks += 1
        self.rig.steps += 1
        for index in range(len(self.handles)):
            self.read(index, (self.checks * 0.618 + index * 0.3) % 1.0, 65536, False)

    @invariant()
    def mounts_alive(self) -> None:
        for view, mount in self.rig.mounts.items():
            assert os.path.ismount(mount.path), f"{view} is no longer mounted:\n{mount.log()}"

    def teardown(self) -> None:
        for handle in list(self.handles):
            with contextlib.suppress(OSError):
                self._close(handle)


@pytest.mark.timeout(900 + EXAMPLES * STEPS * 4)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mounts_and_sdk_against_the_reference_model(
    name: str, s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, s3_env: dict[str, str], tmp_path: Path
) -> None:
    config = CONFIGS[name]
    bucket = f"model-{uuid.uuid4().hex[:10]}"
    raw_s3.mkdir(bucket)
    cache = tmp_path / "cache"
    flags = ("--endpoint-url", s3_server.endpoint_url, *config.mount_flags())
    mounts = {view: Mount(f"s3://{bucket}", tmp_path / view, cache, s3_env, *flags) for view in ("m1", "m2")}
    anchors = {f"{bucket}/ex{i}/{name}": b"k" for i in range(PREFIXES) for name in ("keep", "d/keep")}
    raw_s3.pipe(anchors)
    try:
        for mount in mounts.values():
            mount.start()
        sdk = pffs_fs(
            f"s3://{bucket}",
            cache,
            block_size="64K",
            metadata_ttl=config.dir_ttl,
            memory_cache_size="256K",
            **server_options(s3_server),
        )
        rig = Rig(config, s3_server, raw_s3, bucket, mounts, sdk)
        machine = type("Machine", (MountModelMachine,), {"rig": rig})
        budget = settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=not RANDOM,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        started = time.monotonic()
        run_state_machine_as_test(machine, settings=budget)
        print(f"{name}: {rig.examples} examples, {rig.steps} steps in {time.monotonic() - started:.0f} s")
    finally:
        for mount in mounts.values():
            mount.kill()
