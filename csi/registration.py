"""Registering the driver with the kubelet (its plugin registration API), as the node-driver-registrar
sidecar does: a socket in the kubelet's `plugins_registry` folder that answers GetInfo with the driver's
name and CSI socket. The kubelet finds the socket, asks, then talks CSI to the node plugin. Used where no
registrar runs beside the plugin (`pffs csi --kubelet-registration-dir`: the chart's default, unless
node.sidecars.enabled). Whether the kubelet registered the driver (NotifyRegistrationStatus) is the node
plugin's readiness, as the registrar's kubelet-registration-probe is in Mountpoint's chart.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from pffs.csi import pluginregistration_pb2, pluginregistration_pb2_grpc

log = logging.getLogger(__name__)

CSI_VERSIONS = ["1.0.0"]


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, csi_socket: str) -> None:
        self.driver_name = driver_name
        self.csi_socket = csi_socket
        self.registered: bool | None = None
        self.error = ""
        self.on_status: Callable[[], None] = lambda: None  # called after each NotifyRegistrationStatus

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pluginregistration_pb2.PluginInfo(
            type="CSIPlugin", name=self.driver_name, endpoint=self.csi_socket, supported_versions=CSI_VERSIONS
        )

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.registered = request.plugin_registered
        self.error = request.error
        if request.plugin_registered:
            log.info("the kubelet registered %s (CSI socket %s)", self.driver_name, self.csi_socket)
        else:
            log.error("the kubelet refused to register %s: %s", self.driver_name, request.error)
        self.on_status()
        return pluginregistration_pb2.RegistrationStatusResponse()


class KubeletRegistration:
    """The registration socket's own small gRPC server."""

    def __init__(self, registration_dir: Path, driver_name: str, csi_socket: str) -> None:
        self.socket = registration_dir / f"{driver_name}-reg.sock"
        self.servicer = RegistrationServicer(driver_name, csi_socket)
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="registration"))
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(self.servicer, self.server)
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            os.unlink(self.socket)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def stop(self) -> None:
        if not self.started:
            return
        self.server.stop(grace=1).wait(5)
        if self.socket.exists():
            os.unlink(self.socket)  # the kubelet deregisters the driver when its socket goes
