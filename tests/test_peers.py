"""Cache groups (pffs.peers): pffs processes that fetch each block from the backend once between them.

The protocol's parts alone (owners, signatures, settings), then groups of SDK filesystems over one real
SeaweedFS, each with its own cache and its own listener on loopback, in this process ("nodes" that share
nothing but the network): every block comes from the backend once for the whole group, every byte is
exact (sha256), and a dead member, a frozen one, one without the token, one whose answer is damaged on the
way, and an object overwritten after a member cached it each cost time (bounded), never bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
from helpers import make_ca, member_tls, pattern, sha256
from mounts import Mount, pffs

from pffs.backends.errors import BadOptionError
from pffs.cache.block_format import block_header
from pffs.peers.group import PeerGroup
from pffs.peers.protocol import BlockRequest, is_signed, owner_of, signed_headers
from pffs.peers.settings import PeerSettings
from pffs.testing.s3_server import SeaweedS3

TOKEN = "a-token-of-this-group-0123456789"
BLOCK = 256 << 10

pytestmark = pytest.mark.timeout(120)


# -- the protocol's parts ------------------------------------------------------------------------------------
def test_a_new_member_takes_only_its_own_share_of_the_blocks() -> None:
    keys = [f"object-{i}-block" for i in range(4000)]
    three = ["10.0.0.1:9830", "10.0.0.2:9830", "10.0.0.3:9830"]
    before = {k: owner_of(k, three) for k in keys}
    after = {k: owner_of(k, [*three, "10.0.0.4:9830"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "10.0.0.4:9830" for k in moved)  # only to the newcomer
    assert 0.18 < len(moved) / len(keys) < 0.32  # about a quarter
    shares = {m: sum(1 for k in keys if before[k] == m) for m in three}
    assert min(shares.values()) > 0.28 * len(keys)  # spread evenly
    assert owner_of("k", []) is None


def test_a_signature_is_bound_to_the_token_the_request_and_the_time() -> None:
    token, target = TOKEN.encode(), "/v1/block?key=a"
    headers = signed_headers(token, target)
    assert is_signed(token, target, headers)
    assert not is_signed(b"another-token-of-16+", target, headers)
    assert not is_signed(token, "/v1/block?key=b", headers)
    stale = signed_headers(token, target, now=time.time() - 3600)  # a captured request, replayed later
    assert not is_signed(token, target, stale)
    assert not is_signed(token, target, {})


def test_bad_group_settings_get_one_clear_line() -> None:
    cases = [
        ({"members": ["nohost"], "token": TOKEN}, "is not HOST:PORT"),
        ({"members": ["a:1"], "listen": "b:2", "token": TOKEN}, "is not one of the members"),
        ({"members": ["a:1"]}, "either inline (token) or in a file"),
    ]
    for given, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            PeerSettings(**given)
    with pytest.raises(ValueError, match="at least 16 characters"):
        PeerSettings(members=("a:1",), token="short").token_bytes()


def test_a_members_file_is_read_again_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = tmp_path / "members"
    listed.write_text("# written by the node plugin\n10.0.0.1:9830\n\n10.0.0.2:9830\n")
    group = PeerGroup(PeerSettings(members_file=listed, listen="10.0.0.1:9830", token=TOKEN), "s3 x")
    assert group.members() == ("10.0.0.1:9830", "10.0.0.2:9830")
    monkeypatch.setattr("pffs.peers.group.RECHECK_S", 0.0)
    listed.write_text("10.0.0.1:9830\n10.0.0.2:9830\n10.0.0.3:9830\n")
    assert group.members()[-1] == "10.0.0.3:9830"
    listed.write_text("10.0.0.1:9830\nnot-an-address\n")  # a bad edit keeps the last members
    assert len(group.members()) == 3
    listed.unlink()
    assert len(group.members()) == 3
    listed.write_text("10.0.0.2:9830\n")
    assert group.members() == ("10.0.0.2:9830",)
    # A same-sized file renamed over it within one tick of a coarse clock (kernels before 6.13): the
    # times say nothing changed, the contents do.
    stamp = listed.stat().st_mtime_ns
    replacement = tmp_path / "members.new"
    replacement.write_text("10.0.0.4:9830\n")
    replacement.replace(listed)
    os.utime(listed, ns=(stamp, stamp))
    assert group.members() == ("10.0.0.4:9830",)
    with pytest.raises(ValueError, match="cannot read the members file"):
        PeerGroup(PeerSettings(members_file=tmp_path / "none", token=TOKEN), "s3 x")
    with pytest.raises(ValueError, match="name the group's members"):
        PeerSettings(token=TOKEN)


def test_a_request_names_one_block_of_one_version() -> None:
    request = BlockRequest("s3 http://x", "k", "b/o", 10, "etag:abc", '"abc"', None, 4, 10)
    assert BlockRequest.parse(request.target().partition("?")[2]) == request
    for query in ("key=k", "origin=o&key=k&path=p&size=5&identity=i&start=3&end=9"):
        with pytest.raises(ValueError):
            BlockRequest.parse(query)


# -- groups over a real S3 server ----------------------------------------------------------------------------
def free_addresses(n: int) -> list[str]:
    """n loopback addresses free now and distinct (each socket held until all are bound)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]


def node(
    s3_server: SeaweedS3, bucket: str, cache: Path, members: list[str], listen: str | None, **extra: Any
) -> Any:
    return fsspec.filesystem(
        "pffs",
        target=f"s3://{bucket}/ds",
        cache_dir=str(cache),
        block_size=BLOCK,
        skip_instance_cache=True,
        peers=",".join(members),
        peer_listen=listen,
        peer_token=extra.pop("token", TOKEN),
        peer_timeout=extra.pop("timeout", 1.0),
        **s3_server.storage_options(),
        **extra,
    )


@pytest.fixture
def dataset(raw_s3: s3fs.S3FileSystem, bucket: str) -> dict[str, bytes]:
    files = {f"small/{i:02d}.bin": pattern(100_000 + i, seed=i) for i in range(12)}
    files["large.bin"] = pattern(3 * BLOCK + 12_345, seed=99)
    raw_s3.pipe({f"{bucket}/ds/{name}": data for name, data in files.items()})
    return files


def blocks_of(files: dict[str, bytes]) -> int:
    return sum(-(-len(data) // BLOCK) for data in files.values())


def gets(fs: Any) -> int:
    return int(fs.vfs.backend.requests.snapshot().get("get", {}).get("requests", 0))


def read_all(fs: Any, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert sha256(fs.cat(name)) == sha256(data), name


def test_each_block_comes_from_the_backend_once_for_the_whole_group(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    members = free_addresses(3)
    nodes = [node(s3_server, bucket, tmp_path / f"n{i}", members, m) for i, m in enumerate(members)]
    reader_only = node(s3_server, bucket, tmp_path / "consumer", members, None)  # --no-share
    for fs in [*nodes, reader_only]:
        read_all(fs, dataset)
    assert sum(gets(fs) for fs in [*nodes, reader_only]) == blocks_of(dataset)
    assert gets(reader_only) == 0  # it owns nothing: every block from a member
    served = sum(fs.peers.counts.snapshot()["served_blocks"] for fs in nodes)
    fetched = sum(fs.peers.counts.snapshot()["fetched_blocks"] for fs in [*nodes, reader_only])
    assert served == fetched == 4 * blocks_of(dataset) - blocks_of(dataset)
    assert all(fs.peers.counts.snapshot()["failures"] == 0 for fs in [*nodes, reader_only])


def test_members_reading_at_the_same_time_still_fetch_each_block_once(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    """Three members read the dataset at once (a job's first epoch): a block one of them fetched ahead
    and has not written to disk yet is served from its writer's queue, not fetched again (found by
    bench/peers.py: 1.36x the dataset came from the backend with two nodes)."""
    members = free_addresses(3)
    nodes = [node(s3_server, bucket, tmp_path / f"n{i}", members, m) for i, m in enumerate(members)]
    errors: list[BaseException] = []

    def epoch(fs: Any) -> None:
        try:
            with fs.open("large.bin", "rb") as f:
                assert sha256(f.read()) == sha256(dataset["large.bin"])
            read_all(fs, dataset)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=epoch, args=(fs,)) for fs in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(gets(fs) for fs in nodes) == blocks_of(dataset)


def test_a_dead_or_frozen_member_costs_one_deadline_not_bytes(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    frozen = socket.socket()  # accepts connections (the kernel does), never answers
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(64)
    dead, alive = free_addresses(2)  # nothing listens on dead: refused at once
    members = [alive, dead, f"127.0.0.1:{frozen.getsockname()[1]}"]
    try:
        fs = node(s3_server, bucket, tmp_path / "n", members, alive, timeout=0.5)
        started = time.monotonic()
        read_all(fs, dataset)
        elapsed = time.monotonic() - started
        counts = fs.peers.counts.snapshot()
        # Each bad member failed once, then rested: its blocks came from the backend. (Once more for each
        # of large.bin's other blocks already on their way to it when the first failed: read-ahead sends
        # them together. Without the rest, every block a bad member owns would fail: about 10 of 16.)
        assert 2 <= counts["failures"] <= 2 + 3, counts
        assert gets(fs) == blocks_of(dataset), counts
        assert elapsed < 10, f"{elapsed:.1f} s {counts}"
    finally:
        frozen.close()


def test_a_member_without_the_token_gets_nothing(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    members = free_addresses(2)
    owner = node(s3_server, bucket, tmp_path / "owner", members, members[0])
    outsider = node(
        s3_server, bucket, tmp_path / "outsider", members, members[1], token="not-the-group-token-0000"
    )
    read_all(owner, dataset)
    read_all(outsider, dataset)  # refused by the owner: from the backend, exact
    assert owner.peers.counts.snapshot()["refused"] >= 1
    assert owner.peers.counts.snapshot()["served_blocks"] == 0
    assert outsider.peers.counts.snapshot()["fetched_blocks"] == 0


class Damaging(BaseHTTPRequestHandler):
    """A member whose answers are damaged on the way: the right header, one payload byte changed."""

    protocol_version = "HTTP/1.1"
    source: dict[str, bytes] = {}

    def do_GET(self) -> None:
        request = BlockRequest.parse(self.path.partition("?")[2])
        data = bytearray(self.source[request.path.split("/ds/", 1)[1]][request.start : request.end])
        header = block_header(bytes(data))
        data[len(data) // 2] ^= 0xFF
        self.send_response(200)
        self.send_header("Content-Length", str(len(header) + len(data)))
        self.end_headers()
        self.wfile.write(header + bytes(data))

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def damaging_member(files: dict[str, bytes]) -> Iterator[str]:
    Damaging.source = files
    server = ThreadingHTTPServer(("127.0.0.1", 0), Damaging)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_damaged_answer_is_caught_by_the_checksums_and_read_from_the_backend(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    with damaging_member(dataset) as bad:
        fs = node(s3_server, bucket, tmp_path / "n", [bad], None)
        read_all(fs, dataset)
        assert fs.peers.counts.snapshot()["failures"] == 1
        assert gets(fs) == blocks_of(dataset)
    # Nothing damaged was kept: a fresh reader of the same cache reads the same bytes without a request.
    again = node(s3_server, bucket, tmp_path / "n", [bad], None)
    read_all(again, dataset)
    assert gets(again) == 0


def test_an_overwritten_object_is_never_served_at_its_old_version(
    s3_server: SeaweedS3, bucket: str, raw_s3: s3fs.S3FileSystem, tmp_path: Path
) -> None:
    old, new = pattern(BLOCK + 10, seed=1), pattern(BLOCK + 10, seed=2)
    raw_s3.pipe_file(f"{bucket}/ds/f.bin", old)
    members = free_addresses(2)
    first = node(s3_server, bucket, tmp_path / "a", members, members[0])
    assert first.cat("f.bin") == old  # its blocks now in the owners' caches
    raw_s3.pipe_file(f"{bucket}/ds/f.bin", new)
    second = node(s3_server, bucket, tmp_path / "b", members, members[1])
    assert sha256(second.cat("f.bin")) == sha256(new)


def test_a_group_on_local_files_is_refused_with_a_clear_line(tmp_path: Path) -> None:
    with pytest.raises(BadOptionError, match="local files are not shared"):
        fsspec.filesystem(
            "pffs", target=str(tmp_path), peers="127.0.0.1:1", peer_token=TOKEN, skip_instance_cache=True
        )


@pytest.mark.skipif(not Path("/dev/fuse").exists(), reason="needs /dev/fuse (FUSE) on this machine")
def test_mounts_in_a_group_fetch_each_block_once_and_a_killed_member_costs_no_bytes(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    """Two `pffs mount` processes with --peers (the way a node runs it): the second mount's reads come from
    the first; then the first is killed (SIGKILL) and a third mount (--peers-file, --no-share) still reads
    every byte exactly."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    members = free_addresses(2)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }

    members_file = tmp_path / "members"
    members_file.write_text("\n".join(members) + "\n")

    def mount(name: str, listen: str | None) -> Mount:
        extra = ["--peer-token-file", str(token_file), "--peer-timeout", "1"]
        # the servers name the members on the command line; the reader reads them from a file
        extra += ["--peers", ",".join(members), "--peer-listen", listen] if listen else []
        extra += [] if listen else ["--peers-file", str(members_file), "--no-share"]
        return Mount(
            f"s3://{bucket}/ds", tmp_path / name, tmp_path / f"cache-{name}", env,
            "--endpoint-url", s3_server.endpoint_url, "--block-size", str(BLOCK), "--read-only", *extra,
        )  # fmt: skip

    def mount_gets(m: Mount) -> int:
        return int(m.stats()["backend_requests"].get("get", {}).get("requests", 0))

    with mount("a", members[0]) as a, mount("b", members[1]) as b:
        for m in (a, b):
            for name, data in dataset.items():
                assert sha256((m.path / name).read_bytes()) == sha256(data), name
        assert mount_gets(a) + mount_gets(b) == blocks_of(dataset)
        assert b.stats()["peers"]["fetched_blocks"] > 0
        assert b.stats()["peer_members"] == 2
        assert a.stats()["peers"]["served_blocks"] == b.stats()["peers"]["fetched_blocks"]
        a.kill()
        with mount("c", None) as c:  # reads only; its owners: a (dead) and b
            started = time.monotonic()
            for name, data in dataset.items():
                assert sha256((c.path / name).read_bytes()) == sha256(data), name
            assert time.monotonic() - started < 15
            assert c.stats()["peers"]["failures"] == 1  # a, once; then from the backend


def test_a_member_serves_only_blocks_of_its_own_dataset_and_backend(
    s3_server: SeaweedS3, bucket: str, raw_s3: s3fs.S3FileSystem, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    """A signed request for an object outside the member's dataset (or climbing out of it with ..), of
    another backend or another block size gets 404: the member fetches nothing for it."""
    import http.client

    raw_s3.pipe_file(f"{bucket}/private/secret.bin", b"not for the group" * 100)
    (listen,) = free_addresses(1)
    fs = node(s3_server, bucket, tmp_path / "n", [listen], listen)
    info = fs.vfs.stat(f"{bucket}/ds/large.bin")
    secret = raw_s3.info(f"{bucket}/private/secret.bin")

    def ask(path: str, size: int, origin: str | None = None, end: int | None = None) -> int:
        end = min(BLOCK, size) if end is None else end
        request = BlockRequest(
            origin or fs.vfs.backend.origin, "key", path, size, info.identity, info.etag, None, 0, end
        )
        request = BlockRequest(**{**request.__dict__, "key": fs.vfs.reader.key(request.object_info(), 0)})
        target = request.target()
        connection = http.client.HTTPConnection(*listen.split(":"), timeout=10)
        try:
            connection.request("GET", target, headers=signed_headers(TOKEN.encode(), target))
            return connection.getresponse().status
        finally:
            connection.close()

    assert ask(info.path, info.size) == 200
    assert ask(f"{bucket}/private/secret.bin", secret["size"]) == 404
    assert ask(f"{bucket}/ds/../private/secret.bin", secret["size"]) == 404
    assert ask(info.path, info.size, origin="s3 http://another-endpoint:8333") == 404
    assert ask(info.path, info.size, end=BLOCK // 2) == 404  # another block size
    assert gets(fs) == 1  # only the block it served


def test_warmup_fills_a_new_node_from_the_group_not_the_backend(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    """`pffs warmup --peers ...` on a node that joins late: every block comes from the member that holds
    it, none from the backend, and the warmed cache then serves exact bytes with no request at all."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    (listen,) = free_addresses(1)
    member = node(s3_server, bucket, tmp_path / "member", [listen], listen)
    read_all(member, dataset)
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    cache = tmp_path / "new-node"
    answer = pffs(
        "--endpoint-url", s3_server.endpoint_url, "--cache-dir", str(cache), "--block-size", str(BLOCK),
        "warmup", f"s3://{bucket}/ds", "--json", "--peers", listen, "--peer-token-file", str(token_file),
        env=env,
    )  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    summary = json.loads(answer.stdout)
    assert summary["bytes_from_group"] == summary["bytes"] == sum(len(d) for d in dataset.values())
    assert member.peers.counts.snapshot()["served_blocks"] == blocks_of(dataset)
    warmed = fsspec.filesystem(
        "pffs", target=f"s3://{bucket}/ds", cache_dir=str(cache), block_size=BLOCK, skip_instance_cache=True,
        **s3_server.storage_options(),
    )  # fmt: skip
    read_all(warmed, dataset)
    assert gets(warmed) == 0


# -- mutual TLS ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_members_with_mutual_tls_share_and_a_certificate_of_another_ca_gets_nothing(
    s3_server: SeaweedS3, bucket: str, dataset: dict[str, bytes], tmp_path: Path
) -> None:
    ca = make_ca(tmp_path / "ca")
    members = free_addresses(2)
    first = node(
        s3_server,
        bucket,
        tmp_path / "a",
        members,
        members[0],
        peer_tls_dir=str(member_tls(ca, tmp_path / "ta", "a")),
    )
    second = node(
        s3_server,
        bucket,
        tmp_path / "b",
        members,
        members[1],
        peer_tls_dir=str(member_tls(ca, tmp_path / "tb", "b")),
    )
    read_all(first, dataset)
    read_all(second, dataset)
    assert gets(first) + gets(second) == blocks_of(dataset)
    assert second.peers.counts.snapshot()["fetched_blocks"] > 0
    assert all(fs.peers.counts.snapshot()["failures"] == 0 for fs in (first, second))

    # The group's token but a certificate of another CA: no connection; every block from the backend, exact.
    other = member_tls(make_ca(tmp_path / "other-ca"), tmp_path / "tc", "c")
    outsider = node(s3_server, bucket, tmp_path / "c", members, None, peer_tls_dir=str(other))
    read_all(outsider, dataset)
    assert outsider.peers.counts.snapshot()["fetched_blocks"] == 0
    assert outsider.peers.counts.snapshot()["failures"] >= 1
    assert first.peers.counts.snapshot()["refused"] + second.peers.counts.snapshot()["refused"] >= 1
    # And one that speaks plain HTTP to a TLS member gets nothing either.
    plain = node(s3_server, bucket, tmp_path / "d", members, None)
    read_all(plain, dataset)
    assert plain.peers.counts.snapshot()["fetched_blocks"] == 0


def test_a_tls_folder_that_lacks_a_file_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "ca.crt").write_text("not a certificate")
    with pytest.raises(BadOptionError, match=r"lacks tls\.crt, tls\.key"):
        fsspec.filesystem(
            "pffs", target="s3://b/ds", peers="127.0.0.1:1", peer_token=TOKEN,
            peer_tls_dir=str(tmp_path / "tls"), skip_instance_cache=True, endpoint_url="http://127.0.0.1:1",
        )  # fmt: skip
