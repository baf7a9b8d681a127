"""Cache groups (pffs.peers) as several machines on one: each node a pffs process in a network namespace of
its own, with its own address and its own cache, over one S3 server whose GETs the test counts.

The module builds its own small network: a bridge in the root namespace with an address of its own, and up
to four namespaces joined to it by veth pairs (traffic never leaves this machine; everything is removed
afterwards, whatever happened). The S3 server listens on loopback only, so the nodes reach it through a
counting proxy on the bridge's address, which forwards every request unchanged (Host included: SigV4
signatures still verify) and records what each node asked for. Each node is tests/peer_node.py: the pffs SDK
filesystem, serving the group on its own address and reading what the test tells it to.

What is asserted, each with every byte checked (sha256 against the source) and a bound on time:
  - nodes reading a dataset one after another, then all at once: S3 serves each block once to the whole
    group, and what the members say they served is what the others say they fetched;
  - a member killed (SIGKILL) while the others read from it, and a member frozen (SIGSTOP): the readers
    pay at most one deadline, then read from S3;
  - a member whose cache holds the old version of an overwritten object (same size, other bytes) serves
    the new version only;
  - a member without the group's token is refused by the others and refuses them: nothing crosses;
  - a members file (peers_file) that changes mid-epoch: a member added serves its share soon after, a
    member removed is no longer asked.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import s3fs
from helpers import pattern, poll, sha256

from pffs.peers.protocol import owner_of
from pffs.testing.s3_server import SeaweedS3

TOKEN = "a-token-of-this-group-0123456789"
BLOCK = 256 << 10
PORT = 9830  # every node listens on it: each has a network namespace (and so a port space) of its own
NODES = 4
NODE_SCRIPT = Path(__file__).with_name("peer_node.py")
SCENARIO_S = 30.0  # the most any one scenario's reads may take, on a loaded 2-core CI machine

pytestmark = pytest.mark.timeout(120)


# -- the network ---------------------------------------------------------------------------------------------
@dataclass
class Network:
    namespaces: list[str]  # one per node
    addresses: list[str]  # each node's IP address, in its namespace
    bridge_address: str  # the root namespace's address on the bridge (where the S3 proxy listens)


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    command = ["ip", *args]
    if netns is not None:  # nsenter (not `ip netns exec`): only the network namespace changes
        command = ["nsenter", f"--net=/run/netns/{netns}", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that no address of this machine is in, starting from one picked by `seed`."""
    used = [
        ipaddress.ip_interface(found).network
        for found in re.findall(r"inet (\S+)", ip("-4", "-o", "addr", "show").stdout)
    ]
    for step in range(256):
        subnet = ipaddress.IPv4Network(f"10.213.{(seed + step) % 254 + 1}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise RuntimeError("no free /24 in 10.213.0.0/16 for the test's network")


def remove_leftovers() -> None:
    """Namespaces and links of earlier runs of this module whose pytest died before its teardown."""

    def dead(pid: str) -> bool:
        return not Path(f"/proc/{pid}").exists()

    for name in ip("netns", "list").stdout.split():
        found = re.fullmatch(r"pffs-t(\d+)-n\d+", name)
        if found and dead(found.group(1)):
            ip("netns", "del", name, check=False)
    for name in re.findall(r"^\d+: ([^:@]+)", ip("-o", "link", "show").stdout, re.MULTILINE):
        found = re.fullmatch(r"pffs(?:b|v\d+x)(\d+)", name)
        if found and dead(found.group(1)):
            ip("link", "del", name, check=False)


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """A bridge with an address of its own and NODES namespaces on it, each with one veth (its eth0, an
    address of the bridge's /24) and lo up; all of it deleted afterwards, whatever happened."""
    missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (to make network namespaces)")
    if missing:
        pytest.skip(f"cache groups over network namespaces need {', '.join(missing)}")
    remove_leftovers()
    pid = os.getpid()
    subnet = free_subnet(pid)
    hosts = list(subnet.hosts())
    bridge, bridge_address = f"pffsb{pid}", str(hosts[0])
    namespaces = [f"pffs-t{pid}-n{n}" for n in range(NODES)]
    addresses = [str(hosts[9 + n]) for n in range(NODES)]  # .10, .11, ...
    with contextlib.ExitStack() as undo:
        ip("link", "add", bridge, "type", "bridge")
        undo.callback(ip, "link", "del", bridge, check=False)
        ip("addr", "add", f"{bridge_address}/{subnet.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        for n, (namespace, address) in enumerate(zip(namespaces, addresses, strict=True)):
            ip("netns", "add", namespace)
            undo.callback(ip, "netns", "del", namespace, check=False)  # takes its end of the veth along
            outside, inside = f"pffsv{n}x{pid}", f"pffsv{n}y{pid}"
            ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            undo.callback(ip, "link", "del", outside, check=False)
            ip("link", "set", inside, "netns", namespace)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("link", "set", inside, "name", "eth0", netns=namespace)
            ip("addr", "add", f"{address}/{subnet.prefixlen}", "dev", "eth0", netns=namespace)
            ip("link", "set", "eth0", "up", netns=namespace)
            ip("link", "set", "lo", "up", netns=namespace)
        yield Network(namespaces, addresses, bridge_address)


# -- the S3 server, counted ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    client: str  # the node's address
    method: str
    path: str
    range: str | None
    status: int


HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}


class CountingProxy:
    """Forwards every request (method, path and query, headers with Host, body) to the S3 server and its
    answer back, and records each (`seen`)."""

    def __init__(self, host: str, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lock = threading.Lock()
        self.seen: list[Seen] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream_connection: http.client.HTTPConnection | None = None

            def forward(self) -> None:
                proxy.forward(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def forward(self, handler: Any) -> None:
        if "chunked" in (handler.headers.get("Transfer-Encoding") or ""):
            raise NotImplementedError("a chunked request body")  # the nodes only read
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        for attempt in (1, 2):  # a kept-alive connection to the server may have been closed by it
            if handler.upstream_connection is None:
                handler.upstream_connection = http.client.HTTPConnection(*self.upstream, timeout=30)
            connection = handler.upstream_connection
            try:
                connection.putrequest(
                    handler.command, handler.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in handler.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        connection.putheader(name, value)
                connection.endheaders(body)
                response = connection.getresponse()
                data = response.read()
                break
            except (http.client.HTTPException, ConnectionError):
                connection.close()
                handler.upstream_connection = None
                if attempt == 2:
                    raise
        with self.lock:
            self.seen.append(
                Seen(
                    handler.client_address[0],
                    handler.command,
                    handler.path.partition("?")[0],
                    handler.headers.get("Range"),
                    response.status,
                )
            )
        handler.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP and not (
                name.lower() == "content-length" and handler.command != "HEAD"
            ):
                handler.send_header(name, value)
        if handler.command != "HEAD":
            handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def object_gets(self, bucket: str, client: str | None = None) -> list[Seen]:
        """The GETs of objects of `bucket` (listings are GETs too, of the bucket itself: not these)."""
        with self.lock:
            return [
                s
                for s in self.seen
                if s.method == "GET"
                and s.path.startswith(f"/{bucket}/")
                and (client is None or s.client == client)
            ]

    def statuses(self, bucket: str) -> Counter[int]:
        with self.lock:
            return Counter(s.status for s in self.seen if s.path.startswith(f"/{bucket}"))


@pytest.fixture(scope="module")
def proxy(network: Network, s3_server: SeaweedS3) -> Iterator[CountingProxy]:
    """The nodes' only way to S3: the server listens on loopback, and a namespace's loopback is its own."""
    upstream = s3_server.endpoint_url.removeprefix("http://").split(":")
    counting = CountingProxy(network.bridge_address, (upstream[0], int(upstream[1])))
    counting.thread.start()
    yield counting
    counting.server.shutdown()
    counting.server.server_close()


# -- the nodes -----------------------------------------------------------------------------------------------
class NodeError(AssertionError):
    pass


@dataclass
class Node:
    """tests/peer_node.py in namespace `index` of the network, at `host`."""

    index: int
    host: str
    address: str  # where it serves (if it does): its member address
    log_path: Path
    process: subprocess.Popen[str]
    messages: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.messages.put(json.loads(line))
        self.messages.put(None)

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except OSError:
            return ""

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        """The node's next line; NodeError (with the node's log) if it failed, died or said nothing."""
        try:
            found = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise NodeError(f"node {self.index} said nothing for {timeout:.0f} s\n{self.log()}") from None
        if found is None:
            raise NodeError(f"node {self.index} exited ({self.process.wait()})\n{self.log()}")
        if "error" in found:
            raise NodeError(f"node {self.index}: {found['error']}\n{self.log()}")
        return found

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op=op, **args)
        return self.answer()

    def read(self, files: list[str], **args: Any) -> dict[str, Any]:
        return self.ask("read", files=files, **args)

    def state(self) -> dict[str, Any]:
        return self.ask("state")

    def counts(self) -> dict[str, int]:
        return self.state()["counts"]

    def members(self) -> list[str]:
        return self.state()["members"]

    def keys(self, names: list[str]) -> list[str]:
        """The cache keys of the blocks of `names`' versions now (as the node reads them)."""
        return [key for name in names for key in self.ask("keys", file=name)["keys"]]

    def stop(self) -> None:
        """Whatever state it is in (frozen, killed, busy), the process is gone."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send(op="exit")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError, ValueError):
                stream.close()  # type: ignore[union-attr]


StartNodes = Callable[..., list[Node]]


@pytest.fixture
def start_nodes(
    network: Network, proxy: CountingProxy, s3_server: SeaweedS3, bucket: str, tmp_path: Path
) -> Iterator[StartNodes]:
    """start_nodes([0, 1, 2], **options): those nodes, started together, each ready (its listener up). By
    default each serves on its own address, and the members are the nodes started with it; `options`
    overrides any pffs option (peer_listen=None: a node that only reads), for all of them or, given
    per_node={index: {...}}, for one."""
    started: list[Node] = []
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("AWS_")}

    def start(
        indexes: list[int], per_node: dict[int, dict[str, Any]] | None = None, **common: Any
    ) -> list[Node]:
        members = ",".join(f"{network.addresses[i]}:{PORT}" for i in indexes)
        nodes = []
        for i in indexes:
            options: dict[str, Any] = {
                "block_size": BLOCK,
                "endpoint_url": proxy.url,
                "key": s3_server.access_key,
                "secret": s3_server.secret_key,
                "peers": members,
                "peer_listen": f"{network.addresses[i]}:{PORT}",
                "peer_token": TOKEN,
                "peer_timeout": 10.0,  # a busy CI machine must not turn into a member's failure
                **common,
                **(per_node or {}).get(i, {}),
            }
            options = {k: v for k, v in options.items() if v is not None}
            log_path = tmp_path / f"node{i}.log"
            with log_path.open("w") as log:
                process = subprocess.Popen(
                    [
                        "nsenter",
                        f"--net=/run/netns/{network.namespaces[i]}",
                        sys.executable,
                        str(NODE_SCRIPT),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=env,
                )
            node = Node(i, network.addresses[i], f"{network.addresses[i]}:{PORT}", log_path, process)
            started.append(node)
            config = {
                "target": f"s3://{bucket}/ds",
                "cache_dir": str(tmp_path / f"cache{i}"),
                "options": options,
                "hard_timeout_s": 110,
            }
            node.send(**config)
            nodes.append(node)
        for node in nodes:
            assert node.answer()["ready"] == node.process.pid  # nsenter execs the node: one process
        return nodes

    yield start
    for node in started:
        node.stop()


# -- datasets ------------------------------------------------------------------------------------------------
def put(raw_s3: s3fs.S3FileSystem, bucket: str, files: dict[str, bytes]) -> dict[str, bytes]:
    raw_s3.pipe({f"{bucket}/ds/{name}": data for name, data in files.items()})
    return files


def small_and_large(prefix: str, seed: int = 0) -> dict[str, bytes]:
    """12 files smaller than a block and one of several blocks."""
    files = {f"{prefix}/small/{i:02d}.bin": pattern(100_000 + i, seed=seed + i) for i in range(12)}
    files[f"{prefix}/large.bin"] = pattern(5 * BLOCK + 12_345, seed=seed + 99)
    return files


def blocks_of(files: dict[str, bytes]) -> int:
    return sum(-(-len(data) // BLOCK) for data in files.values())


def owned_by(viewer: Node, owner: Node, names: list[str], members: list[str] | None = None) -> list[int]:
    """Which blocks of `names` (counted across them) `owner` owns among `members` (default: the members
    `viewer` has now), by the keys `viewer` reads them with."""
    members = viewer.members() if members is None else members
    return [i for i, key in enumerate(viewer.keys(names)) if owner_of(key, members) == owner.address]


def owning_a_block(
    raw_s3: s3fs.S3FileSystem,
    bucket: str,
    files: dict[str, bytes],
    viewer: Node,
    owners: list[Node],
    prefix: str,
    members: list[str] | None = None,
) -> dict[str, bytes]:
    """`files`, with as many one-block files more as it takes for each of `owners` to own a block of them
    (a block's owner hangs on its key, which hangs on the bucket's random name)."""
    members = viewer.members() if members is None else members
    found = {owner_of(key, members) for key in viewer.keys(list(files))}
    for extra in range(30):
        if {owner.address for owner in owners} <= found:
            return files
        more = put(raw_s3, bucket, {f"{prefix}/extra-{extra:02d}.bin": pattern(BLOCK, seed=1000 + extra)})
        files = {**files, **more}
        found |= {owner_of(key, members) for key in viewer.keys(list(more))}
    raise AssertionError(f"30 files more, and still not one block for each of {[o.address for o in owners]}")


def check_bytes(result: dict[str, Any], files: dict[str, bytes]) -> None:
    assert result["sha256"] == {name: sha256(data) for name, data in files.items()}


def total(nodes: list[Node], counter: str) -> int:
    return sum(node.counts()[counter] for node in nodes)


def each_block_once(proxy: CountingProxy, bucket: str, files: dict[str, bytes]) -> None:
    """S3 served each block of `files` exactly once (one ranged GET) to the whole group."""
    paths = {f"/{bucket}/ds/{name}" for name in files}
    asked = Counter((s.path, s.range) for s in proxy.object_gets(bucket) if s.path in paths)
    twice = {k: n for k, n in asked.items() if n > 1}
    assert not twice, f"blocks S3 served more than once: {twice}"
    assert len(asked) == blocks_of(files), sorted(asked)


# -- the scenarios -------------------------------------------------------------------------------------------
def test_s3_serves_each_block_once_to_the_group_read_in_turn_or_all_at_once(
    start_nodes: StartNodes, proxy: CountingProxy, raw_s3: s3fs.S3FileSystem, bucket: str
) -> None:
    in_turn = put(raw_s3, bucket, small_and_large("in-turn", seed=0))
    at_once = put(raw_s3, bucket, small_and_large("at-once", seed=200))
    nodes = start_nodes([0, 1, 2])

    started = time.monotonic()
    for node in nodes:
        check_bytes(node.read(list(in_turn)), in_turn)
    assert time.monotonic() - started < SCENARIO_S
    each_block_once(proxy, bucket, in_turn)
    # Each block: its owner got it from S3, the two others from the owner.
    assert total(nodes, "served_blocks") == total(nodes, "fetched_blocks") == 2 * blocks_of(in_turn)

    started = time.monotonic()
    for node in nodes:
        node.send(op="read", files=list(at_once))
    for node in nodes:
        check_bytes(node.answer(), at_once)
    assert time.monotonic() - started < SCENARIO_S
    each_block_once(proxy, bucket, at_once)
    both = blocks_of(in_turn) + blocks_of(at_once)
    assert total(nodes, "served_blocks") == total(nodes, "fetched_blocks") == 2 * both

    for node in nodes:  # what each node says it asked S3 for is what S3 was asked for from its address
        state = node.state()
        assert state["gets"] == len(proxy.object_gets(bucket, client=node.host)), node.index
        assert state["counts"]["failures"] == state["counts"]["refused"] == 0, state
    assert sum(node.state()["gets"] for node in nodes) == both
    assert proxy.statuses(bucket)[403] == 0  # SigV4 signatures verify through the proxy


def test_a_member_killed_while_others_read_from_it_costs_no_bytes(
    start_nodes: StartNodes, raw_s3: s3fs.S3FileSystem, bucket: str
) -> None:
    # Read-ahead of one block: when the readers stop mid-file, the victim's later blocks are still to ask.
    victim, *readers = start_nodes([0, 1, 2], readahead_size=BLOCK)
    for attempt in range(20):  # a file of which the victim owns an early block and a later one
        name = f"large-{attempt}.bin"
        files = put(raw_s3, bucket, {name: pattern(16 * BLOCK, seed=attempt)})
        owned = owned_by(readers[0], victim, [name])
        if owned and owned[0] < 8 and owned[-1] >= owned[0] + 4:
            break
    else:
        raise AssertionError("no file of which the victim owns an early block and a later one")
    hold_at = (owned[0] + 1) * BLOCK  # once the readers have had the victim's first block

    started = time.monotonic()
    for reader in readers:
        reader.send(op="read", files=[name], chunk=BLOCK, hold_at=hold_at)
    for reader in readers:
        assert reader.answer()["held"] == name  # the file open, half read
    assert victim.counts()["served_blocks"] >= 1
    victim.process.kill()
    victim.process.wait(timeout=10)
    for reader in readers:
        reader.send(op="go")
    for reader in readers:
        result = reader.answer()
        check_bytes(result, files)
        assert result["counts"]["failures"] >= 1, result  # it asked the dead member for a later block
    assert time.monotonic() - started < SCENARIO_S


def test_a_frozen_member_costs_the_readers_one_deadline_then_they_read_from_s3(
    start_nodes: StartNodes, raw_s3: s3fs.S3FileSystem, bucket: str
) -> None:
    timeout = 3.0  # long enough for a live member on a busy machine, short beside REST_S
    frozen, reader, later = start_nodes([0, 1, 2], per_node={1: {"peer_timeout": timeout}})
    files = put(raw_s3, bucket, small_and_large("data", seed=300))
    files = owning_a_block(raw_s3, bucket, files, reader, [frozen, later], "data")
    os.kill(frozen.process.pid, signal.SIGSTOP)  # its listener still accepts (the kernel does), never answers
    try:
        result = reader.read(list(files))
    finally:
        os.kill(frozen.process.pid, signal.SIGCONT)
    check_bytes(result, files)
    counts = result["counts"]
    assert counts["failures"] >= 1, counts  # it did ask the frozen member ...
    assert result["elapsed"] >= timeout * 0.9, result  # ... and waited out the deadline ...
    assert result["elapsed"] < 3 * timeout + 10, result  # ... about once, not once per block
    assert counts["fetched_blocks"] >= 1, counts  # the third member still served it its blocks
    # Thawed, the member serves again (to one that never saw it frozen).
    result = later.read(list(files))
    check_bytes(result, files)
    assert frozen.counts()["served_blocks"] >= 1
    assert result["counts"]["failures"] == 0, result


def test_a_member_caching_the_old_version_of_an_overwritten_object_serves_only_the_new(
    start_nodes: StartNodes, raw_s3: s3fs.S3FileSystem, bucket: str
) -> None:
    name, size = "versioned.bin", 5 * BLOCK + 777
    old = put(raw_s3, bucket, {name: pattern(size, seed=1)})
    stale, reader, third = start_nodes([0, 1, 2])
    check_bytes(stale.read([name]), old)  # every block of the old version now in the stale member's cache
    for seed in range(2, 40):  # the same size, other bytes; the stale member owns a block of the new version
        new = put(raw_s3, bucket, {name: pattern(size, seed=seed)})
        if owned_by(reader, stale, [name]):
            break
    else:
        raise AssertionError("no new version of which the stale member owns a block")
    served_before = stale.counts()["served_blocks"]

    started = time.monotonic()
    for node in (reader, third):
        result = node.read([name])
        check_bytes(result, new)  # never a byte of the old version
        assert result["counts"]["failures"] == 0, result
    assert time.monotonic() - started < SCENARIO_S
    assert stale.counts()["served_blocks"] > served_before  # it was asked for the new version, and served it


def test_a_member_without_the_token_is_refused_and_refuses_others_yet_reads_exact_bytes(
    start_nodes: StartNodes, proxy: CountingProxy, raw_s3: s3fs.S3FileSystem, bucket: str
) -> None:
    *members, outsider = start_nodes([0, 1, 2, 3], per_node={3: {"peer_token": "not-the-group-token-0000"}})
    files = put(raw_s3, bucket, small_and_large("data", seed=400))
    files = owning_a_block(raw_s3, bucket, files, members[0], [*members, outsider], "data")

    started = time.monotonic()
    for node in [*members, outsider]:
        check_bytes(node.read(list(files)), files)
    assert time.monotonic() - started < SCENARIO_S
    refused_by_members = total(members, "refused")
    outsider_counts = outsider.counts()
    assert refused_by_members >= 1  # the outsider asked them ...
    assert outsider_counts["fetched_blocks"] == 0  # ... and got nothing
    assert outsider_counts["failures"] == refused_by_members
    assert outsider_counts["refused"] == total(members, "failures") >= 1  # they asked it, and got nothing
    assert outsider_counts["served_blocks"] == 0
    # Every block the outsider read came from S3, each once.
    asked = Counter((s.path, s.range) for s in proxy.object_gets(bucket, client=outsider.host))
    assert sum(asked.values()) == len(asked) == blocks_of(files)


def write_members(path: Path, members: list[str]) -> None:
    """Replaced whole (a rename), as a node plugin writes it: a reader never sees half a file."""
    temporary = path.with_suffix(".new")
    temporary.write_text("".join(f"{m}\n" for m in members))
    temporary.replace(path)


def test_a_members_file_changed_mid_epoch_adds_and_removes_members(
    network: Network,
    start_nodes: StartNodes,
    proxy: CountingProxy,
    raw_s3: s3fs.S3FileSystem,
    bucket: str,
    tmp_path: Path,
) -> None:
    members_file = tmp_path / "members"
    write_members(members_file, [f"{a}:{PORT}" for a in network.addresses[:2]])  # not the third, yet
    reader, kept, newcomer = start_nodes([0, 1, 2], peers=None, peers_file=str(members_file))
    nodes = [reader, kept, newcomer]
    three = [reader.address, kept.address, newcomer.address]

    def change_members(members: list[str]) -> None:
        write_members(members_file, members)
        poll(
            f"every node reading the members file as {members}",
            lambda: all(sorted(node.members()) == sorted(members) for node in nodes),
            timeout_s=10,
        )

    def part(
        prefix: str, seed: int, owners: list[Node], members: list[str] | None = None
    ) -> dict[str, bytes]:
        files = put(raw_s3, bucket, {f"{prefix}/{i}.bin": pattern(BLOCK, seed=seed + i) for i in range(6)})
        return owning_a_block(raw_s3, bucket, files, reader, owners, prefix, members)

    started = time.monotonic()
    first = part("first", 500, [kept])
    check_bytes(reader.read(list(first)), first)
    assert kept.counts()["served_blocks"] > 0
    assert newcomer.counts()["served_blocks"] == 0  # not a member yet: nobody asks it

    change_members(three)
    second = part("second", 600, [newcomer])
    check_bytes(reader.read(list(second)), second)
    assert newcomer.counts()["served_blocks"] > 0  # a member now, it serves its share

    third = part("third", 700, [kept], members=three)  # blocks the kept member would own, were it still in
    change_members([reader.address, newcomer.address])
    kept_served = kept.counts()["served_blocks"]
    check_bytes(reader.read(list(third)), third)
    assert kept.counts()["served_blocks"] == kept_served  # no longer asked
    assert time.monotonic() - started < SCENARIO_S
    assert reader.counts()["failures"] == 0
    each_block_once(proxy, bucket, {**first, **second, **third})  # blocks moved between owners, fetched once
