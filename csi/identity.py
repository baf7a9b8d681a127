"""The CSI Identity service: who the plugin is, what it serves, and whether it can serve now."""

from __future__ import annotations

import os
from typing import Any

import grpc

from pffs import __version__
from pffs.csi import csi_pb2, csi_pb2_grpc
from pffs.csi.metrics import PluginMetrics
from pffs.csi.rpc import rpc

DRIVER_NAME = "csi.pffs.io"
Service = csi_pb2.PluginCapability.Service


def fuse_usable() -> bool:
    """A node plugin can mount only while /dev/fuse opens (the DaemonSet mounts it from the host)."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
        return True
    except OSError:
        return False


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    def __init__(self, metrics: PluginMetrics, controller: bool, node: bool) -> None:
        self.metrics = metrics
        self.controller = controller
        self.node = node

    @rpc
    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        kinds = [Service.VOLUME_ACCESSIBILITY_CONSTRAINTS]
        if self.controller:
            kinds.insert(0, Service.CONTROLLER_SERVICE)
        return csi_pb2.GetPluginCapabilitiesResponse(
            capabilities=[csi_pb2.PluginCapability(service=Service(type=k)) for k in kinds]
        )

    @rpc
    def Probe(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = csi_pb2.ProbeResponse()
        response.ready.value = fuse_usable() if self.node else True
        return response
