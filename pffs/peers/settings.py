"""How a process joins a cache group: its members, where it serves, the shared token."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})$")


def split_address(address: str) -> tuple[str, int]:
    """("10.0.0.7", 9830) from "10.0.0.7:9830" (an IPv6 host without its brackets)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_address(value: str) -> str:
    found = ADDRESS.match(value.strip())
    if found is None or not 0 < int(found.group(2)) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 10.0.0.7:9830)")
    return value.strip()


class PeerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    members: tuple[str, ...] = Field(
        (), description="HOST:PORT of every member that serves blocks (this one too, if it does)"
    )
    members_file: Path | None = Field(
        None,
        description="a file of members, one HOST:PORT per line, read again when it changes (what the CSI "
        "node plugin writes from the Nodes it watches); its members join `members`",
    )
    listen: str | None = Field(
        None,
        description="HOST:PORT this process serves on, as it appears in `members`; None: it only reads "
        "from the group (--no-share)",
    )
    token: SecretStr | None = Field(None, description="the group's shared token")
    token_file: Path | None = Field(None, description="a file holding the group's shared token")
    timeout_s: float = Field(2.0, gt=0, le=60, description="seconds a member may take to answer")
    tls_dir: Path | None = Field(
        None,
        description="a folder holding ca.crt, tls.crt and tls.key (a Kubernetes TLS Secret's files): "
        "members then talk TLS and each must show a certificate the CA signed",
    )

    @field_validator("members", mode="before")
    @classmethod
    def _listed(cls, value: object) -> object:
        """ "a:1,b:2" (the command line's and the SDK's form) or a list."""
        return [m for m in value.split(",") if m.strip()] if isinstance(value, str) else value

    @field_validator("members")
    @classmethod
    def _addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(check_address(v) for v in value))

    @field_validator("listen")
    @classmethod
    def _listen_address(cls, value: str | None) -> str | None:
        return None if value is None else check_address(value)

    @model_validator(mode="after")
    def _consistent(self) -> PeerSettings:
        if not self.members and self.members_file is None:
            raise ValueError("name the group's members (members, or a members_file that lists them)")
        if (self.token is None) == (self.token_file is None):
            raise ValueError("give the group's token either inline (token) or in a file (token_file)")
        if self.listen is not None and self.members_file is None and self.listen not in self.members:
            raise ValueError(f"listen address {self.listen} is not one of the members {list(self.members)}")
        return self

    def token_bytes(self) -> bytes:
        """The token (read from its file each time it is asked for: once, when the group starts)."""
        if self.token is not None:
            raw = self.token.get_secret_value()
        else:
            assert self.token_file is not None
            try:
                raw = self.token_file.read_text()
            except OSError as exc:
                raise ValueError(
                    f"cannot read the peer token file {self.token_file}: {exc.strerror}"
                ) from None
        token = raw.strip().encode()
        if len(token) < 16:
            raise ValueError("the peer token must be at least 16 characters (e.g. `openssl rand -hex 32`)")
        return token


def read_members_file(path: Path) -> tuple[str, ...]:
    """The members a file lists (one HOST:PORT per line; blank lines and # comments skipped).

    Raises OSError when it cannot be read and ValueError naming the first line that is not an address."""
    members = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.partition("#")[0].strip()
        if line:
            try:
                members.append(check_address(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return tuple(members)
