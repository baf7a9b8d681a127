"""Everything about the build is in pyproject.toml, the native core's too ([tool.setuptools-rust]), except
what needs code, before setuptools-rust runs cargo:

- wheels are tagged for CPython's stable ABI from 3.11 on (abi3; pyo3's abi3-py311 feature in
  native/python/Cargo.toml builds the module for it), so one wheel serves every CPython from 3.11 on;
- PFFS_NATIVE_SOURCE, a digest of native/, which the two crates read at compile time (cargo then rebuilds
  them whenever it changes): checkouts that share one cached target folder (scripts/setup.sh) never reuse
  each other's build of different sources, which cargo's own check (file times) would let them do;
- PYO3_PYTHON, the base interpreter rather than each virtualenv's own: pyo3's build script runs again when
  it changes, so every checkout and build environment would otherwise rebuild pyo3.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import setup

NATIVE = Path(__file__).resolve().parent / "native"


def native_source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(NATIVE.rglob("*")):
        relative = path.relative_to(NATIVE)
        if path.is_file() and relative.parts[0] != "target":
            digest.update(f"{relative}\0{path.stat().st_size}\0".encode() + path.read_bytes())
    return digest.hexdigest()


os.environ["PFFS_NATIVE_SOURCE"] = native_source_digest()
os.environ.setdefault("PYO3_PYTHON", getattr(sys, "_base_executable", sys.executable))

setup(options={"bdist_wheel": {"py_limited_api": "cp311"}})
