"""The queues of `pffs scheduler`, from a YAML file (``--queues FILE``).

```yaml
queues:
  - name: research               # pods join it with the label pffs.io/queue: research
    weight: 2                    # share of the cluster relative to the other queues
    guaranteed: {cpu: "32", memory: 128Gi, nvidia.com/gpu: 8}   # never reclaimed from it
    capability: {cpu: "128", memory: 512Gi, nvidia.com/gpu: 32} # the ceiling (absent: unlimited)
    overcommit: false            # true: admit past capability, such groups are evicted first
    reclaimable: true            # others may take back what it uses above guaranteed
weights: {binpack: 0, fragmentation: 1, topology: 1, tor: 1, locality: 1}   # optional; these are the defaults
```

Amounts are Kubernetes quantities ("4", "500m", "16Gi", "1e3"); a number works too. A bare list of queues
(without ``queues:``) is accepted. With no file, one queue ``default`` without limits. Pods without the label
go to the queue ``default``: a file that leaves it out leaves those pods pending, which the logs say.
Any mistake is one `QueuesConfigError` naming the file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pffs.scheduler.core.objects import MILLI, UNLIMITED, Queue, Resources
from pffs.scheduler.kube.json_fields import BadObject
from pffs.scheduler.kube.quantity import parse_quantity

DEFAULT_QUEUE = "default"
RESOURCE_KEYS = ("cpu", "memory", "nvidia.com/gpu")


class QueuesConfigError(ValueError):
    """The queues file cannot be used: the message names the file and the field."""


class _Amounts(BaseModel):
    model_config = ConfigDict(extra="forbid")  # by alias only: "gpu" is a typo, not a resource

    cpu: str | None = None
    memory: str | None = None
    gpu: str | None = Field(default=None, alias="nvidia.com/gpu")

    @field_validator("cpu", "memory", "gpu", mode="before")
    @classmethod
    def _quantity(cls, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError("must be a Kubernetes quantity such as 4, 500m or 16Gi")
        try:
            if parse_quantity(str(value)) < 0:
                raise ValueError("must not be negative")
        except BadObject as exc:
            raise ValueError(str(exc)) from None
        return str(value)

    def resources(self, absent: Resources) -> Resources:
        """The amounts in core units; a resource left out takes its value from ``absent``."""

        def convert(raw: str | None, scale: float, default: int) -> int:
            return default if raw is None else math.floor(parse_quantity(raw) * scale)

        return Resources(
            convert(self.cpu, MILLI, absent.cpu_milli),
            convert(self.memory, 1 / 2**20, absent.memory_mib),
            convert(self.gpu, MILLI, absent.gpu_milli),
        )


class _QueueSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    weight: int = Field(default=1, ge=1)
    guaranteed: _Amounts = _Amounts()
    capability: _Amounts | None = None
    overcommit: bool = False
    reclaimable: bool = True


class _Weights(BaseModel):
    model_config = ConfigDict(extra="forbid")

    binpack: float = Field(default=0.0, ge=0)  # off: see ``session.Weights``
    fragmentation: float = Field(default=1.0, ge=0)
    topology: float = Field(default=1.0, ge=0)
    tor: float = Field(default=1.0, ge=0)
    locality: float = Field(default=1.0, ge=0)


class _QueuesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queues: list[_QueueSpec] = Field(min_length=1)
    weights: _Weights | None = None


def default_queues() -> list[Queue]:
    return [Queue(DEFAULT_QUEUE)]


def parse_queues(data: Any, source: str = "queues") -> tuple[list[Queue], dict[str, float] | None]:
    """Queues and optional scoring weights (keyword arguments of ``session.Weights``) from parsed YAML."""
    if isinstance(data, list):
        data = {"queues": data}
    if not isinstance(data, dict):
        raise QueuesConfigError(
            f"{source}: expected a mapping with a 'queues' list, got {type(data).__name__}"
        )
    try:
        parsed = _QueuesFile.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in error["loc"]).replace(".[", "[")
        value = "" if error["type"] == "missing" else f" (got {error.get('input')!r})"
        raise QueuesConfigError(f"{source}: {where or 'top level'}: {error['msg']}{value}") from None
    names = [q.name for q in parsed.queues]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise QueuesConfigError(f"{source}: queue {twice[0]!r} is defined twice")
    queues = []
    for i, spec in enumerate(parsed.queues):
        guaranteed = spec.guaranteed.resources(Resources())
        capability = spec.capability.resources(UNLIMITED) if spec.capability else UNLIMITED
        if not guaranteed.fits_within(capability):
            raise QueuesConfigError(
                f"{source}: queues[{i}] ({spec.name}): guaranteed is more than capability"
            )
        queues.append(
            Queue(spec.name, spec.weight, guaranteed, capability, spec.overcommit, spec.reclaimable)
        )
    weights = parsed.weights.model_dump() if parsed.weights else None
    return queues, weights


def load_queues(path: Path | None) -> tuple[list[Queue], dict[str, float] | None]:
    """Queues (and scoring weights) from a YAML file; no file: the one ``default`` queue."""
    if path is None:
        return default_queues(), None
    try:
        text = path.read_text()
    except OSError as exc:
        raise QueuesConfigError(f"{path}: cannot read the queues file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise QueuesConfigError(f"{path}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    return parse_queues(data, str(path))
