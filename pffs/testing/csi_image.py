"""The CSI image, pffs/csi:0.1.0, built without Docker: OCI image-layout archives for
`ctr -n k8s.io images import`, from the same recipe as deploy/Dockerfile.

    archives = csi_image_archives()   # [pffs/csi:0.1.0 and :0.1.0-next, csi-provisioner:v6.3.0]

Two layers:
- the base: a Debian bookworm root filesystem from `mmdebstrap`, in which deploy/image/install.sh installs
  the runtime packages and the virtualenv /opt/pffs with the node plugin's dependencies. It takes minutes, so
  it is kept in ~/.cache/pffs-tools/images/base-HASH/ (HASH: the recipe files and constraints.txt) and
  reused while they are unchanged; it is built in a temporary folder and renamed when complete.
- pffs: this checkout's pffs package laid out in the virtualenv as `pip install --no-deps .` would (cache/
  and csi/ as pffs.cache and pffs.csi, per pyproject.toml), with the `pffs` command: rebuilt on every call
  in a second, so tests run the code under test. deploy/Dockerfile lays it out with the same function
  (`python -m pffs.testing.csi_image install-pffs SOURCE ROOT`).

The image's Entrypoint, Cmd and Env are read from deploy/Dockerfile, so the two cannot differ.
The csi-provisioner image is scripts/build_csi_provisioner.sh's binary with the C library it links to.

`scripts/build_image.sh` (this module's main) builds them by hand; `missing_image_tools()` names what is
missing to build them here.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pffs.testing.oci_image import MTIME, Layer, LayeredImage, pack_directory, write_layered_images

CSI_IMAGE = "pffs/csi:0.1.0"
ARCHIVE_FORMAT = 2  # 2: names in the index as the CRI looks them up (oci_image.normalized_name)
# The same image under a second tag: tests roll the plugin over to it to play an upgrade to a new tag.
CSI_IMAGE_NEXT = "pffs/csi:0.1.0-next"
PROVISIONER_VERSION = "v6.3.0"  # scripts/build_csi_provisioner.sh
PROVISIONER_IMAGE = f"registry.k8s.io/sig-storage/csi-provisioner:{PROVISIONER_VERSION}"

REPO = Path(__file__).resolve().parents[2]
RECIPE_FILES = ("packages.txt", "build-packages.txt", "requirements.txt", "install.sh", "dpkg-nodoc.cfg")
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# Part of the base's cache key: change it when the way the base is made here changes.
BASE_FORMAT = "1"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
VENV = "opt/pffs"


def tools_dir() -> Path:
    return Path(os.environ.get("PFFS_TOOLS_DIR", Path.home() / ".cache" / "pffs-tools"))


def images_dir() -> Path:
    return tools_dir() / "images"


def provisioner_binary() -> Path:
    return Path(os.environ.get("PFFS_TOOLS_BIN", tools_dir() / "bin")) / "csi-provisioner"


def missing_image_tools() -> list[str]:
    """What is missing here to build the images, each with how to get it; empty when nothing is."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (mmdebstrap builds the root filesystem as root, and tests chroot into it)")
    if shutil.which("mmdebstrap") is None:
        missing.append("mmdebstrap (apt-get install mmdebstrap, or scripts/setup.sh)")
    if not provisioner_binary().exists():
        missing.append(f"{provisioner_binary()} (scripts/build_csi_provisioner.sh)")
    return missing


# -- the base layer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """A built base: its layer, and where its virtualenv's site-packages are (relative to /)."""

    layer: Layer
    site_packages: str  # opt/pffs/lib/python3.11/site-packages


def recipe_hash(repo: Path = REPO) -> str:
    """The base's cache key: the recipe files, constraints.txt, the suite and mirrors, BASE_FORMAT."""
    digest = hashlib.sha256()
    digest.update(f"{BASE_FORMAT}\n{SUITE}\n{MIRRORS}\n".encode())
    for path in [*(repo / "deploy" / "image" / name for name in RECIPE_FILES), repo / "constraints.txt"]:
        data = path.read_bytes()
        digest.update(f"{path.name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def base_image(repo: Path = REPO, log: bool = True) -> Base:
    """The base for this recipe: reused from the cache, or built (one builder at a time; a second waits and
    then finds it). A build that fails or is interrupted leaves nothing that counts as built."""
    directory = images_dir() / f"base-{recipe_hash(repo)}"
    if (found := _load_base(directory)) is not None:
        return found
    images_dir().mkdir(parents=True, exist_ok=True)
    with _locked(images_dir() / ".base.lock"):
        if (found := _load_base(directory)) is not None:
            return found
        _build_base(repo, directory, log)
        for old in images_dir().glob("base-*"):  # earlier recipes' bases: 230 MB each
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)
    loaded = _load_base(directory)
    assert loaded is not None
    return loaded


def _load_base(directory: Path) -> Base | None:
    try:
        meta = json.loads((directory / "base.json").read_text())
    except FileNotFoundError:
        return None
    layer = Layer(directory / "layer.tar", meta["digest"], meta["size"])
    return Base(layer, meta["site_packages"])


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build_base(repo: Path, directory: Path, log: bool) -> None:
    work = directory.with_name(f".{directory.name}.{os.getpid()}.partial")
    shutil.rmtree(work, ignore_errors=True)
    for stale in directory.parent.glob(f".{directory.name}.*.partial"):  # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    try:
        started = time.monotonic()
        recipe = work / "pffs-image"
        recipe.mkdir(parents=True)
        for name in RECIPE_FILES:
            shutil.copy2(repo / "deploy" / "image" / name, recipe / name)
        shutil.copy2(repo / "constraints.txt", recipe / "constraints.txt")
        # pip in the root trusts what this machine trusts (egress may pass a proxy with its own CA).
        shutil.copy2(HOST_CA_BUNDLE, recipe / "host-ca.crt")
        root = work / "root"
        root.mkdir()
        if log:
            print(
                f"csi_image: building the base {directory.name} with mmdebstrap (minutes, once)", flush=True
            )
        env = " ".join(
            f"{key}={value}"
            for key, value in os.environ.items()
            if key.lower() in ("http_proxy", "https_proxy", "no_proxy")
        )
        install = (
            'chroot "$1" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root '
            f"PIP_CERT=/tmp/pffs-image/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 {env} "
            "bash /tmp/pffs-image/install.sh /tmp/pffs-image"
        )
        command = [
            "mmdebstrap",
            "--mode=root",
            "--variant=minbase",
            "--quiet",
            # merged /usr made by mmdebstrap itself, not by Debian's usrmerge package (which brings perl)
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
            f"--dpkgopt={recipe / 'dpkg-nodoc.cfg'}",
            f"--customize-hook=copy-in {recipe} /tmp",
            f"--customize-hook={install}",
            '--customize-hook=rm -rf "$1/tmp/pffs-image"',
            SUITE,
            str(root),
            *MIRRORS,
        ]
        subprocess.run(command, check=True, stdout=None if log else subprocess.DEVNULL)
        site = sorted(root.glob(f"{VENV}/lib/python3*/site-packages"))
        if len(site) != 1:
            raise RuntimeError(f"the base has no single virtualenv at /{VENV}: {site}")
        layer = pack_directory(root, work / "layer.tar")
        shutil.rmtree(root)
        shutil.rmtree(recipe)
        meta = {
            "digest": layer.digest,
            "size": layer.size,
            "site_packages": str(site[0].relative_to(root)),
            "recipe": directory.name,
            "seconds": round(time.monotonic() - started),
        }
        (work / "base.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.rename(work, directory)
        if log:
            print(f"csi_image: base {directory.name} built in {meta['seconds']} s, {layer.size >> 20} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the pffs layer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    path: str  # relative to /
    data: bytes | None  # None: a folder
    mode: int


def pffs_entries(source: Path, site_packages: str) -> list[Entry]:
    """pffs from `source` (a checkout) as `pip install --no-deps` puts it in the virtualenv: its packages'
    modules, per pyproject.toml's package-dir, a dist-info with the entry points, and its commands."""
    project = tomllib.loads((source / "pyproject.toml").read_text())
    setup = project["tool"]["setuptools"]
    package_dir: dict[str, str] = setup.get("package-dir", {})
    meta = project["project"]
    name, version = meta["name"], meta["version"]
    venv = "/" + site_packages.split("/lib/", 1)[0]
    files: dict[str, tuple[bytes, int]] = {}
    if not any((source / "pffs").glob("_core*.so")):
        # Never an image without its data plane: it would start, then fail at the first mount.
        raise SystemExit(
            f"{source} has no built native core (pffs/_core*.so): run `make setup` there first (it builds "
            "native/ with cargo), then build the image"
        )
    for package in setup["packages"]:
        folder = _package_folder(source, package, package_dir)
        target = f"{site_packages}/{package.replace('.', '/')}"
        # *.so: the native core (pffs._core) as this checkout built it (scripts/setup.sh)
        for module in sorted([*folder.glob("*.py"), *folder.glob("*.so")]):
            files[f"{target}/{module.name}"] = (module.read_bytes(), 0o644)
    dist_info = f"{site_packages}/{name}-{version}.dist-info"
    entry_points = {"console_scripts": meta.get("scripts", {}), **meta.get("entry-points", {})}
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        0o644,
    )
    files[f"{dist_info}/entry_points.txt"] = (
        "".join(
            f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
            for group, points in entry_points.items()
        ).encode(),
        0o644,
    )
    files[f"{dist_info}/INSTALLER"] = (b"pffs.testing.csi_image\n", 0o644)
    files[f"{dist_info}/top_level.txt"] = (b"pffs\n", 0o644)
    for command, target in meta.get("scripts", {}).items():
        module, function = target.split(":")
        script = (
            f"#!{venv}/bin/python\nimport sys\nfrom {module} import {function}\n\n"
            f'if __name__ == "__main__":\n    sys.argv[0] = {command!r}\n    sys.exit({function}())\n'
        )
        files[f"{VENV}/bin/{command}"] = (script.encode(), 0o755)
    record = "".join(
        f"{_relative(path, site_packages)},{_record_hash(data)},{len(data)}\n"
        for path, (data, _) in sorted(files.items())
    )
    record += f"{_relative(dist_info, site_packages)}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = (record.encode(), 0o644)
    folders = {str(parent) for path in files for parent in Path(path).parents if str(parent) != "."}
    return [Entry(folder, None, 0o755) for folder in sorted(folders)] + [
        Entry(path, data, mode) for path, (data, mode) in sorted(files.items())
    ]


def _package_folder(source: Path, package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools finds `package`: the longest package-dir prefix of it, the rest as folders."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in package_dir:
            return source.joinpath(package_dir[prefix], *parts[i:])
    return source.joinpath(*parts)


def _relative(path: str, site_packages: str) -> str:
    return os.path.relpath("/" + path, "/" + site_packages)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pffs_layer(source: Path, site_packages: str, layer: Path) -> Layer:
    """The pffs layer tar at `layer`: deterministic (fixed times and owners), so unchanged code gives the
    same digest."""
    with tarfile.open(layer, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in pffs_entries(source, site_packages):
            info = tarfile.TarInfo(entry.path)
            info.mode, info.mtime = entry.mode, MTIME
            if entry.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
    return Layer.of_file(layer)


def install_pffs(source: Path, root: Path) -> None:
    """Lays pffs from `source` out in the virtualenv under `root` (deploy/Dockerfile's last step)."""
    site = sorted(root.glob(f"{VENV}/lib/python3*/site-packages"))
    if len(site) != 1:
        raise SystemExit(f"no single virtualenv at {root / VENV}")
    for entry in pffs_entries(source, str(site[0].relative_to(root))):
        path = root / entry.path
        if entry.data is None:
            path.mkdir(mode=entry.mode, exist_ok=True)
        else:
            path.write_bytes(entry.data)
            path.chmod(entry.mode)


# -- the image's settings, from deploy/Dockerfile -----------------------------------------------------------


@dataclass(frozen=True)
class ImageSettings:
    entrypoint: list[str]
    cmd: list[str]
    env: list[str]


def dockerfile_settings(dockerfile: Path) -> ImageSettings:
    """ENTRYPOINT and CMD (JSON form) and ENV (KEY=VALUE pairs, no quotes) of the Dockerfile's last stage."""
    logical: list[str] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = {}
    for instruction in logical:
        keyword, _, rest = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            entrypoint, cmd, env = [], [], {}
        elif keyword in ("ENTRYPOINT", "CMD"):
            value = json.loads(rest)
            if keyword == "ENTRYPOINT":
                entrypoint = value
            else:
                cmd = value
        elif keyword == "ENV":
            for pair in rest.split():
                key, sep, value = pair.partition("=")
                if not sep or '"' in value or "'" in value or "$" in value:
                    raise ValueError(f"{dockerfile}: ENV {pair!r}: use KEY=VALUE without quotes or $")
                env[key] = value
    return ImageSettings(entrypoint, cmd, [f"{key}={value}" for key, value in env.items()])


# -- the archives -----------------------------------------------------------------------------------------


def csi_image_archives(out_dir: Path | None = None, repo: Path = REPO, log: bool = True) -> list[Path]:
    """[the pffs/csi archive (CSI_IMAGE and CSI_IMAGE_NEXT), the csi-provisioner archive], built now (the
    base from the cache when the recipe is unchanged). Each archive is written under a temporary name and
    renamed; one whose content is already there is reused."""
    out_dir = out_dir or images_dir() / "archives"
    out_dir.mkdir(parents=True, exist_ok=True)
    base = base_image(repo, log)
    work = out_dir / f".work-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        pffs = pffs_layer(repo, base.site_packages, work / "pffs-layer.tar")
        settings = dockerfile_settings(repo / "deploy" / "Dockerfile")
        # Named by everything in it: the layers, and the config and names the index carries.
        config = hashlib.sha256(repr((settings, CSI_IMAGE, CSI_IMAGE_NEXT, ARCHIVE_FORMAT)).encode())
        csi = out_dir / f"pffs-csi-{base.layer.digest[7:19]}-{pffs.digest[7:19]}-{config.hexdigest()[:8]}.tar"
        if not csi.exists():
            image = LayeredImage(
                [CSI_IMAGE, CSI_IMAGE_NEXT],
                [base.layer, pffs],
                entrypoint=settings.entrypoint,
                cmd=settings.cmd,
                env=settings.env,
            )
            write_layered_images(csi, [image])
        provisioner = provisioner_archive(out_dir, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for old in out_dir.glob("*.tar"):  # others' archives, once nobody can still be importing them
        if old not in (csi, provisioner) and time.time() - old.stat().st_mtime > 3600:
            old.unlink(missing_ok=True)
    return [csi, provisioner]


def provisioner_archive(out_dir: Path, work: Path) -> Path:
    """csi-provisioner's image: its binary (without debug information) as /csi-provisioner, the shared
    libraries it links to where they are on this machine, /tmp, and the CA bundle."""
    binary = provisioner_binary()
    if not binary.exists():
        raise FileNotFoundError(f"{binary}: run scripts/build_csi_provisioner.sh")
    stripped = work / "csi-provisioner"
    shutil.copy2(binary, stripped)
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-debug", str(stripped)], check=True)
    files = {"csi-provisioner": (stripped, 0o755)}
    for library in _linked_libraries(binary):
        files[library.lstrip("/")] = (Path(os.path.realpath(library)), 0o755)
    if HOST_CA_BUNDLE.exists():
        files["etc/ssl/certs/ca-certificates.crt"] = (HOST_CA_BUNDLE, 0o644)
    layer_path = work / "provisioner-layer.tar"
    with tarfile.open(layer_path, "w", format=tarfile.PAX_FORMAT) as tar:
        folders = {str(p) for name in files for p in Path(name).parents if str(p) != "."} | {"tmp"}
        for folder in sorted(folders):
            info = tarfile.TarInfo(folder)
            info.type, info.mtime = tarfile.DIRTYPE, MTIME
            info.mode = 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
        for name, (path, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.mode, info.mtime, info.size = mode, MTIME, path.stat().st_size
            with path.open("rb") as f:
                tar.addfile(info, f)
    layer = Layer.of_file(layer_path)
    archive = out_dir / f"csi-provisioner-{PROVISIONER_VERSION}-{layer.digest[7:19]}.tar"
    if not archive.exists():
        image = LayeredImage([PROVISIONER_IMAGE], [layer], entrypoint=["/csi-provisioner"], cmd=[])
        write_layered_images(archive, [image])
    return archive


def _linked_libraries(binary: Path) -> list[str]:
    """The absolute paths of the shared libraries `ldd` lists for `binary` (none for a static one)."""
    result = subprocess.run(["ldd", str(binary)], capture_output=True, text=True)
    paths = []
    for line in result.stdout.splitlines():
        words = line.replace("=>", " ").split()
        paths += [word for word in words if word.startswith("/")]
    return sorted(set(paths))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="build_image.sh", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    build = commands.add_parser("build", help="the archives (default); prints their paths")
    build.add_argument("--out-dir", type=Path, help="where the archives go (default: the cache folder)")
    commands.add_parser("base", help="only the cached base (scripts/setup.sh)")
    install = commands.add_parser("install-pffs", help="lay pffs out in ROOT's /opt/pffs (deploy/Dockerfile)")
    install.add_argument("source", type=Path)
    install.add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.command == "install-pffs":
        install_pffs(args.source, args.root)
        return
    missing = missing_image_tools()
    if args.command == "base":
        missing = [tool for tool in missing if "csi-provisioner" not in tool]
    if missing:
        sys.exit("build_image.sh: missing: " + "; ".join(missing))
    if args.command == "base":
        base_image()  # says so when it builds one
        return
    for archive in csi_image_archives(getattr(args, "out_dir", None)):
        print(archive)


if __name__ == "__main__":
    main()
