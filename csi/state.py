"""What the node plugin has staged and published, kept in its state dir so a restarted plugin knows which
mounts are its own: `state.json`, written whole to a temporary file, fsync'ed and renamed over the old one
(a crash leaves the old record or the new, never half of one).

Credentials a volume was staged with are kept apart, one 0600 file per volume in a 0700 folder, so a
mount that died can be mounted again with them; they are removed when the volume is unstaged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from pffs.csi.pods import PodRef

log = logging.getLogger(__name__)


class Target(BaseModel):
    """A pod's target path, bind-mounted from a staged volume."""

    volume_id: str
    read_only: bool = False
    pod: PodRef | None = None  # who uses it (from the kubelet's pod info), for Events


class Staged(BaseModel):
    """One pffs mount on this node: a volume staged by the CO, or an inline volume's shared mount."""

    volume_id: str  # for an inline volume, the first pod's; its targets carry their own
    staging_path: str
    attributes: dict[str, str]  # the volume's context, as the CO gave it (no secrets there)
    capability: str  # the access type and mode, to answer a repeated stage of the same volume
    read_only: bool = False
    inline_key: str | None = None  # set for the shared mount of inline volumes
    pid: int | None = None  # the mount process
    peer_port: int | None = None  # where its mount serves the node's cache group (cacheGroup: share)
    targets: dict[str, Target] = Field(default_factory=dict)


class Warmed(BaseModel):
    """What a DatasetWarmup left in this node's cache (for the cache report): measured when it ended, and
    again from its objects (`objects_file`: JSON [[cache id, size], ...]) after the cache evicted."""

    cached_bytes: int
    total_bytes: int
    objects_file: str | None = None


class Records(BaseModel):
    staged: dict[str, Staged] = Field(default_factory=dict)  # by staging path
    warmed: dict[str, Warmed] = Field(default_factory=dict)  # by dataset URL


def path_key(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:24]


class NodeState:
    """The records and their files. Callers hold `lock` while they change and save them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file = directory / "state.json"
        self.secrets_dir = directory / "secrets"
        self.lock = threading.RLock()
        directory.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.secrets_dir, 0o700)
        self.records = self._load()

    def _load(self) -> Records:
        try:
            return Records.model_validate_json(self.file.read_bytes())
        except FileNotFoundError:
            return Records()
        except (ValidationError, ValueError) as exc:
            # Keep the unreadable file for a human; start empty rather than refuse to serve.
            broken = self.file.with_suffix(".broken")
            os.replace(self.file, broken)
            log.error("state file %s is unreadable (%s); moved to %s, starting empty", self.file, exc, broken)
            return Records()

    def save(self) -> None:
        _write_atomically(self.file, self.records.model_dump_json(indent=1).encode(), 0o644)

    def find_target(self, target_path: str) -> Staged | None:
        for staged in self.records.staged.values():
            if target_path in staged.targets:
                return staged
        return None

    def find_inline(self, inline_key: str) -> Staged | None:
        for staged in self.records.staged.values():
            if staged.inline_key == inline_key:
                return staged
        return None

    # Credentials

    def secret_file(self, staging_path: str) -> Path:
        return self.secrets_dir / f"{path_key(staging_path)}.json"

    def keep_secrets(self, staging_path: str, secrets: dict[str, str]) -> None:
        path = self.secret_file(staging_path)
        if secrets:
            _write_atomically(path, json.dumps(secrets).encode(), 0o600)
        else:
            path.unlink(missing_ok=True)

    def read_secrets(self, staging_path: str) -> dict[str, str]:
        try:
            data = json.loads(self.secret_file(staging_path).read_bytes())
        except FileNotFoundError:
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def forget_secrets(self, staging_path: str) -> None:
        self.secret_file(staging_path).unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode is masked by the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
