"""The CSI image built without Docker (pffs.testing.csi_image): the archives' names and settings, the image's
size and what it leaves out, its commands run in a chroot of its unpacked layers, and a throwaway containerd
imports the archives and runs the image's entrypoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import require

from pffs.testing.csi_image import (
    CSI_IMAGE,
    CSI_IMAGE_NEXT,
    PROVISIONER_IMAGE,
    REPO,
    csi_image_archives,
    dockerfile_settings,
    missing_image_tools,
    pffs_entries,
)
from pffs.testing.oci_image import normalized_name

pytestmark = pytest.mark.timeout(1800)  # a cold build of the base takes minutes

MAX_IMAGE_BYTES = 250 * 1000 * 1000
HEAVY = ("pyarrow", "torch", "numpy")


class Archive:
    """An OCI image-layout archive, read: its index, and each manifest's config and layers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar = tarfile.open(path)  # noqa: SIM115 - open for the module's tests, closed with the process
        self.index = self.json("index.json")

    def json(self, name: str) -> Any:
        member = self.tar.extractfile(name)
        assert member is not None
        return json.load(member)

    def blob(self, digest: str) -> Any:
        return self.json("blobs/sha256/" + digest.split(":", 1)[1])

    def names(self) -> dict[str, str]:
        """Image name -> manifest digest."""
        return {m["annotations"]["io.containerd.image.name"]: m["digest"] for m in self.index["manifests"]}

    def manifest(self, name: str) -> Any:
        return self.blob(self.names()[name])

    def config(self, name: str) -> Any:
        return self.blob(self.manifest(name)["config"]["digest"])

    def unpack(self, name: str, root: Path) -> None:
        """The image's layers, lowest first, into `root` (no whiteouts in these images)."""
        for layer in self.manifest(name)["layers"]:
            blob = self.tar.extractfile("blobs/sha256/" + layer["digest"].split(":", 1)[1])
            assert blob is not None
            with tarfile.open(fileobj=blob, mode="r|") as layer_tar:
                layer_tar.extractall(root, numeric_owner=True, filter="fully_trusted")


@pytest.fixture(scope="module")
def archives() -> tuple[Archive, Archive]:
    require(missing_image_tools(), "building the CSI image")
    csi, provisioner = csi_image_archives(log=False)
    return Archive(csi), Archive(provisioner)


@pytest.fixture(scope="module")
def csi_root(archives: tuple[Archive, Archive], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("csi-image") / "root"
    archives[0].unpack(normalized_name(CSI_IMAGE), root)
    return root


def in_image(root: Path, *command: str, env: list[str] | None = None) -> str:
    """`command` run chrooted in `root` with the image's environment; its output."""
    env = env or dockerfile_settings(REPO / "deploy" / "Dockerfile").env
    result = subprocess.run(
        ["chroot", str(root), "/usr/bin/env", "-i", *env, *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{command}: {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_archive_holds_both_tags_of_one_image_with_the_dockerfiles_settings(
    archives: tuple[Archive, Archive],
) -> None:
    csi, provisioner = archives
    names = csi.names()
    # Named as the CRI looks them up (pffs/csi:TAG is docker.io/pffs/csi:TAG to it).
    full, full_next = normalized_name(CSI_IMAGE), normalized_name(CSI_IMAGE_NEXT)
    assert set(names) == {full, full_next}
    assert names[full] == names[full_next]
    config = csi.config(full)["config"]
    assert config["Entrypoint"] == ["/usr/bin/tini", "-s", "--", "pffs"]
    assert config["Cmd"] == ["--help"]
    assert config["Env"][0].startswith("PATH=/opt/pffs/bin:")
    assert "PYTHONDONTWRITEBYTECODE=1" in config["Env"]
    assert list(provisioner.names()) == [PROVISIONER_IMAGE]
    assert provisioner.config(PROVISIONER_IMAGE)["config"]["Entrypoint"] == ["/csi-provisioner"]


def test_the_image_is_at_most_250_MB_without_pyarrow_numpy_or_torch(
    archives: tuple[Archive, Archive],
) -> None:
    csi = archives[0]
    layers = csi.manifest(normalized_name(CSI_IMAGE))["layers"]
    total = sum(layer["size"] for layer in layers)  # uncompressed layers: their sizes are what unpacks
    assert total <= MAX_IMAGE_BYTES, f"the image is {total / 1e6:.1f} MB"
    found: set[str] = set()
    for layer in layers:
        blob = csi.tar.extractfile("blobs/sha256/" + layer["digest"].split(":", 1)[1])
        assert blob is not None
        with tarfile.open(fileobj=blob, mode="r|") as layer_tar:
            for member in layer_tar:
                parts = member.name.split("/")
                if "site-packages" in parts and len(parts) > parts.index("site-packages") + 1:
                    top = parts[parts.index("site-packages") + 1]
                    found |= {heavy for heavy in HEAVY if top in (heavy, f"{heavy}.libs")}
                    assert top not in ("pip", "setuptools"), member.name
    assert not found, f"in the image: {sorted(found)}"


def test_the_commands_run_in_the_image(csi_root: Path) -> None:
    assert in_image(csi_root, "pffs", "--version").strip().endswith("0.1.0")
    assert "--mode" in in_image(csi_root, "pffs", "csi", "--help")
    assert "csi-mounter" in in_image(csi_root, "pffs", "--help")
    in_image(csi_root, "pffs", "csi-mounter", "--help")
    in_image(csi_root, "python3", "-c", "import pyfuse3, grpc, pffs.csi.server, pffs.cli.mount_daemon")
    assert Path(csi_root, "usr/bin/tini").exists() and Path(csi_root, "usr/bin/fusermount3").exists()


def test_the_backends_and_the_kubernetes_client_load_in_the_image(csi_root: Path) -> None:
    """What the node path imports lazily: s3fs with botocore's S3 model (the image keeps only a few of
    botocore's models), hdfs-native, and the kubernetes client; no heavy package gets imported."""
    code = """
import sys
import botocore.session, s3fs, hdfs_native, kubernetes.client, kubernetes.config
import pffs.csi.server, pffs.cli.mount_daemon, pffs.backends.urls
session = botocore.session.get_session()
client = session.create_client(
    "s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s",
    endpoint_url="http://127.0.0.1:9",
)
assert client.meta.service_model.service_name == "s3"
session.create_client("sts", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("pyarrow", "torch")))
"""
    assert in_image(csi_root, "python3", "-c", code).strip() == "[]"


def test_the_image_reads_s3_through_pffs(csi_root: Path, s3_server: Any, raw_s3: Any, bucket: str) -> None:
    """A real read through pffs's cache in the image, from SeaweedFS on loopback (the chroot shares the
    network): s3fs, botocore's S3 model and the cache, all from the image."""
    raw_s3.pipe(f"{bucket}/hello.txt", b"hello from s3\n")
    env = [
        *dockerfile_settings(REPO / "deploy" / "Dockerfile").env,
        f"AWS_ACCESS_KEY_ID={s3_server.access_key}",
        f"AWS_SECRET_ACCESS_KEY={s3_server.secret_key}",
        "AWS_DEFAULT_REGION=us-east-1",
    ]
    command = ["pffs", "--endpoint-url", s3_server.endpoint_url, "--cache-dir", "/tmp/pffs-cache", "cat"]
    assert in_image(csi_root, *command, f"s3://{bucket}/hello.txt", env=env) == "hello from s3\n"


def test_the_pffs_layer_has_every_package_of_pyproject() -> None:
    entries = {entry.path for entry in pffs_entries(REPO, "opt/pffs/lib/python3.11/site-packages")}
    site = "opt/pffs/lib/python3.11/site-packages"
    for module in ("pffs/__init__.py", "pffs/cache/block_cache.py", "pffs/csi/server.py", "pffs/cli/main.py"):
        assert f"{site}/{module}" in entries
    assert f"{site}/pffs-0.1.0.dist-info/entry_points.txt" in entries
    assert "opt/pffs/bin/pffs" in entries
    assert not any("/cache/" in path and "/pffs/cache/" not in path for path in entries)
    assert any(path.startswith(f"{site}/pffs/_core") and path.endswith(".so") for path in entries)


def test_a_checkout_without_its_native_core_makes_no_image(tmp_path: Path) -> None:
    (tmp_path / "pffs").mkdir()
    (tmp_path / "pffs" / "__init__.py").write_text("")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    with pytest.raises(SystemExit, match=r"no built native core .*run `make setup` there first"):
        pffs_entries(tmp_path, "opt/pffs/lib/python3.11/site-packages")


def test_the_provisioner_runs_from_its_image(archives: tuple[Archive, Archive], tmp_path: Path) -> None:
    root = tmp_path / "root"
    archives[1].unpack(PROVISIONER_IMAGE, root)
    result = subprocess.run(
        ["chroot", str(root), "/csi-provisioner", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "csi-provisioner" in result.stdout  # "/csi-provisioner unknown": built without version stamps


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[Path]:
    """A throwaway containerd (no CRI) on a socket of its own: its address."""
    require(
        [tool for tool in ("containerd", "ctr", "runc") if shutil.which(tool) is None], "importing images"
    )
    socket = tmp_path / "containerd.sock"
    config = tmp_path / "containerd.toml"
    q = json.dumps
    config.write_text(
        f"""version = 2
root = {q(str(tmp_path / "root"))}
state = {q(str(tmp_path / "state"))}
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = {q(str(socket))}
[ttrpc]
  address = {q(str(socket) + ".ttrpc")}
[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(tmp_path / "opt"))}
"""
    )
    with (tmp_path / "containerd.log").open("w") as log:
        process = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["ctr", "--address", str(socket), "version"], capture_output=True).returncode:
            assert process.poll() is None, (tmp_path / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "containerd did not answer within 30 s"
            time.sleep(0.2)
        yield socket
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_containerd_imports_the_archives_and_runs_the_entrypoint(
    archives: tuple[Archive, Archive], containerd: Path
) -> None:
    def ctr(*args: str) -> str:
        result = subprocess.run(
            ["ctr", "--address", str(containerd), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"ctr {args}: {result.stderr}"
        return result.stdout

    for archive in archives:
        ctr("images", "import", str(archive.path))
    listed = ctr("images", "list", "--quiet").split()
    assert {CSI_IMAGE, CSI_IMAGE_NEXT, PROVISIONER_IMAGE} <= {
        name.removeprefix("docker.io/") for name in listed
    }
    name = next(n for n in listed if n.endswith(CSI_IMAGE_NEXT))
    # the image's own entrypoint and command: tini -s -- pffs --help
    output = ctr("run", "--rm", "--net-host", name, "pffs-image-test")
    assert "csi" in output
    output = ctr("run", "--rm", "--net-host", name, "pffs-image-test", "pffs", "--version")
    assert output.strip().endswith("0.1.0")
