"""Volume capabilities: pffs volumes are file systems (access type mount) in any access mode. A block
request, or one without a mode, is the caller's mistake."""

from __future__ import annotations

from collections.abc import Iterable

from pffs.csi import csi_pb2
from pffs.csi.rpc import Abort, Code

AccessMode = csi_pb2.VolumeCapability.AccessMode
READ_ONLY_MODES = (AccessMode.SINGLE_NODE_READER_ONLY, AccessMode.MULTI_NODE_READER_ONLY)


def unsupported_reason(capability: csi_pb2.VolumeCapability) -> str | None:
    """Why pffs cannot serve this capability, or None if it can."""
    if capability.HasField("block"):
        return "block volumes are not supported: a pffs volume is a file system (use volumeMode Filesystem)"
    if not capability.HasField("mount"):
        return "volume_capability.access_type is required (mount)"
    if capability.access_mode.mode == AccessMode.UNKNOWN:
        return "volume_capability.access_mode is required"
    return None


def check_capability(capability: csi_pb2.VolumeCapability) -> tuple[str, bool]:
    """(a key telling capabilities apart, whether the mode is read-only), or INVALID_ARGUMENT."""
    reason = unsupported_reason(capability)
    if reason:
        raise Abort(Code.INVALID_ARGUMENT, reason)
    mode = capability.access_mode.mode
    return f"mount:{AccessMode.Mode.Name(mode)}", mode in READ_ONLY_MODES


def check_capabilities(capabilities: Iterable[csi_pb2.VolumeCapability]) -> None:
    for capability in capabilities:
        check_capability(capability)
