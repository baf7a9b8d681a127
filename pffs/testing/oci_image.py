"""Container images for tests without a registry: an OCI image-layout archive written with the standard
library from Debian's busybox-static (a root filesystem of /bin/busybox and a symlink per applet), ready for
`ctr -n k8s.io images import ARCHIVE` on a node whose pods use `imagePullPolicy: Never`.

    write_test_images(Path("images.tar"))   # pffs.test/busybox:1 and pffs.test/pause:1, one shared layer

`pffs.test/pause:1` is the same root filesystem running `sleep` for ever: containerd's CRI `sandbox_image`.
Everything is written deterministically (fixed times and owners), so the same busybox gives the same digests.

`python -m pffs.testing.oci_image ARCHIVE` writes the archive by hand.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import shutil
import struct
import subprocess
import sys
import tarfile
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


def main() -> None:
    archive = Path(sys.argv[1] if len(sys.argv) > 1 else "pffs-test-images.tar")
    write_test_images(archive)
    print(f"{archive}: {', '.join(image.name for image in DEFAULT_IMAGES)}")


if __name__ == "__main__":
    main()
