"""Backend options: where the data is and how to sign in. Credentials are SecretStr so they never print."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class BackendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://127.0.0.1:8333")
    region: str | None = None
    anonymous: bool = False
    # Explicit credentials are for programs (the SDK, the CSI plugin); the command line takes them only from
    # the standard AWS environment variables, a profile, or a credentials file.
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    profile: str | None = None
    credentials_file: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    # The deadline of every backend call, retries included (pffs.backends.deadline): --backend-timeout.
    backend_timeout: float = Field(
        30.0, gt=0, description="seconds a backend call may take, retries included"
    )
    max_connections: int = 64
    # Block fetches through pffs's own S3 client (pffs.backends.s3_native) rather than botocore's: the
    # same requests for a fraction of the CPU. Off when `extra` options could change how requests go.
    native_s3_gets: bool = True
    # Where a mount keeps POSIX attributes, a listed file is HEADed for them only in folders that carry
    # the marker pffs writes beside attributes it stores (pffs.backends.backend.ATTRIBUTES_MARKER); with
    # this, in every folder, as s3fs-fuse does (for buckets s3fs-fuse wrote): --head-every-file.
    head_every_file: bool = False
    # Passed through untouched to fsspec for non-S3 backends (hdfs host/port, webhdfs user, ...).
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("endpoint_url")
    @classmethod
    def _an_http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{value!r} is not an http:// or https:// URL, e.g. http://{value.split('://')[-1]}"
            )
        return value
