"""The CSI Node service: checks each call as the spec's tables say and hands it to the VolumeManager."""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
from typing import Any, NamedTuple

import grpc

from pffs.csi import csi_pb2, csi_pb2_grpc
from pffs.csi.attributes import EPHEMERAL_KEY
from pffs.csi.capabilities import check_capability
from pffs.csi.metrics import PluginMetrics
from pffs.csi.mounts import is_mount_process, mounted_paths
from pffs.csi.pods import pod_of
from pffs.csi.rpc import Abort, Code, check_path, check_volume_id, require, rpc
from pffs.csi.state import Staged
from pffs.csi.volumes import VolumeManager

log = logging.getLogger(__name__)

TOPOLOGY_NODE = "topology.pffs.io/node"
TOPOLOGY_ZONE = "topology.pffs.io/zone"
TOPOLOGY_TOR = "topology.pffs.io/tor"
STATS_TIMEOUT_S = 5.0

NodeCapability = csi_pb2.NodeServiceCapability.RPC


class Problem(NamedTuple):
    """Why a volume does not serve: a CamelCase reason for machines and a message for people."""

    reason: str
    message: str


class NodeServicer(csi_pb2_grpc.NodeServicer):
    def __init__(self, volumes: VolumeManager, metrics: PluginMetrics) -> None:
        self.volumes = volumes
        self.metrics = metrics
        self._stats = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="statfs")

    @rpc
    def NodeStageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "staging_target_path", "volume_capability")
        volume_id = check_volume_id(request.volume_id)
        staging_path = check_path(request.staging_target_path, "staging_target_path")
        capability, read_only = check_capability(request.volume_capability)
        with self.volumes.locks.hold(staging_path):
            self.volumes.stage(
                volume_id,
                staging_path,
                dict(request.volume_context),
                dict(request.secrets),
                capability,
                read_only,
            )
        return csi_pb2.NodeStageVolumeResponse()

    @rpc
    def NodeUnstageVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "staging_target_path")
        check_volume_id(request.volume_id)
        staging_path = check_path(request.staging_target_path, "staging_target_path")
        with self.volumes.locks.hold(staging_path):
            self.volumes.unstage(staging_path)
        return csi_pb2.NodeUnstageVolumeResponse()

    @rpc
    def NodePublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "target_path", "volume_capability")
        volume_id = check_volume_id(request.volume_id)
        target_path = check_path(request.target_path, "target_path")
        _, read_only_mode = check_capability(request.volume_capability)
        read_only = request.readonly or read_only_mode
        context_map = dict(request.volume_context)
        with self.volumes.locks.hold(target_path):
            if context_map.get(EPHEMERAL_KEY) == "true":
                self.volumes.publish_inline(
                    volume_id, target_path, context_map, dict(request.secrets), read_only, pod_of(context_map)
                )
                return csi_pb2.NodePublishVolumeResponse()
            if not request.staging_target_path:
                raise Abort(
                    Code.FAILED_PRECONDITION,
                    "staging_target_path is required: pffs stages volumes (NodeStageVolume first)",
                )
            staging_path = check_path(request.staging_target_path, "staging_target_path")
            with self.volumes.locks.hold(staging_path, wait_s=30):
                self.volumes.publish(volume_id, staging_path, target_path, read_only, pod_of(context_map))
        return csi_pb2.NodePublishVolumeResponse()

    @rpc
    def NodeUnpublishVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "target_path")
        volume_id = check_volume_id(request.volume_id)
        target_path = check_path(request.target_path, "target_path")
        with self.volumes.locks.hold(target_path):
            self.volumes.unpublish(volume_id, target_path)
        return csi_pb2.NodeUnpublishVolumeResponse()

    @rpc
    def NodeGetVolumeStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "volume_path")
        path, staged = self._known_path(request.volume_id, request.volume_path)
        response = csi_pb2.NodeGetVolumeStatsResponse()
        problem, st = self._inspect(staged, path)
        if problem:
            raise Abort(Code.UNAVAILABLE, problem.message)
        assert st is not None
        usage = csi_pb2.VolumeUsage
        response.usage.extend(
            [
                usage(
                    unit=usage.BYTES,
                    total=st.f_blocks * st.f_frsize,
                    available=st.f_bavail * st.f_frsize,
                    used=(st.f_blocks - st.f_bfree) * st.f_frsize,
                ),
                usage(
                    unit=usage.INODES, total=st.f_files, available=st.f_favail, used=st.f_files - st.f_ffree
                ),
            ]
        )
        return response

    @rpc
    def NodeGetVolumeHealth(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Spec v1.13.0's replacement for the volume condition: INACCESSIBLE while the mount is dead or
        does not answer (the supervisor is mounting it again), no entry while it serves."""
        require(request, "volume_id")
        given = request.volume_publish_path or request.staging_target_path
        if not given:
            given = self._any_path(request.volume_id)
        path, staged = self._known_path(request.volume_id, given)
        problem, _ = self._inspect(staged, path)
        health = csi_pb2.VolumeHealth(volume_id=request.volume_id)
        if problem:
            health.health_statuses.add(
                status=csi_pb2.INACCESSIBLE, reason=problem.reason, message=problem.message
            )
        return csi_pb2.NodeGetVolumeHealthResponse(volume_health=health)

    def _known_path(self, volume_id: str, path: str) -> tuple[str, Staged]:
        """The path, normalized, and the record of the volume staged or published there."""
        path = os.path.normpath(path) if path.startswith("/") else ""
        staged = self._volume_at(volume_id, path) if path else None
        if staged is None:
            raise Abort(
                Code.NOT_FOUND, f"volume {volume_id} is not staged or published at {path or '(none)'}"
            )
        return path, staged

    def _any_path(self, volume_id: str) -> str:
        with self.volumes.state.lock:
            for staged in self.volumes.state.records.staged.values():
                if staged.volume_id == volume_id:
                    return staged.staging_path
                for target, info in staged.targets.items():
                    if info.volume_id == volume_id:
                        return target
        return ""

    def _inspect(self, staged: Staged, path: str) -> tuple[Problem | None, os.statvfs_result | None]:
        """Whether the volume at `path` serves, without letting a hung mount hold the call."""
        if not is_mount_process(staged.pid):
            ended = self.volumes.how_it_ended(staged)
            return Problem(
                "MountProcessGone", f"the pffs mount process is gone ({ended}); it is being mounted again"
            ), None
        if path not in mounted_paths():
            return Problem("NotMounted", f"nothing is mounted at {path}; it is being bound again"), None
        try:
            return None, self._stats.submit(os.statvfs, path).result(timeout=STATS_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return Problem("NotAnswering", f"the pffs mount at {path} does not answer"), None
        except OSError as exc:
            return Problem(
                "MountFailing", f"the pffs mount at {path} fails: {os.strerror(exc.errno or errno.EIO)}"
            ), None

    def _volume_at(self, volume_id: str, path: str) -> Staged | None:
        with self.volumes.state.lock:
            staged = self.volumes.state.records.staged.get(path)
            if staged is not None and (staged.volume_id == volume_id or staged.inline_key):
                return staged
            owner = self.volumes.state.find_target(path)
            if owner is not None and owner.targets[path].volume_id == volume_id:
                return owner
        return None

    @rpc
    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        kinds = (
            NodeCapability.STAGE_UNSTAGE_VOLUME,
            NodeCapability.GET_VOLUME_STATS,
            NodeCapability.GET_VOLUME_HEALTH,
        )
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[csi_pb2.NodeServiceCapability(rpc=NodeCapability(type=k)) for k in kinds]
        )

    @rpc
    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        config = self.volumes.config
        segments = {TOPOLOGY_NODE: config.node_id}
        if config.zone:
            segments[TOPOLOGY_ZONE] = config.zone
        if config.tor:
            segments[TOPOLOGY_TOR] = config.tor
        return csi_pb2.NodeGetInfoResponse(
            node_id=config.node_id, accessible_topology=csi_pb2.Topology(segments=segments)
        )
