"""Container images for tests without a registry: an OCI image-layout archive written with the standard
library from Debian's busybox-static (a root filesystem of /bin/busybox and a symlink per applet), ready for
`ctr -n k8s.io images import ARCHIVE` on a node whose pods use `imagePullPolicy: Never`.

    write_test_images(Path("images.tar"))   # pffs.test/busybox:1 and pffs.test/pause:1, one shared layer

`pffs.test/pause:1` is the same root filesystem running `sleep` for ever: containerd's CRI `sandbox_image`.
Everything is written deterministically (fixed times and owners), so the same busybox gives the same digests.

`python -m pffs.testing.oci_image ARCHIVE` writes the archive by hand.

`write_layered_images` writes images of several layers each (tar files on disk, of any size), and
`pack_directory` makes a layer of a root filesystem: pffs.testing.csi_image builds the CSI image with them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSYBOX_IMAGE = "pffs.test/busybox:1"
PAUSE_IMAGE = "pffs.test/pause:1"
# A file of known content in every test image, for pods to read and hash.
TEST_FILE = "/etc/pffs-test-image"
TEST_CONTENT = b"pffs test image: a busybox root filesystem written by pffs.testing.oci_image\n"

MTIME = 1_700_000_000  # fixed, so that the layer's digest depends on busybox alone
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"


@dataclass
class Image:
    name: str  # a full reference: pffs.test/busybox:1
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=lambda: ["/bin/sh"])


def normalized_name(name: str) -> str:
    """The full reference the CRI looks an image up by: `pffs/csi:0.1.0` is docker.io/pffs/csi:0.1.0 to it
    (a first component with no dot, colon or `localhost` is not a registry host), and `busybox` is
    docker.io/library/busybox."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if rest else f"docker.io/library/{name}"


DEFAULT_IMAGES = (
    Image(BUSYBOX_IMAGE),
    Image(PAUSE_IMAGE, entrypoint=["/bin/sleep"], cmd=["2147483647"]),
)


def find_busybox() -> str | None:
    """A statically linked busybox (Debian's busybox-static), or None."""
    for candidate in ("/bin/busybox", shutil.which("busybox")):
        if candidate and Path(candidate).exists() and _is_static(Path(candidate)):
            return candidate
    return None


def _is_static(path: Path) -> bool:
    """A 64-bit ELF file without a PT_INTERP program header (no dynamic loader needed inside the image)."""
    with path.open("rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        order = "<" if head[5] == 1 else ">"
        (phoff,) = struct.unpack_from(order + "Q", head, 32)
        phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    kinds = [struct.unpack_from(order + "I", table, i * phentsize)[0] for i in range(phnum)]
    return 3 not in kinds  # PT_INTERP


def oci_architecture() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}.get(
        machine, machine
    )


def busybox_layer(busybox: str) -> bytes:
    """An uncompressed layer tar: /bin/busybox, a symlink per applet where busybox puts it, /etc/passwd and
    /etc/group for root and nobody, empty /tmp /proc /sys /dev /root /var, and TEST_FILE."""
    applets = subprocess.run(
        [busybox, "--list-full"], check=True, capture_output=True, text=True
    ).stdout.split()
    files: dict[str, bytes] = {
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        "etc/group": b"root:x:0:\nnogroup:x:65534:\n",
        TEST_FILE.lstrip("/"): TEST_CONTENT,
    }
    directories = {"bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "tmp", "proc", "sys", "dev", "root"}
    directories |= {"var", "var/run", "run"}
    for path in [*applets, *files]:
        parent = Path(path).parent
        while str(parent) not in (".", ""):
            directories.add(str(parent))
            parent = parent.parent
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in sorted(directories):
            info = _info(directory, tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755)
            tar.addfile(info)
        data = Path(busybox).read_bytes()
        info = _info("bin/busybox", tarfile.REGTYPE, 0o755)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for name, content in sorted(files.items()):
            info = _info(name, tarfile.REGTYPE, 0o644)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for applet in sorted(set(applets)):
            if applet == "bin/busybox":
                continue
            info = _info(applet, tarfile.SYMTYPE, 0o777)
            info.linkname = "/bin/busybox"
            tar.addfile(info)
    return buffer.getvalue()


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def write_test_images(
    archive: Path, images: tuple[Image, ...] = DEFAULT_IMAGES, busybox: str | None = None
) -> Path:
    """An OCI image-layout tar at `archive` holding `images` (all on the one busybox layer)."""
    busybox = busybox or find_busybox()
    if busybox is None:
        raise FileNotFoundError("a static busybox is needed (apt-get install busybox-static)")
    blobs: dict[str, bytes] = {}

    def blob(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    layer = busybox_layer(busybox)
    layer_descriptor = blob(LAYER_TYPE, layer)  # uncompressed: its digest is also its diff_id
    arch = oci_architecture()
    manifests = []
    for image in images:
        config = {
            "created": "2023-11-14T22:13:20Z",
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": [PATH_ENV],
                "Entrypoint": image.entrypoint,
                "Cmd": image.cmd,
                "WorkingDir": "/",
            },
            "rootfs": {"type": "layers", "diff_ids": [layer_descriptor["digest"]]},
            "history": [{"created": "2023-11-14T22:13:20Z", "created_by": "pffs.testing.oci_image"}],
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": blob(CONFIG_TYPE, _json(config)),
            "layers": [layer_descriptor],
        }
        tag = image.name.rsplit(":", 1)[1] if ":" in image.name.rsplit("/", 1)[-1] else "latest"
        annotations = {"io.containerd.image.name": image.name, "org.opencontainers.image.ref.name": tag}
        manifests.append(
            blob(
                MANIFEST_TYPE,
                _json(manifest),
                annotations=annotations,
                platform={"architecture": arch, "os": "linux"},
            )
        )
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        _add(tar, "index.json", _json(index))
        for digest, data in sorted(blobs.items()):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data)
    return archive


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = _info(name, tarfile.REGTYPE, 0o644)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@dataclass(frozen=True)
class Layer:
    """An uncompressed layer tar in a file: its digest is also its diff_id."""

    path: Path
    digest: str  # sha256:...
    size: int

    @classmethod
    def of_file(cls, path: Path) -> Layer:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return cls(path, "sha256:" + digest.hexdigest(), path.stat().st_size)


@dataclass
class LayeredImage:
    """An image of `layers` (lowest first) known by each of `names` (one manifest, several tags)."""

    names: list[str]
    layers: list[Layer]
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=lambda: [PATH_ENV])
    working_dir: str = "/"


def write_layered_images(archive: Path, images: Sequence[LayeredImage]) -> Path:
    """An OCI image-layout tar at `archive` holding `images`, written to a temporary name and renamed, so a
    reader never finds half an archive. Layers shared by images are stored once."""
    blobs: dict[str, bytes] = {}
    layer_files: dict[str, Layer] = {}

    def blob(media_type: str, data: bytes, **extra: Any) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    arch = oci_architecture()
    manifests = []
    for image in images:
        for layer in image.layers:
            layer_files[layer.digest] = layer
        config = {
            "created": "2023-11-14T22:13:20Z",
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": image.env,
                "Entrypoint": image.entrypoint,
                "Cmd": image.cmd,
                "WorkingDir": image.working_dir,
            },
            "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in image.layers]},
            "history": [
                {"created": "2023-11-14T22:13:20Z", "created_by": "pffs.testing.oci_image"}
                for _ in image.layers
            ],
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": blob(CONFIG_TYPE, _json(config)),
            "layers": [
                {"mediaType": LAYER_TYPE, "digest": layer.digest, "size": layer.size}
                for layer in image.layers
            ],
        }
        manifest_descriptor = blob(MANIFEST_TYPE, _json(manifest))
        for name in image.names:
            tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
            annotations = {
                "io.containerd.image.name": normalized_name(name),
                "org.opencontainers.image.ref.name": tag,
            }
            manifests.append(
                {
                    **manifest_descriptor,
                    "annotations": annotations,
                    "platform": {"architecture": arch, "os": "linux"},
                }
            )
    index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": manifests}
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            _add(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
            _add(tar, "index.json", _json(index))
            for digest in sorted({*blobs, *layer_files}):
                name = "blobs/sha256/" + digest.split(":", 1)[1]
                if digest in blobs:
                    _add(tar, name, blobs[digest])
                    continue
                layer = layer_files[digest]
                info = _info(name, tarfile.REGTYPE, 0o644)
                info.size = layer.size
                with layer.path.open("rb") as f:
                    tar.addfile(info, f)
        partial.rename(archive)
    finally:
        partial.unlink(missing_ok=True)
    return archive


def pack_directory(root: Path, layer: Path, empty: Sequence[str] = ("dev", "proc", "sys")) -> Layer:
    """A layer tar at `layer` of the tree at `root`: entries sorted, owners numeric, times and modes as on
    disk (Debian's .pyc files are checked against their sources' times), hard links kept as links; the
    folders named in `empty` are kept without their content (device nodes belong to the runtime). Sockets and
    FIFOs are left out."""
    seen: dict[tuple[int, int], str] = {}
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory, subdirs, files in os.walk(root):
            relative = os.path.relpath(directory, root)
            if relative in empty:
                subdirs.clear()
                files = []
            subdirs.sort()
            names = sorted(files + [d for d in subdirs if os.path.islink(os.path.join(directory, d))])
            if relative != ".":
                tar.addfile(_stat_info(Path(directory), relative, seen))
            for name in names:
                path = Path(directory, name)
                info = _stat_info(path, os.path.join(relative, name) if relative != "." else name, seen)
                if info.isreg():
                    with path.open("rb") as f:
                        tar.addfile(info, f)
                elif info.type in (tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE):
                    tar.addfile(info)
            subdirs[:] = [d for d in subdirs if not os.path.islink(os.path.join(directory, d))]
    return Layer.of_file(layer)


def _stat_info(path: Path, name: str, seen: dict[tuple[int, int], str]) -> tarfile.TarInfo:
    st = path.lstat()
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in seen:
            info.type = tarfile.LNKTYPE
            info.linkname = seen[key]
        else:
            seen[key] = name
            info.type = tarfile.REGTYPE
            info.size = st.st_size
    else:
        info.type = tarfile.FIFOTYPE  # left out by the caller: not a regular file, folder or link
    return info


def main() -> None:
    archive = Path(sys.argv[1] if len(sys.argv) > 1 else "pffs-test-images.tar")
    write_test_images(archive)
    print(f"{archive}: {', '.join(image.name for image in DEFAULT_IMAGES)}")


if __name__ == "__main__":
    main()
