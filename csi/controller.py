"""The CSI Controller service: a volume is a prefix (or folder) under the StorageClass's `source`, named
after the CO's volume name, so asking twice for one name gives the same volume.

Each volume holds a small marker object, `.pffs-volume.json` (name, capacity, parameters): it makes the
prefix exist on object stores, lets a repeated CreateVolume tell "the same volume" from "another volume
with that name" (ALREADY_EXISTS), and lets DeleteVolume remove only what this driver provisioned, and only
when the StorageClass said `onDelete: delete`. Capacity is recorded, not enforced (object stores have no
quota per prefix).

The volume id is the volume's URL, plus the endpoint and region when the class gives them
(`s3://bucket/pvc/pvc-123#endpointUrl=http%3A%2F%2F10.0.0.5%3A8333`): DeleteVolume receives nothing else.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from typing import Any
from urllib.parse import parse_qsl, urlencode

import grpc

from pffs.backends.backend import Backend
from pffs.backends.urls import open_backend
from pffs.csi import csi_pb2, csi_pb2_grpc
from pffs.csi.attributes import (
    SCHEMES,
    Credentials,
    VolumeAttributes,
    backend_options,
    parse_attributes,
    parse_credentials,
)
from pffs.csi.capabilities import check_capabilities, unsupported_reason
from pffs.csi.metrics import PluginMetrics
from pffs.csi.rpc import Abort, Code, require, rpc, with_deadline

log = logging.getLogger(__name__)

MARKER = ".pffs-volume.json"
MAX_NAME = 128
ControllerCapability = csi_pb2.ControllerServiceCapability.RPC


class ControllerServicer(csi_pb2_grpc.ControllerServicer):
    def __init__(self, metrics: PluginMetrics, backend_timeout_s: float = 30.0) -> None:
        self.metrics = metrics
        self.backend_timeout_s = backend_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="controller")

    @rpc
    def CreateVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "name", "volume_capabilities")
        name = _check_name(request.name)
        check_capabilities(request.volume_capabilities)
        if request.HasField("volume_content_source"):
            raise Abort(
                Code.INVALID_ARGUMENT, "pffs cannot create a volume from a snapshot or another volume"
            )
        attributes = parse_attributes(dict(request.parameters), "StorageClass parameters")
        credentials = parse_credentials(dict(request.secrets), "provisioner secret")
        capacity = _capacity(request)
        volume_url = f"{attributes.source}/{name}"
        volume_id = make_volume_id(volume_url, attributes)
        record = {
            "name": name,
            "capacity_bytes": capacity,
            "parameters": attributes.as_context(),
        }
        backend, root = self._backend(volume_url, attributes, credentials)

        def create() -> dict[str, Any] | None:
            existing = _read_marker(backend, root)
            if existing is None:
                backend.make_dir(root)
                backend.write_bytes(f"{root}/{MARKER}", json.dumps(record).encode())
            return existing

        existing = with_deadline(self._pool, create, self.backend_timeout_s, volume_url)
        if existing is not None and (
            existing.get("capacity_bytes") != capacity or existing.get("parameters") != record["parameters"]
        ):
            raise Abort(
                Code.ALREADY_EXISTS,
                f"volume {name} exists at {volume_url} with another capacity or other parameters",
            )
        log.info(
            "%s volume %s at %s (%d bytes)", "found" if existing else "created", name, volume_url, capacity
        )
        return csi_pb2.CreateVolumeResponse(
            volume=csi_pb2.Volume(
                volume_id=volume_id,
                capacity_bytes=capacity,
                volume_context=attributes.as_context(source=volume_url),
            )
        )

    @rpc
    def DeleteVolume(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id")
        parsed = parse_volume_id(request.volume_id)
        if parsed is None:
            log.info("DeleteVolume: %r is not a pffs volume id; nothing to delete", request.volume_id)
            return csi_pb2.DeleteVolumeResponse()
        attributes = parsed
        credentials = parse_credentials(dict(request.secrets), "provisioner secret")
        backend, root = self._backend(attributes.source, attributes, credentials)

        def delete() -> str:
            marker = _read_marker(backend, root)
            if marker is None:
                return "not provisioned by pffs (no marker): nothing deleted"
            if marker.get("parameters", {}).get("onDelete") != "delete":
                return "retained (the StorageClass says onDelete: retain)"
            objects = [info.path for info in backend.find(root) if not info.path.endswith("/" + MARKER)]
            for path in objects:
                backend.remove(path)
            backend.remove(f"{root}/{MARKER}")
            return f"deleted ({len(objects)} objects)"

        outcome = with_deadline(self._pool, delete, self.backend_timeout_s, attributes.source)
        log.info("DeleteVolume %s: %s", attributes.source, outcome)
        return csi_pb2.DeleteVolumeResponse()

    @rpc
    def ValidateVolumeCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        require(request, "volume_id", "volume_capabilities")
        parsed = parse_volume_id(request.volume_id)
        if parsed is None:
            raise Abort(Code.NOT_FOUND, f"{request.volume_id!r} is not a pffs volume")
        credentials = parse_credentials(dict(request.secrets), "controller secret")
        backend, root = self._backend(parsed.source, parsed, credentials)

        def exists() -> bool:
            try:
                return backend.stat(root).is_dir
            except FileNotFoundError:
                return False

        if not with_deadline(self._pool, exists, self.backend_timeout_s, parsed.source):
            raise Abort(Code.NOT_FOUND, f"volume {parsed.source} does not exist")
        for capability in request.volume_capabilities:
            reason = unsupported_reason(capability)
            if reason:
                return csi_pb2.ValidateVolumeCapabilitiesResponse(message=reason)
        confirmed = csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
            volume_context=request.volume_context,
            volume_capabilities=request.volume_capabilities,
            parameters=request.parameters,
        )
        return csi_pb2.ValidateVolumeCapabilitiesResponse(confirmed=confirmed)

    @rpc
    def ControllerGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> Any:
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.ControllerServiceCapability(
                    rpc=ControllerCapability(type=ControllerCapability.CREATE_DELETE_VOLUME)
                )
            ]
        )

    def _backend(
        self, url: str, attributes: VolumeAttributes, credentials: Credentials
    ) -> tuple[Backend, str]:
        return open_backend(url, backend_options(attributes, credentials))


def _read_marker(backend: Backend, root: str) -> dict[str, Any] | None:
    path = f"{root}/{MARKER}"
    try:
        data = backend.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        log.warning("%s is not a pffs volume marker; treating the volume as not provisioned by pffs", path)
        return None
    return record if isinstance(record, dict) else None


def _check_name(name: str) -> str:
    if len(name.encode()) > MAX_NAME:
        raise Abort(Code.INVALID_ARGUMENT, f"name is longer than {MAX_NAME} bytes")
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or any(ord(c) < 0x20 for c in name):
        raise Abort(Code.INVALID_ARGUMENT, f"name {name!r} must be one path component (no '/', '..' or NUL)")
    return name


def _capacity(request: Any) -> int:
    required = request.capacity_range.required_bytes
    limit = request.capacity_range.limit_bytes
    if required < 0 or limit < 0:
        raise Abort(Code.INVALID_ARGUMENT, "capacity_range: bytes cannot be negative")
    if limit and required > limit:
        raise Abort(Code.OUT_OF_RANGE, f"capacity_range: required_bytes {required} > limit_bytes {limit}")
    return int(required or limit)


def make_volume_id(volume_url: str, attributes: VolumeAttributes) -> str:
    where = {"endpointUrl": attributes.endpoint_url, "region": attributes.region}
    given = {k: v for k, v in where.items() if v}
    return f"{volume_url}#{urlencode(given)}" if given else volume_url


def parse_volume_id(volume_id: str) -> VolumeAttributes | None:
    """The volume's URL, endpoint and region from its id; None for an id this driver did not make."""
    url, _, fragment = volume_id.partition("#")
    if url.partition("://")[0].lower() not in SCHEMES:
        return None
    try:
        values = dict(parse_qsl(fragment, strict_parsing=bool(fragment)))
        return parse_attributes({"source": url, **values}, "volume id")
    except (Abort, ValueError):
        return None
