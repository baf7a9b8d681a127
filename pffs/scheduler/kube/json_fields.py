"""Reading plain Kubernetes JSON (dicts, as the API server sends them) with checks: a field of the wrong shape
is one ``BadObject`` naming the field, never a KeyError or TypeError deep in the translation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class BadObject(ValueError):
    """A Kubernetes object that is not shaped as the API defines it."""


def json_object(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` as a JSON object ({} for null), or BadObject naming ``what``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadObject(f"{what} must be an object, not {type(value).__name__}")
    return value


def json_list(value: Any, what: str) -> list[Any]:
    """``value`` as a JSON list ([] for null), or BadObject naming ``what``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadObject(f"{what} must be a list, not {type(value).__name__}")
    return value


def str_map(value: Any, what: str) -> dict[str, str]:
    """``value`` as a JSON object of strings ({} for null), or BadObject naming ``what``."""
    mapping = json_object(value, what)
    for k, v in mapping.items():
        if not isinstance(v, str):
            raise BadObject(f"{what}[{k!r}] must be a string, not {type(v).__name__}")
    return dict(mapping)


def object_key(obj: Mapping[str, Any], kind: str) -> str:
    """'namespace/name' (or 'name' for a cluster-scoped object), or BadObject."""
    metadata = json_object(obj.get("metadata"), f"{kind}.metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise BadObject(f"a {kind} has no metadata.name")
    namespace = metadata.get("namespace")
    if kind == "Node":
        return name
    if not isinstance(namespace, str) or not namespace:
        raise BadObject(f"{kind} {name} has no metadata.namespace")
    return f"{namespace}/{name}"


def name_of(obj: Any) -> str:
    """An object's metadata.name for a message, even from a malformed object."""
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    return name if isinstance(name, str) else "(no name)"
