"""The node's volumes: one pffs mount per volume at its staging path, bound into every pod's target path,
so all pods of a node share one mount and one disk cache; inline volumes share a mount per source; a
dead mount is mounted again in place and its targets bound again.

The gRPC servicer (node.py) checks requests and calls this; the supervisor (supervisor.py) calls `check`
every few seconds. Every change to the records is saved before the call returns.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pffs.backends.urls import open_backend
from pffs.config import CacheSettings, parse_size
from pffs.csi.attributes import (
    Credentials,
    VolumeAttributes,
    backend_options,
    cache_settings,
    canonical,
    mount_options,
    parse_attributes,
    parse_credentials,
)
from pffs.csi.cache_group import Membership, free_port, group_name
from pffs.csi.metrics import PluginMetrics
from pffs.csi.mounter import MounterTooOld, MounterUnavailable
from pffs.csi.mounts import (
    bind_mount,
    file_system_is_read_only,
    is_mount_process,
    mount_pid,
    mount_table,
    mounted_in_namespace_of,
    mounted_paths,
    set_file_system_read_only,
    shares_mounts_with_host,
    shows_mount_of,
    stop_mount_process,
    unmount_all,
)
from pffs.csi.pods import PodRef, Pods
from pffs.csi.rpc import Abort, Code, KeyedLocks, with_deadline, with_secret_hint
from pffs.csi.state import NodeState, Staged, Target, Warmed, path_key
from pffs.fuse import mount_record
from pffs.fuse.launch import MountStartError
from pffs.fuse.options import MountOptions
from pffs.vfs import shared_block_cache
from pffs.vfs.reader import cached_bytes_in

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    state_dir: Path
    cache: CacheSettings  # the node's disk cache: shared by every volume that does not ask for its own
    zone: str | None = None
    tor: str | None = None
    mount_ready_timeout_s: float = 60.0
    unmount_timeout_s: float = 60.0
    preflight_timeout_s: float = 30.0
    mount_verbosity: int = 1  # never 2 (debug) for CSI mounts: botocore's debug log prints signed headers
    kubelet_dir: Path | None = None  # the kubelet's root dir (the same path here as on the host)


class MountStarter(Protocol):
    """Starts a mount process and returns its pid once it serves: a MountRunner in this process, or the
    MounterClient of `pffs csi-mounter` (mounts that outlive this plugin's container)."""

    def start(self, options: MountOptions, volume: str, ready_timeout_s: float) -> int: ...


class VolumeManager:
    def __init__(
        self,
        config: NodeConfig,
        metrics: PluginMetrics,
        starter: MountStarter,
        api: object | None = None,
        membership: Membership | None = None,
    ) -> None:
        self.config = config
        self.membership = membership  # the node's cache groups (None: the plugin has none)
        self.metrics = metrics
        self.starter = starter
        self.pods = Pods(api, config.node_id)
        self._told_down: set[int | None] = set()
        self._told_unseen: set[int] = set()  # live mount processes whose mount this plugin does not see
        self._told_access: set[tuple[str, int | None]] = set()  # (staging path, errno) logged, not yet fixed
        self.state = NodeState(config.state_dir)
        self.locks = KeyedLocks()
        self._preflight = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="preflight")
        self._evictions_measured = -1  # the node cache's eviction count when warmed datasets were measured
        self._update_gauges()

    # Staging: one mount per volume

    def stage(
        self,
        volume_id: str,
        staging_path: str,
        context: dict[str, str],
        secrets: dict[str, str],
        capability: str,
        read_only: bool,
        inline_key: str | None = None,
    ) -> Staged:
        attributes = parse_attributes(context, "volume attributes")
        credentials = parse_credentials(secrets, "node stage secret")
        with self.state.lock:
            existing = self.state.records.staged.get(staging_path)
        if existing is not None:
            if existing.volume_id != volume_id and existing.inline_key is None:
                raise Abort(
                    Code.ALREADY_EXISTS,
                    f"{staging_path} has volume {existing.volume_id} staged, not {volume_id}",
                )
            if existing.capability != capability or existing.read_only != read_only:
                raise Abort(
                    Code.ALREADY_EXISTS,
                    f"volume {volume_id} is staged at {staging_path} with another access mode or read-only",
                )
            if not self.is_alive(existing):
                self.repair(existing)
            return existing
        self.check_visible(staging_path, "staging_target_path")
        self._check_cache_request(attributes, staging_path)
        self._check_group_request(attributes)
        self._preflight_source(attributes, credentials)
        staged = Staged(
            volume_id=volume_id,
            staging_path=staging_path,
            attributes=attributes.as_context(),
            capability=capability,
            read_only=read_only,
            inline_key=inline_key,
        )
        os.makedirs(staging_path, exist_ok=True)
        if staging_path in mounted_paths():
            log.warning(
                "%s holds a mount no record knows (a start whose answer was lost?); stopping it", staging_path
            )
            stop_mount_process(mount_pid(staging_path), staging_path, self.config.unmount_timeout_s)
        with self.state.lock:
            self.state.keep_secrets(staging_path, credentials.reveal())
        try:
            staged.peer_port = self._group_port(attributes, staging_path)
            staged.pid = self._start_mount(staged, attributes, credentials)
        except BaseException:
            self.state.forget_secrets(staging_path)
            if self.membership is not None:
                self.membership.leave(staging_path)
            raise
        with self.state.lock:
            self.state.records.staged[staging_path] = staged
            self.state.save()
        self._match_host_access(staged)
        self._update_gauges()
        return staged

    def unstage(self, staging_path: str) -> None:
        with self.state.lock:
            staged = self.state.records.staged.get(staging_path)
        if staged is None:
            # Not ours, or forgotten by a plugin that lost its state: leave nothing mounted there.
            if staging_path in mounted_paths():
                stop_mount_process(mount_pid(staging_path), staging_path, self.config.unmount_timeout_s)
            with self.state.lock:
                self.state.forget_secrets(staging_path)
            return
        for target in list(staged.targets):
            log.warning("unstaging %s while %s is still published there; unbinding it", staging_path, target)
            unmount_all(target)
        stop_mount_process(staged.pid, staging_path, self.config.unmount_timeout_s)
        if self.membership is not None:
            self.membership.leave(staging_path)
        with self.state.lock:
            self.state.records.staged.pop(staging_path, None)
            self.state.forget_secrets(staging_path)
            self.state.save()
        if staged.inline_key and staging_path not in mounted_paths():
            # Never under a live mount: rmtree would go through it and delete the dataset's objects.
            shutil.rmtree(Path(staging_path).parent, ignore_errors=True)
        self._update_gauges()

    # Publishing: bind mounts into pods

    def check_visible(self, path: str, field: str) -> None:
        """FAILED_PRECONDITION unless a mount made at `path` reaches the host, the kubelet and the pods."""
        kubelet_dir = self.config.kubelet_dir
        if kubelet_dir is None:
            return  # a plugin on the host, beside the kubelet (tests): nothing to judge by
        if not (path + "/").startswith(str(kubelet_dir).rstrip("/") + "/"):
            raise Abort(
                Code.FAILED_PRECONDITION,
                f"{field} {path} is outside the plugin's --kubelet-dir {kubelet_dir}: set the Helm value "
                "node.kubeletPath to the kubelet's --root-dir (it is mounted at the same path on the host "
                "and in the plugin)",
            )
        if not shares_mounts_with_host(path):
            raise Abort(
                Code.FAILED_PRECONDITION,
                f"{field} {path} is not on a mount this plugin shares with the host: a mount there would "
                "stay inside the plugin's container. Mount the kubelet's root dir into the node plugin and "
                "the mounter at the host's path with mountPropagation: Bidirectional (Helm value "
                "node.kubeletPath)",
            )

    def publish(
        self,
        volume_id: str,
        staging_path: str,
        target_path: str,
        read_only: bool,
        pod: PodRef | None = None,
    ) -> None:
        with self.state.lock:
            staged = self.state.records.staged.get(staging_path)
            owner = self.state.find_target(target_path)
        if staged is None or (staged.volume_id != volume_id and staged.inline_key is None):
            raise Abort(
                Code.FAILED_PRECONDITION,
                f"volume {volume_id} is not staged at {staging_path} (NodeStageVolume first)",
            )
        if owner is None:
            self.check_visible(target_path, "target_path")
        read_only = read_only or staged.read_only
        if not read_only and owner is None and self.pods.mounts_read_only(pod, target_path):
            read_only = True  # every container mounts it readOnly: so is the host's bind, from the start
        elif owner is not None:
            read_only = read_only or owner.targets[target_path].read_only
        if owner is not None:
            existing = owner.targets[target_path]
            if owner is not staged or existing.volume_id != volume_id or existing.read_only != read_only:
                raise Abort(
                    Code.ALREADY_EXISTS,
                    f"{target_path} is already published with another volume or read-only flag",
                )
            if not shows_mount_of(target_path, staging_path):
                bind_mount(staging_path, target_path, read_only)
            return
        if not self.is_alive(staged):
            self.repair(staged)
        os.makedirs(target_path, exist_ok=True)
        if target_path in mounted_paths():
            raise Abort(Code.ALREADY_EXISTS, f"something else is mounted at {target_path}")
        bind_mount(staging_path, target_path, read_only)
        with self.state.lock:
            staged.targets[target_path] = Target(volume_id=volume_id, read_only=read_only, pod=pod)
            self.state.save()
        if not read_only:
            self._match_host_access(staged, strict=True)
        self._update_gauges()

    def publish_inline(
        self,
        volume_id: str,
        target_path: str,
        context: dict[str, str],
        secrets: dict[str, str],
        read_only: bool,
        pod: PodRef | None = None,
    ) -> None:
        """An inline (ephemeral) volume: the CO publishes without staging. Pods naming the same source with
        the same attributes and credentials share one mount, made here on the first and kept until the
        last is unpublished. Read-only publishes (the request's, or every container's volumeMount) share
        a mount that is itself read-only, so nothing on the host can write through it either; read-write
        ones share another."""
        attributes = parse_attributes(context, "inline volume attributes")
        credentials = parse_credentials(secrets, "node publish secret")
        read_only = read_only or attributes.read_only or self.pods.mounts_read_only(pod, target_path)
        key = inline_key(attributes, credentials, read_only)
        with self.locks.hold(f"inline:{key}", wait_s=self.config.mount_ready_timeout_s + 5):
            with self.state.lock:
                staged = self.state.find_inline(key)
            if staged is None:
                staging_path = str(self.inline_dir() / key / "mount")
                with self.locks.hold(staging_path):
                    staged = self.stage(
                        volume_id,
                        staging_path,
                        context,
                        secrets,
                        capability="inline",
                        read_only=read_only,
                        inline_key=key,
                    )
            with self.locks.hold(staged.staging_path, wait_s=30):
                self.publish(volume_id, staged.staging_path, target_path, read_only, pod)

    def unpublish(self, volume_id: str, target_path: str) -> None:
        with self.state.lock:
            staged = self.state.find_target(target_path)
        if staged is not None and staged.targets[target_path].volume_id != volume_id:
            raise Abort(
                Code.NOT_FOUND,
                f"{target_path} holds volume {staged.targets[target_path].volume_id}, not {volume_id}",
            )
        if staged is None:
            self._unbind(target_path)
            return
        # Under the staging path's lock: a repair binds every recorded target under it.
        with self.locks.hold(staged.staging_path, wait_s=30):
            self._unbind(target_path)
            with self.state.lock:
                staged.targets.pop(target_path, None)
                self.state.save()
                last_inline_target = staged.inline_key is not None and not staged.targets
            if not last_inline_target:
                self._match_host_access(staged)
        self._update_gauges()
        if last_inline_target:
            with self.locks.hold(f"inline:{staged.inline_key}", wait_s=30):
                with self.state.lock:
                    still_unused = not staged.targets and staged.staging_path in self.state.records.staged
                if still_unused:
                    with self.locks.hold(staged.staging_path, wait_s=30):
                        self.unstage(staged.staging_path)

    @staticmethod
    def _unbind(target_path: str) -> None:
        unmount_all(target_path)
        try:
            os.rmdir(target_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove %s: %s", target_path, exc.strerror)

    def inline_dir(self) -> Path:
        """Where inline volumes' shared mounts live: under the kubelet dir (mounted into the plugin and the
        mounter with Bidirectional propagation, so the mounter's mount reaches the plugin that binds it)."""
        if self.config.kubelet_dir is not None:
            return self.config.kubelet_dir / "plugins" / "csi.pffs.io" / "inline"
        return self.config.state_dir / "inline"

    # Health and repair

    def is_alive(self, staged: Staged) -> bool:
        return is_mount_process(staged.pid) and staged.staging_path in mounted_paths()

    def log_file(self, staging_path: str) -> Path:
        return self.config.state_dir / "logs" / f"mount-{path_key(staging_path)}.log"

    def how_it_ended(self, staged: Staged) -> str:
        """How the mount process of `staged` ended, from the record next to its log (mount_record)."""
        log_file = self.log_file(staged.staging_path)
        cause = mount_record.last_cause(mount_record.record_path_for_log(log_file), wait_s=2.0)
        return f"{cause or 'no last word recorded'}; its log: {log_file}"

    def check(self) -> None:
        """One round of the supervisor: repair dead mounts, re-bind targets that lost their bind."""
        with self.state.lock:
            volumes = list(self.state.records.staged.values())
        for staged in volumes:
            try:
                with self.locks.hold(staged.staging_path, wait_s=1.0):
                    with self.state.lock:
                        if self.state.records.staged.get(staged.staging_path) is not staged:
                            continue  # unstaged meanwhile
                    if not self.is_alive(staged):
                        if self._unseen(staged):
                            continue
                        self.repair(staged)
                    else:
                        self._rebind_lost_targets(staged)
            except Abort as exc:
                if exc.code is Code.ABORTED:
                    continue  # an RPC is working on it; next round
                log.error("could not repair the mount at %s: %s (retrying)", staged.staging_path, exc.message)
            except Exception as exc:  # repair() counted it
                log.error("could not repair the mount at %s: %s (retrying)", staged.staging_path, exc)

    def adopt(self) -> None:
        """At start: the records of a previous plugin process. Healthy mounts are kept as they are (no
        remount, no request to the backend); dead ones are mounted again."""
        self._move_inline_mounts()
        self.rejoin_groups()
        with self.state.lock:
            volumes = list(self.state.records.staged.values())
        for staged in volumes:
            if self.is_alive(staged):
                log.info(
                    "adopted the running mount of %s at %s (pid %s)",
                    staged.attributes.get("source"),
                    staged.staging_path,
                    staged.pid,
                )
        self.check()

    def _move_inline_mounts(self) -> None:
        """Inline volumes staged by a release that kept their mounts in the state dir: the mounter's mounts
        there would never reach this plugin, so each record moves to inline_dir() and is mounted there (the
        old mount died with the old plugin's container)."""
        inline_dir = str(self.inline_dir())
        legacy_dir = str(self.config.state_dir / "inline")
        with self.state.lock:
            for old_path, staged in list(self.state.records.staged.items()):
                # Only the old layout's records move: a path elsewhere is not this release's to judge.
                if staged.inline_key is None or not old_path.startswith(legacy_dir + "/"):
                    continue
                if old_path.startswith(inline_dir + "/"):
                    continue
                if self.is_alive(staged):
                    continue  # still serving where it is (a plugin on the host, say): leave it
                new_path = f"{inline_dir}/{staged.inline_key}/mount"
                os.makedirs(new_path, exist_ok=True)
                self.state.keep_secrets(new_path, self.state.read_secrets(old_path))
                self.state.forget_secrets(old_path)
                unmount_all(old_path)
                del self.state.records.staged[old_path]
                staged.staging_path = new_path
                self.state.records.staged[new_path] = staged
                log.warning("inline volume %s moves from %s to %s", staged.volume_id, old_path, new_path)
            self.state.save()

    def _unseen(self, staged: Staged) -> bool:
        """Whether the mount process of `staged` still serves its path in its own mount namespace (the
        mounter's) while this plugin does not see that mount: not dead, only unseen from here (a kubelet
        dir that is not the kubelet's). Logged once per process."""
        pid = staged.pid
        if not pid or not is_mount_process(pid) or not mounted_in_namespace_of(pid, staged.staging_path):
            return False
        if pid not in self._told_unseen:
            self._told_unseen.add(pid)
            log.error(
                "the mount process %d serves %s in its own mount namespace, but this plugin does not see "
                "that mount: leaving it alone (is node.kubeletPath the kubelet's --root-dir, the same for "
                "the node plugin and the mounter?)",
                pid,
                staged.staging_path,
            )
        return True

    def repair(self, staged: Staged) -> None:
        """Mounts a dead volume again at its staging path and binds every target again. The pods' bind
        mounts pointed at the dead mount; with HostToContainer propagation they see the new ones.
        A mount whose process still serves it where it was started is not dead, only unseen from here:
        it is left alone (logged once), never stopped."""
        if self._unseen(staged):
            raise Abort(Code.FAILED_PRECONDITION, f"the mount at {staged.staging_path} is not visible here")
        ended = self.how_it_ended(staged)
        log.warning(
            "the mount of %s at %s is dead (pid %s: %s); mounting it again",
            staged.attributes.get("source"),
            staged.staging_path,
            staged.pid,
            ended,
        )
        with self.state.lock:
            targets = list(staged.targets.items())
        # Read before the repair: a target whose pod cannot see it gets the new mount instead of the dead
        # one (one mount there), not over it.
        blind = {target: self.pods.blind_containers(info.pod, target) for target, info in targets}
        try:
            self._mount_again(staged, replace={target for target, b in blind.items() if b and b.containers})
        except Exception as exc:
            self.metrics.recovery_failures.inc()
            if staged.pid not in self._told_down:  # once per dead mount, not once per retry
                self._told_down.add(staged.pid)
                self._tell_pods(
                    staged,
                    "Warning",
                    "PffsMountDown",
                    f"the pffs mount died ({ended}) and could not be mounted again yet ({exc}); retrying",
                )
            raise
        self.metrics.recoveries.inc()
        self._told_down.discard(staged.pid)
        source = staged.attributes.get("source", "")
        for target, info in targets:
            if info.pod is not None:  # PffsMountRepaired, or why the pod does not see it (pods.py)
                self.pods.post_repaired(info.pod, target, source, ended, blind.get(target))

    def _tell_pods(self, staged: Staged, kind: str, reason: str, message: str) -> None:
        for target in staged.targets.values():
            if target.pod is not None:
                self.pods.post_event(target.pod, kind, reason, message)

    def _mount_again(self, staged: Staged, replace: set[str]) -> None:
        """The new mount is bound over each target's dead one: a container's /data is a slave copy of the
        target's top mount, which receives mounts made on top of it and nothing else (not its unmount,
        nor a mount made anew after it), so a live mount reaches a running pod only on top of the dead
        one. Targets in `replace` (pods without HostToContainer, which see neither) lose the dead one
        first: one mount each. With `pffs csi-mounter`, this happens only when the mounter's pod ends;
        restarts of the plugin leave the mounts be."""
        if staged.pid and is_mount_process(staged.pid):
            stop_mount_process(staged.pid, staged.staging_path, timeout_s=5)
        unmount_all(staged.staging_path)
        attributes = parse_attributes(staged.attributes, "recorded volume attributes")
        secrets = self.state.read_secrets(staged.staging_path)
        credentials = parse_credentials(secrets, "recorded secret")
        pid = self._start_mount(staged, attributes, credentials)
        with self.state.lock:
            staged.pid = pid
            self.state.save()
        self._bind_targets(staged, lost_only=False, replace=replace)
        self._match_host_access(staged)
        log.info(
            "mounted %s again at %s (pid %d) and bound it into %d target(s)",
            staged.attributes.get("source"),
            staged.staging_path,
            pid,
            len(staged.targets),
        )

    def _rebind_lost_targets(self, staged: Staged) -> None:
        self._bind_targets(staged, lost_only=True)
        self._match_host_access(staged)

    def _match_host_access(self, staged: Staged, strict: bool = False) -> None:
        """A read-write volume's file system is read-only (on the host, in every mount namespace) while no
        pod on this node has it read-write: a volume that every pod here reads is read-only where its data
        is, not only in the pods' binds. A read-write publish makes it writable (logged; the read-only
        pods keep read-only binds), the unpublish of the last one read-only again. Going read-only fails
        while a file is open for writing on it (EBUSY): retried each supervisor round. `strict`: a
        failure to make it writable is the publish's error."""
        if staged.read_only:
            return  # mounted read-only from the start (pffs mount --read-only): nothing to switch
        with self.state.lock:
            writers = [target for target, info in staged.targets.items() if not info.read_only]
        want_read_only = not writers
        path = staged.staging_path
        try:
            if file_system_is_read_only(path) in (None, want_read_only):  # not mounted, or as wanted
                return
            set_file_system_read_only(path, want_read_only)
        except OSError as exc:
            if strict:
                raise Abort(Code.INTERNAL, f"could not make the mount at {path} writable: {exc}") from None
            if (path, exc.errno) not in self._told_access:  # once, not each round
                self._told_access.add((path, exc.errno))
                log.warning("could not make the mount at %s read-only: %s (retrying)", path, exc.strerror)
            return
        self._told_access = {told for told in self._told_access if told[0] != path}
        source = staged.attributes.get("source")
        if want_read_only:
            log.info("%s at %s is read-only on this node now: no pod here has it read-write", source, path)
        else:
            log.info(
                "%s at %s is read-write on this node now: %s has it read-write (pods that have it read-only "
                "keep read-only binds)",
                source,
                path,
                writers[0],
            )

    def _bind_targets(self, staged: Staged, lost_only: bool, replace: Collection[str] = ()) -> None:
        """Binds the staged mount into each recorded target (only those that do not show it, with
        `lost_only`), each on its own: a failure is logged and the others still get theirs. The targets in
        `replace` are emptied first. Callers hold the staging path's lock, which unpublish takes too."""
        with self.state.lock:
            targets = list(staged.targets.items())
        table = mount_table()  # read once for every target: this runs each second for each volume
        for target, info in targets:
            shown = shows_mount_of(target, staged.staging_path, table)
            if lost_only and (shown or not os.path.isdir(target)):
                continue
            if lost_only:
                log.warning("target %s does not show its volume's mount; binding it again", target)
            try:
                if target in replace:
                    unmount_all(target)
                bind_mount(staged.staging_path, target, info.read_only)
            except OSError as exc:
                log.error("could not bind %s into %s: %s (retrying)", staged.staging_path, target, exc)

    # Mount processes

    def _start_mount(self, staged: Staged, attributes: VolumeAttributes, credentials: Credentials) -> int:
        cache = self.cache_settings_for(staged.staging_path, attributes)
        peers = None
        if attributes.cache_group != "off" and self.membership is not None:
            group = group_name(attributes.source, attributes.endpoint_url, cache.block_size)
            peers = self.membership.settings_for(staged.staging_path, group, staged.peer_port)
        options = mount_options(
            attributes,
            credentials,
            Path(staged.staging_path),
            cache,
            staged.read_only,
            self.log_file(staged.staging_path),
            self.config.mount_verbosity,
            peers,
        )
        try:
            return self.starter.start(options, staged.volume_id, self.config.mount_ready_timeout_s)
        except MountStartError as exc:
            code = Code.INVALID_ARGUMENT if exc.exit_code == 2 else Code.INTERNAL
            raise Abort(code, with_secret_hint(f"could not mount {attributes.source}: {exc}")) from None
        except MounterUnavailable as exc:
            raise Abort(Code.UNAVAILABLE, str(exc)) from None
        except MounterTooOld as exc:
            raise Abort(Code.FAILED_PRECONDITION, str(exc)) from None

    # Cache groups

    def _check_group_request(self, attributes: VolumeAttributes) -> None:
        if attributes.cache_group != "off" and self.membership is None:
            raise Abort(
                Code.FAILED_PRECONDITION,
                f"cacheGroup: {attributes.cache_group}, but this node's plugin has no cache group: set the "
                "Helm value cacheGroup.enabled (pffs csi --cache-group-token-file and --node-ip)",
            )

    def _group_port(self, attributes: VolumeAttributes, staging_path: str) -> int | None:
        """A port of the group's range for a sharing volume's mount to serve on (kept in its record)."""
        if attributes.cache_group != "share" or self.membership is None:
            return None
        with self.state.lock:
            taken = {s.peer_port for s in self.state.records.staged.values() if s.peer_port is not None}
        port = free_port(self.membership.config, taken | self.membership.ports_taken())
        if port is None:
            (first, last), ip = self.membership.config.ports, self.membership.config.node_ip
            raise Abort(
                Code.RESOURCE_EXHAUSTED,
                f"cacheGroup: share: every port of {first}-{last} is taken on {ip} "
                "(the Helm value cacheGroup.ports gives more)",
            )
        return port

    def rejoin_groups(self) -> None:
        """At start: the volumes of the records join their groups again (their running mounts read the same
        members files, kept up to date from here on)."""
        if self.membership is None:
            return
        with self.state.lock:
            volumes = list(self.state.records.staged.values())
        for staged in volumes:
            attributes = parse_attributes(staged.attributes, "recorded volume attributes")
            if attributes.cache_group == "off":
                continue
            cache = self.cache_settings_for(staged.staging_path, attributes)
            group = group_name(attributes.source, attributes.endpoint_url, cache.block_size)
            self.membership.settings_for(staged.staging_path, group, staged.peer_port)

    def cache_settings_for(self, staging_path: str, attributes: VolumeAttributes) -> CacheSettings:
        """The node's shared cache, or the volume's own (under the node's cache dir) when it asks for a
        size: the node's bound is split, the shared cache keeping what the volumes' own caches leave."""
        node = self.config.cache
        if attributes.cache_size is None:
            own = self._own_cache_bytes(exclude=staging_path)
            shared = attributes.model_copy(update={"cache_size": max(node.cache_size - own, 0)})
            return cache_settings(shared, node, node.cache_dir)
        return cache_settings(attributes, node, node.cache_dir / "volumes" / path_key(staging_path))

    def _own_cache_bytes(self, exclude: str) -> int:
        """What the node's cache budget has given to volumes' own caches (all but `exclude`'s)."""
        with self.state.lock:
            sizes = [
                staged.attributes.get("cacheSize")
                for path, staged in self.state.records.staged.items()
                if path != exclude
            ]
        return sum(parse_size(size) for size in sizes if size)

    def _check_cache_request(self, attributes: VolumeAttributes, staging_path: str) -> None:
        if attributes.cache_size is None:
            return
        node_size = self.config.cache.cache_size
        if attributes.cache_size > node_size:
            raise Abort(
                Code.INVALID_ARGUMENT,
                f"cacheSize {attributes.cache_size} is larger than this node's cache ({node_size} bytes, "
                "the plugin's --cache-size)",
            )
        taken = self._own_cache_bytes(exclude=staging_path)
        if taken + attributes.cache_size > node_size:
            raise Abort(
                Code.RESOURCE_EXHAUSTED,
                f"cacheSize {attributes.cache_size}: only {node_size - taken} bytes of this node's cache "
                "are not given to other volumes' own caches",
            )

    def _preflight_source(self, attributes: VolumeAttributes, credentials: Credentials) -> None:
        """Checks that the source exists and the credentials work, here, so that a mistake gets its own
        code (NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE) and not the mount process's one line."""

        def stat_source() -> bool:
            backend, root = open_backend(attributes.source, backend_options(attributes, credentials))
            return backend.stat(root).is_dir

        is_dir = with_deadline(
            self._preflight, stat_source, self.config.preflight_timeout_s, attributes.source
        )
        if not is_dir:
            raise Abort(
                Code.INVALID_ARGUMENT, f"source {attributes.source} is an object, not a prefix or folder"
            )

    def record_warmed(self, dataset: str, objects: list[tuple[str, int]], cached_bytes: int) -> None:
        """A DatasetWarmup ended on this node: its dataset goes into the cache report, and its objects
        (cache id, size) into a file of their own, to measure again after evictions."""
        folder = self.config.state_dir / "warmed"
        folder.mkdir(exist_ok=True)
        objects_file = folder / f"{path_key(dataset)}.json"
        temporary = objects_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(objects))
        temporary.replace(objects_file)
        total = sum(size for _, size in objects)
        with self.state.lock:
            self.state.records.warmed[dataset] = Warmed(
                cached_bytes=cached_bytes, total_bytes=total, objects_file=str(objects_file)
            )
            self.state.save()

    def refresh_warmed(self) -> None:
        """Measures the warmed datasets again if the node's cache evicted since they were last measured
        (a report that says "warm" must stay true: the scheduler binds on it)."""
        cache = shared_block_cache(self.config.cache)
        evictions = int(cache.machine_totals().get("disk_evictions", 0))
        if evictions == self._evictions_measured:
            return
        with self.state.lock:
            warmed = dict(self.state.records.warmed)
        measured: dict[str, int] = {}
        for dataset, found in warmed.items():
            if found.objects_file is None:
                continue
            try:
                objects = json.loads(Path(found.objects_file).read_text())
            except (OSError, ValueError) as exc:
                log.info("cache report: cannot measure %s again (%s)", dataset, exc)
                continue
            measured[dataset] = sum(cached_bytes_in(cache, cache_id, size) for cache_id, size in objects)
        with self.state.lock:
            for dataset, cached in measured.items():
                if dataset in self.state.records.warmed:
                    self.state.records.warmed[dataset].cached_bytes = cached
            self.state.save()
        self._evictions_measured = evictions

    def disk_bytes_used(self) -> int:
        """Block bytes in the node's shared disk cache."""
        settings = self.config.cache
        return int(shared_block_cache(settings).usage().get("disk_bytes", 0))

    def _update_gauges(self) -> None:
        with self.state.lock:
            staged = self.state.records.staged.values()
            self.metrics.volumes_staged.set(len(staged))
            self.metrics.targets_published.set(sum(len(s.targets) for s in staged))
            self.metrics.show_volumes(staged)  # what each mount's `volume` label is, by name

    def close(self) -> None:
        """Stops supervising; the mounts keep running (the next plugin process adopts them)."""
        self._preflight.shutdown(wait=False, cancel_futures=True)
        self.pods.close()
        with self.state.lock:
            self.state.save()


def inline_key(attributes: VolumeAttributes, credentials: Credentials, read_only: bool) -> str:
    """Which inline mount a publish shares: one per source, attributes, credentials and read-only-ness
    (keys of read-write mounts are those of earlier versions, which adopt them after an upgrade)."""
    key = hashlib.sha256(f"{canonical(attributes)}\0{credentials.digest}".encode()).hexdigest()[:24]
    return f"{key}-ro" if read_only else key
