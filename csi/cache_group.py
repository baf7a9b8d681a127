"""A node's cache groups from Kubernetes: the node plugins find each other through the API.

A volume with the attribute `cacheGroup: share` serves its blocks to the group on this node's address
(`--node-ip`) and a port of `--cache-group-ports`; `cacheGroup: consume` only reads from the group. Each
node plugin publishes on its own Node where its sharing volumes serve, as the annotation

    pffs.io/cache-group: {"<group>": "10.0.0.7:9830", ...}

where <group> names what can be shared: the dataset, its endpoint and the block size (a block is keyed by
all three). Every plugin watches the Nodes (one list, then a watch: no polling) and writes, for each of its
volumes in a group, the members file its mount reads again when it changes (pffs.peers): every Node's
address for that group. A Node deleted, or one that stops publishing a group, leaves the files at the next
event; a member that stops answering before that costs one deadline (pffs.peers.group).

RBAC: `list` and `watch` on nodes (beside the `get` and `patch` the cache report already has).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pffs.csi.list_watch import ListWatch
from pffs.csi.periodic import Periodic
from pffs.csi.ports import can_bind
from pffs.csi.state import path_key
from pffs.peers.settings import PeerSettings
from pffs.scheduler.kube.locality import normalize_dataset

log = logging.getLogger(__name__)

GROUP_ANNOTATION = "pffs.io/cache-group"
MODES = ("off", "share", "consume")


@dataclass(frozen=True)
class GroupConfig:
    """The node plugin's cache-group settings (its flags)."""

    node_ip: str  # where this node's mounts serve the group (the Node's address, with hostNetwork)
    ports: tuple[int, int]  # the ports they may take, first to last
    token_file: Path  # the group's token, at the same path in the plugin's and the mounter's container
    timeout_s: float = 2.0
    tls_dir: Path | None = None  # mutual TLS between members (ca.crt, tls.crt, tls.key), same path in both


def group_name(source: str, endpoint_url: str | None, block_size: int) -> str:
    """What members must share to serve each other: the dataset, its endpoint and the block size."""
    return f"{normalize_dataset(source)} endpoint={endpoint_url or '-'} block={block_size}"


def free_port(config: GroupConfig, taken: set[int]) -> int | None:
    """The first port of the range that no other volume holds and that can be bound on the node's address."""
    for port in range(config.ports[0], config.ports[1] + 1):
        if port not in taken and can_bind(config.node_ip, port, reuse_address=True):  # as the member binds
            return port
    return None


@dataclass(frozen=True)
class LocalVolume:
    group: str
    listen: str | None  # None: consume-only
    members_file: Path


class Membership:
    """What this plugin knows of every Node's group addresses, and the members files of its own volumes.

    `join`/`leave` come from CSI calls; `node_seen`/`node_gone`/`all_nodes` from the watch. Each change
    rewrites the files whose members changed (atomically); publishing runs on its own thread."""

    def __init__(self, node_id: str, config: GroupConfig, files_dir: Path) -> None:
        self.node_id = node_id
        self.config = config
        self.files_dir = files_dir
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, str]] = {}  # other Node -> group -> address
        self._local: dict[str, LocalVolume] = {}  # staging path -> its volume's membership
        self._written: dict[Path, str] = {}
        self.changed = threading.Event()  # set when what this node publishes may have changed

    # This node's volumes

    def settings_for(self, staging_path: str, group: str, port: int | None) -> PeerSettings:
        """Joins the group (writing the volume's members file) and returns what its mount is given."""
        name = f"{path_key(staging_path)}.members"  # the same after a plugin restart: the mount keeps it
        volume = LocalVolume(
            group=group,
            listen=None if port is None else f"{self.config.node_ip}:{port}",
            members_file=self.files_dir / name,
        )
        with self._lock:
            self._local[staging_path] = volume
            self._write_files()
        self.changed.set()
        return PeerSettings(
            members_file=volume.members_file,
            listen=volume.listen,
            token_file=self.config.token_file,
            timeout_s=self.config.timeout_s,
            tls_dir=self.config.tls_dir,
        )

    def leave(self, staging_path: str) -> None:
        with self._lock:
            volume = self._local.pop(staging_path, None)
        if volume is None:
            return
        self._written.pop(volume.members_file, None)
        volume.members_file.unlink(missing_ok=True)
        self.changed.set()

    def ports_taken(self) -> set[int]:
        with self._lock:
            return {int(v.listen.rpartition(":")[2]) for v in self._local.values() if v.listen}

    def published(self) -> str:
        """This node's annotation: where each of its sharing volumes serves, by group."""
        with self._lock:
            serving = {v.group: v.listen for v in self._local.values() if v.listen}
        return json.dumps(dict(sorted(serving.items())), sort_keys=True)

    def members(self, group: str) -> list[str]:
        with self._lock:
            return self._members(group)

    # The Nodes, from the watch

    def all_nodes(self, nodes: Mapping[str, Mapping[str, str] | None]) -> None:
        """A fresh list of every Node's annotations (the watch's first answer, or after it lost its place)."""
        with self._lock:
            self._nodes = {}
            for name, annotations in nodes.items():
                self._take(name, annotations)
            self._write_files()

    def node_seen(self, name: str, annotations: Mapping[str, str] | None) -> None:
        with self._lock:
            self._take(name, annotations)
            self._write_files()

    def node_gone(self, name: str) -> None:
        with self._lock:
            self._nodes.pop(name, None)
            self._write_files()

    def _take(self, name: str, annotations: Mapping[str, str] | None) -> None:
        if name == self.node_id:
            return  # this node's own volumes are known here, not from a (maybe older) annotation
        raw = (annotations or {}).get(GROUP_ANNOTATION)
        groups: dict[str, str] = {}
        if raw:
            try:
                parsed = json.loads(raw)
                groups = {str(k): str(v) for k, v in parsed.items()} if isinstance(parsed, dict) else {}
            except ValueError:
                log.warning("Node %s: annotation %s is not JSON; ignoring it", name, GROUP_ANNOTATION)
        if groups:
            self._nodes[name] = groups
        else:
            self._nodes.pop(name, None)

    def _members(self, group: str) -> list[str]:
        found = {groups[group] for groups in self._nodes.values() if group in groups}
        found |= {v.listen for v in self._local.values() if v.group == group and v.listen}
        return sorted(found)

    def _write_files(self) -> None:
        for staging_path, volume in self._local.items():
            members = self._members(volume.group)
            text = "".join(f"{m}\n" for m in members)
            if self._written.get(volume.members_file) == text and volume.members_file.exists():
                continue
            header = f"# members of cache group {volume.group!r} for {staging_path}, from the Nodes\n"
            _write_atomically(volume.members_file, header + text)
            self._written[volume.members_file] = text
            log.info("cache group %r: %d member(s): %s", volume.group, len(members), ", ".join(members))


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


class NodeWatch:
    """Follows the Nodes (list, then watch) into `membership`; another thread publishes this node's
    annotation when what it serves changed."""

    def __init__(self, api: Any, membership: Membership, publish: Callable[[str], None]) -> None:
        self.membership = membership
        self.publish = publish
        self._nodes = ListWatch("cache group: the Nodes", api.list_node, (), self._listed, self._changed)
        self._last_published: str | None = None
        self._publishing = Periodic("cache-group-publish", self._publish_if_changed, 1.0, 0.0)

    def start(self) -> None:
        self._nodes.start()
        self._publishing.start()

    def stop(self) -> None:
        self._nodes.stop()
        self._publishing.stop(timeout_s=5)

    def _listed(self, nodes: list[Any]) -> None:
        self.membership.all_nodes({n.metadata.name: n.metadata.annotations for n in nodes})

    def _changed(self, kind: str, node: Any) -> None:
        if kind == "DELETED":
            self.membership.node_gone(node.metadata.name)
        else:
            self.membership.node_seen(node.metadata.name, node.metadata.annotations)

    def _publish_if_changed(self) -> float:
        value = self.membership.published()
        if value == self._last_published:
            return 1.0
        try:
            self.publish(value)
        except Exception as exc:
            log.warning("cache group: could not publish this node's members (%s); retrying", exc)
            return 5.0
        self._last_published = value
        return 1.0
