"""The documentation site builds, its generated reference is whole, and the SDK page's examples run.

`mkdocs build --strict` fails on any warning: a broken link or anchor, a page missing from the nav, a missing
image. The reference pages are made from the code by docs/gen_reference.py during that build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import s3fs

from pffs.cli.main import build_parser
from pffs.testing.s3_server import SeaweedS3

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"
SDK_PAGE = ROOT / "docs/getting-started/sdk.md"

# The names the SDK page's examples use, swapped for the test server's.
ENDPOINT = "http://127.0.0.1:8333"
BUCKET = "datasets"
CACHE_DIR = "/mnt/nvme/pffs"

QUIET = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def commands(parser, prefix: str = "pffs"):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}"
                yield from commands(sub, f"{prefix} {name}")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not MKDOCS.exists():
        pytest.fail("mkdocs is not installed in the virtualenv: pip install -c constraints.txt -e '.[dev]'")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, **QUIET},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.timeout(300)
def test_site_builds_strict_with_generated_reference(site: Path) -> None:
    for page in ("reference/cli", "reference/volume-attributes", "reference/helm-values", "reference/names"):
        assert (site / page / "index.html").is_file(), page
    cli = (site / "reference/cli/index.html").read_text()
    missing = [c for c in commands(build_parser()) if f'id="{c.replace(" ", "-")}"' not in cli]
    assert not missing, f"the CLI reference lacks {missing}"
    assert len(list(commands(build_parser()))) >= 10
    for chart in (ROOT / "bench/results").glob("*.png"):
        assert (site / "assets/bench" / chart.name).is_file(), chart.name
    assert not list((site / "assets/bench").glob("*.json"))  # the charts' data stays in the repository
    assert (site / "changelog/index.html").is_file()  # docs/changelog.md, a link to CHANGELOG.md


@pytest.mark.timeout(300)
def test_reference_names_every_volume_attribute_and_helm_value(site: Path) -> None:
    from pffs.csi.attributes import VolumeAttributes

    attributes = (site / "reference/volume-attributes/index.html").read_text()
    for name, field in VolumeAttributes.model_fields.items():
        assert f"<code>{field.alias or name}</code>" in attributes, name
    values = (site / "reference/helm-values/index.html").read_text()
    for key in ("image.registry", "node.kubeletPath", "cacheGroup.enabled", "warmups.enabled"):
        assert f"<code>{key}</code>" in values, key


def test_the_committed_reference_pages_are_what_the_code_makes_now(tmp_path: Path) -> None:
    """docs/reference/*.md are committed (links to them work in the repository) and made again on each
    build (the site never drifts); a page the code would now make differently is stale in the repository."""
    subprocess.run(
        [sys.executable, str(ROOT / "docs/gen_reference.py"), str(tmp_path)], check=True, timeout=120
    )
    made = {p.name: p.read_text() for p in (tmp_path / "reference").glob("*.md")}
    committed = {p.name: p.read_text() for p in (ROOT / "docs/reference").glob("*.md")}
    stale = sorted(name for name in made.keys() | committed.keys() if made.get(name) != committed.get(name))
    assert not stale, (
        f"docs/reference/{stale} differ from the code's: run `python docs/gen_reference.py --write`"
    )


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_of_the_readme_and_docs_resolves_in_the_repository() -> None:
    """The same links work on the site (`mkdocs build --strict` checks that) and in the repository (here):
    no page, chart or anchor target that exists only in the built site."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # an anchor on the same page, or a URL
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing in the repository:\n" + "\n".join(broken)


# Runs the blocks in one interpreter, in order, as a reader would paste them; a failure names its block.
RUNNER = """
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
scope = {"__name__": "__main__"}
for line, source in blocks:
    try:
        exec(compile(source, f"sdk.md, block at line {line}", "exec"), scope)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the block at line {line} of docs/getting-started/sdk.md failed")
"""


@pytest.mark.s3
@pytest.mark.timeout(300)
def test_sdk_page_examples_run(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str, cache_dir: Path, tmp_path: Path
) -> None:
    blocks = fenced(SDK_PAGE, "python")
    assert len(blocks) >= 3
    raw_s3.pipe(f"{bucket}/imagenet/labels.csv", b"n01440764,tench\nn01443537,goldfish\n" * 100)
    for i in range(4):
        raw_s3.pipe(f"{bucket}/imagenet/train/shard-{i:04d}.tar", bytes([i]) * (700_000 + i * 1000))

    def local(source: str) -> str:
        source = source.replace(ENDPOINT, s3_server.endpoint_url).replace(CACHE_DIR, str(cache_dir))
        return re.sub(rf"s3://{BUCKET}/", f"s3://{bucket}/", source)

    for _, source in blocks:
        assert ENDPOINT in source or "s3://" not in source or f"s3://{BUCKET}/" in source
    data = tmp_path / "blocks.json"
    data.write_text(json.dumps([(line, local(source)) for line, source in blocks]))
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "PFFS_CACHE_DIR": str(cache_dir),
    }
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(data)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert raw_s3.exists(f"{bucket}/runs/exp1/step-1000.pt")


def fenced(page: Path, language: str) -> list[tuple[int, str]]:
    """(line, source) of every ```LANGUAGE block of a Markdown page."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@pytest.mark.kube
@pytest.mark.timeout(300)
def test_kubernetes_page_manifests_pass_a_real_api_servers_dry_run(control_plane: Any) -> None:
    """Every object of the Kubernetes page, as a reader would paste it, is accepted by a real API server
    (server-side dry run: validation and admission, nothing stored); the Helm command's values render."""
    import yaml
    from kubernetes import dynamic

    client = dynamic.DynamicClient(control_plane.api())
    page = ROOT / "docs/getting-started/kubernetes.md"
    objects = [obj for _, source in fenced(page, "yaml") for obj in yaml.safe_load_all(source) if obj]
    assert {o["kind"] for o in objects} >= {
        "PersistentVolume",
        "PersistentVolumeClaim",
        "StorageClass",
        "Pod",
    }
    for obj in objects:
        resource = client.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        namespace = obj["metadata"].get("namespace") if resource.namespaced else None
        resource.create(body=obj, namespace=namespace, query_params=[("dryRun", "All")])
    (_, install), *_ = fenced(page, "sh")
    helm = " ".join(install.replace("\\\n", " ").split("helm install", 1)[1].split("#")[0].split())
    name, chart, *flags = helm.split()
    tools = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")
    done = subprocess.run(
        [str(tools / "helm"), "template", name, str(ROOT / chart), *flags], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "registry.example.com" in done.stdout


@pytest.mark.s3
@pytest.mark.timeout(300)
def test_mount_page_example_runs(
    s3_server: SeaweedS3, raw_s3: s3fs.S3FileSystem, bucket: str, tmp_path: Path
) -> None:
    """The mount page's example, as a reader would paste it: mount, list, stats, unmount (the training
    program and the HDFS line are the reader's own; the HDFS mount is tested in tests/test_hdfs.py)."""
    from pffs.testing.s3_server import free_ports

    (line, source), *_ = fenced(ROOT / "docs/getting-started/mount.md", "sh")
    for i in range(3):
        raw_s3.pipe(f"{bucket}/imagenet/train/n{i:04d}.JPEG", bytes([i]) * 5000)
    mountpoint = tmp_path / "imagenet"
    script = (
        source.replace(ENDPOINT, s3_server.endpoint_url)
        .replace("/mnt/imagenet", str(mountpoint))
        .replace(CACHE_DIR, str(tmp_path / "cache"))
        .replace("--metrics-port 9100", f"--metrics-port {free_ports(1)[0]}")
        .replace(f"s3://{BUCKET}/", f"s3://{bucket}/")
    )
    kept = [
        row for row in script.replace("\\\n", " ").splitlines()
        if row.strip() and not row.startswith(("export AWS_", "python ", "pffs mount hdfs://"))
    ]  # fmt: skip
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", "\n".join(kept)],
            env={**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    assert done.returncode == 0, f"mount.md's block at line {line}:\n{done.stdout}\n{done.stderr}"
    assert "n0000.JPEG" in done.stdout and "backend requests" in done.stdout
    assert not os.path.ismount(mountpoint)
