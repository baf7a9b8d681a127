"""Volume attributes and credentials: what a StorageClass's parameters, a PV's `volumeAttributes` or an
inline volume's attributes may say, checked by one model with unknown keys refused, and how they become a
mount's options.

Kubernetes gives every value as a string; pydantic reads "true", "1000" and "1.5" as the types below.
Keys that Kubernetes itself adds (`csi.storage.k8s.io/...` pod info, the provisioner's identity under
`storage.kubernetes.io/...`) are not ours and are set aside before checking.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError

from pffs.backends.options import BackendOptions
from pffs.config import CacheSettings, Size, settings_error
from pffs.csi.rpc import Abort, Code
from pffs.fuse.options import Mode, MountOptions
from pffs.peers.settings import PeerSettings

SCHEMES = ("s3", "s3a", "hdfs", "webhdfs", "file")
KUBERNETES_PREFIXES = ("csi.storage.k8s.io/", "storage.kubernetes.io/")
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
SECRET_KEYS = {
    "accessKeyId": "access_key_id",
    "secretAccessKey": "secret_access_key",
    "sessionToken": "session_token",
}


def _source_url(value: str) -> str:
    value = value.strip()
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"must be a URL with one of the schemes {', '.join(s + '://' for s in SCHEMES)}")
    if "\0" in value or ".." in rest.split("/"):
        raise ValueError("must not contain '..' or NUL")
    if scheme.lower() in ("s3", "s3a") and not rest.strip("/"):
        raise ValueError("names no bucket (s3://bucket/prefix)")
    if scheme.lower() == "file" and not rest.startswith("/"):
        raise ValueError("must be an absolute path (file:///data/set)")
    return value.rstrip("/") if rest.strip("/") else value


def _http_url(value: str) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("must be an http:// or https:// URL, e.g. http://10.0.0.5:8333")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials (use the volume's secret)")
    return value.strip()


SourceUrl = Annotated[str, AfterValidator(_source_url)]
HttpUrl = Annotated[str, AfterValidator(_http_url)]


class VolumeAttributes(BaseModel):
    """Everything a volume may set. Names as users write them in YAML (camelCase)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)

    source: SourceUrl
    endpoint_url: HttpUrl | None = Field(None, alias="endpointUrl")
    region: str | None = Field(None, alias="region", min_length=1, max_length=64)
    cache_size: Size | None = Field(None, alias="cacheSize")
    memory_cache_size: Size | None = Field(None, alias="memoryCacheSize")
    block_size: Size | None = Field(None, alias="blockSize")
    dir_ttl: float | None = Field(None, alias="dirTTL", ge=0, le=86400)
    attr_ttl: float | None = Field(None, alias="attrTTL", ge=0, le=86400)
    stale_if_error: float | None = Field(None, alias="staleIfError", ge=0, le=30 * 86400)
    backend_timeout: float | None = Field(None, alias="backendTimeout", gt=0, le=3600)
    read_only: bool = Field(False, alias="readOnly")
    prefetch_dirs: bool = Field(True, alias="prefetchDirs")
    # Modes, owners and times stored with each object (chmod, chown, symlinks): off unless asked for, since
    # a pod running as another user than the objects' owner would lose the write access it has with the
    # fixed modes (and a file in a folder where pffs stored attributes costs a HEAD to show).
    posix_metadata: bool = Field(False, alias="posixMetadata")
    uid: int | None = Field(None, alias="uid", ge=0, le=2**32 - 2)
    gid: int | None = Field(None, alias="gid", ge=0, le=2**32 - 2)
    file_mode: Mode | None = Field(None, alias="fileMode")
    dir_mode: Mode | None = Field(None, alias="dirMode")
    on_delete: Literal["retain", "delete"] = Field("retain", alias="onDelete")
    # The node's cache group (csi/cache_group.py): share serves this volume's blocks to the other nodes and
    # reads theirs; consume only reads theirs (an ephemeral job's volume, say).
    cache_group: Literal["off", "share", "consume"] = Field("off", alias="cacheGroup")

    def as_context(self, **changes: Any) -> dict[str, str]:
        """The attributes as a volume context (strings, as Kubernetes keeps them), with `changes` applied."""
        data = self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        data.update({self.model_fields[k].alias or k: v for k, v in changes.items()})
        return {k: _as_string(v) for k, v in sorted(data.items())}


def _as_string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_attributes(values: dict[str, str], what: str) -> VolumeAttributes:
    """The volume's attributes, or INVALID_ARGUMENT naming the bad ones (never their values' secrets: there
    are none among attributes; credentials come only in secrets)."""
    ours = {k: v for k, v in values.items() if not k.startswith(KUBERNETES_PREFIXES)}
    if "source" not in ours:
        raise Abort(Code.INVALID_ARGUMENT, f"{what}: source is required (e.g. source: s3://bucket/prefix)")
    try:
        return VolumeAttributes.model_validate(ours)
    except ValidationError as exc:
        raise Abort(Code.INVALID_ARGUMENT, f"{what}: {_attribute_errors(exc)}") from None


def _attribute_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "value"
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown attribute {where!r} (known: {', '.join(known_attributes())})")
        else:
            parts.append(f"{where}: {str(err.get('msg', '')).removeprefix('Value error, ')}")
    return "; ".join(parts) if parts else settings_error(exc)


def known_attributes() -> list[str]:
    return [f.alias or name for name, f in VolumeAttributes.model_fields.items()]


class Credentials(BaseModel):
    """S3 credentials from a CSI secret (keys accessKeyId, secretAccessKey, sessionToken)."""

    model_config = ConfigDict(frozen=True)

    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None

    @property
    def digest(self) -> str:
        """Tells credentials apart (two inline volumes share a mount only with the same ones) without
        keeping them: a hash, never the values."""
        values = [s.get_secret_value() if s else "" for s in (self.access_key_id, self.secret_access_key)]
        return hashlib.sha256("\0".join(values).encode()).hexdigest()[:16]

    def reveal(self) -> dict[str, str]:
        """For the 0600 file that lets the plugin mount the volume again after a crash."""
        return {
            key: secret.get_secret_value()
            for key, name in SECRET_KEYS.items()
            if (secret := getattr(self, name)) is not None
        }


def parse_credentials(secrets: dict[str, str], what: str) -> Credentials:
    """Credentials from a CSI secret; an unknown key or half a key pair is INVALID_ARGUMENT naming the key
    (never its value)."""
    unknown = sorted(set(secrets) - set(SECRET_KEYS))
    if unknown:
        raise Abort(
            Code.INVALID_ARGUMENT,
            f"{what}: unknown key(s) {', '.join(unknown)} (known: {', '.join(SECRET_KEYS)})",
        )
    values = {SECRET_KEYS[k]: SecretStr(v) for k, v in secrets.items() if v}
    if ("access_key_id" in values) != ("secret_access_key" in values):
        raise Abort(Code.INVALID_ARGUMENT, f"{what}: accessKeyId and secretAccessKey go together")
    return Credentials(**values)


def backend_options(attributes: VolumeAttributes, credentials: Credentials) -> BackendOptions:
    return BackendOptions(
        endpoint_url=attributes.endpoint_url,
        region=attributes.region,
        access_key_id=credentials.access_key_id,
        secret_access_key=credentials.secret_access_key,
        session_token=credentials.session_token,
        **({"backend_timeout": attributes.backend_timeout} if attributes.backend_timeout else {}),
    )


def cache_settings(attributes: VolumeAttributes, node_cache: CacheSettings, cache_dir: Path) -> CacheSettings:
    """The node's cache settings with what the volume may change: its memory tier and block size; its
    own disk cache (`cache_dir`, sized `cacheSize`) only where the caller decided so."""
    update: dict[str, Any] = {"cache_dir": cache_dir}
    if attributes.cache_size is not None:
        update["cache_size"] = attributes.cache_size
    if attributes.memory_cache_size is not None:
        update["memory_cache_size"] = attributes.memory_cache_size
    if attributes.block_size is not None:
        update["block_size"] = attributes.block_size
    if attributes.dir_ttl is not None:
        update["metadata_ttl"] = attributes.dir_ttl
    if attributes.stale_if_error is not None:
        update["stale_if_error"] = attributes.stale_if_error
    try:
        return CacheSettings(**{**node_cache.model_dump(), **update})
    except ValidationError as exc:
        raise Abort(Code.INVALID_ARGUMENT, f"volume attributes: {settings_error(exc)}") from None


def mount_options(
    attributes: VolumeAttributes,
    credentials: Credentials,
    mountpoint: Path,
    cache: CacheSettings,
    read_only: bool,
    log_file: Path,
    verbose: int,
    peers: PeerSettings | None = None,
) -> MountOptions:
    optional = {
        "attr_ttl": attributes.attr_ttl,
        "uid": attributes.uid,
        "gid": attributes.gid,
        "file_mode": attributes.file_mode,
        "dir_mode": attributes.dir_mode,
    }
    return MountOptions(
        source=attributes.source,
        mountpoint=mountpoint,
        cache=cache,
        backend=backend_options(attributes, credentials),
        read_only=read_only or attributes.read_only,
        fixed_modes=not attributes.posix_metadata,
        allow_other=True,  # pods run as any user
        prefetch_dirs=attributes.prefetch_dirs,
        log_file=log_file,
        verbose=verbose,
        peers=peers,
        **{k: v for k, v in optional.items() if v is not None},
    )


def canonical(attributes: VolumeAttributes) -> str:
    """One spelling of the attributes, to compare two requests for the same volume."""
    return json.dumps(attributes.model_dump(mode="json"), sort_keys=True)
