"""A DatasetWarmup from apply to 100%, against `pffs warmup` on the same data.

    .venv/bin/python bench/warmups.py                       # 256 MiB file + 400 x 256 KiB, 2 repeats
    .venv/bin/python bench/warmups.py --large-size 64M --small-count 100 --repeats 1

One local SeaweedFS, a real API server (etcd + kube-apiserver, this project's fixtures) with the
DatasetWarmup CRD, the controller (`pffs csi --mode controller --warmups`) and one node plugin
(`pffs csi --mode node --warmups`) standing in for a node. Each repeat, on a fresh cache: the time from
creating the DatasetWarmup to its status saying Succeeded (what `kubectl wait` would see), then
`pffs warmup` of the same prefix into another fresh cache, with the same 8 workers. Writes
bench/results/warmups.json and warmups.png (--out-dir) and prints a table; every block is checked by
sha256 afterwards through a filesystem over each cache, with no request to S3.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MB = 1_000_000
BUCKET = "warmup-bench"
G, V, P = "pffs.io", "v1alpha1", "datasetwarmups"


def log(message: str) -> None:
    print(f"[warmups {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def verify(cache_dir: Path, s3: Any, digests: dict[str, str]) -> bool:
    import fsspec

    fs = fsspec.filesystem(
        "pffs", target=f"s3://{BUCKET}/ds", cache_dir=str(cache_dir), skip_instance_cache=True,
        **s3.storage_options(),
    )  # fmt: skip
    exact = all(hashlib.sha256(fs.cat(name)).hexdigest() == digest for name, digest in digests.items())
    return exact and int(fs.vfs.backend.requests.snapshot()["get"]["requests"]) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large-size", type=size_arg, default=256 << 20)
    parser.add_argument("--small-count", type=int, default=400)
    parser.add_argument("--small-size", type=size_arg, default=256 << 10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()

    import s3fs
    from kubernetes import client

    from pffs.testing.csi_plugin import CsiPlugin
    from pffs.testing.kube_cluster import KubeControlPlane
    from pffs.testing.s3_server import SeaweedS3

    started = time.time()
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pffs-warmups-")))
        s3 = stack.enter_context(SeaweedS3(tmp / "s3"))
        raw = s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options())
        raw.mkdir(BUCKET)
        files = {"ds/large.bin": os.urandom(args.large_size)}
        files |= {f"ds/small/{i:05d}.bin": os.urandom(args.small_size) for i in range(args.small_count)}
        raw.pipe({f"{BUCKET}/{name}": data for name, data in files.items()})
        digests = {name.removeprefix("ds/"): hashlib.sha256(data).hexdigest() for name, data in files.items()}
        total = sum(len(d) for d in files.values())
        del files
        control = stack.enter_context(KubeControlPlane(tmp / "kube", start_scheduler=False))
        api = control.api()
        crd = REPO / "deploy" / "helm" / "pffs-csi" / "crds" / "datasetwarmups.pffs.io.yaml"
        client.ApiextensionsV1Api(api).create_custom_resource_definition(yaml.safe_load(crd.read_text()))
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        core.create_namespace({"metadata": {"name": "pffs-system"}})
        core.create_namespaced_secret(
            "pffs-system",
            {
                "metadata": {"name": "s3"},
                "stringData": {"accessKeyId": s3.access_key, "secretAccessKey": s3.secret_key},
            },
        )
        core.create_node({"metadata": {"name": "node-0"}})
        kube = ["--kubeconfig", str(control.kubeconfig), "--warmups", "--namespace", "pffs-system"]
        (tmp / "controller").mkdir()
        stack.enter_context(CsiPlugin(tmp / "controller", *kube, node_id="controller", mode="controller"))
        for repeat in range(args.repeats):
            (tmp / f"node-{repeat}").mkdir()
            cache = tmp / f"node-{repeat}" / "cache"
            plugin = CsiPlugin(
                tmp / f"node-{repeat}",
                *kube,
                "--cache-size",
                "4G",
                node_id="node-0",
                mode="node",
                cache_dir=cache,
            )
            with plugin:
                name = f"bench-{repeat}"
                body = {
                    "apiVersion": f"{G}/{V}",
                    "kind": "DatasetWarmup",
                    "metadata": {"name": name},
                    "spec": {
                        "source": f"s3://{BUCKET}/ds",
                        "endpointUrl": s3.endpoint_url,
                        "secretName": "s3",
                        "nodes": {"names": ["node-0"]},
                    },
                }
                applied = time.perf_counter()
                custom.create_namespaced_custom_object(G, V, "default", P, body)
                while True:
                    status = custom.get_namespaced_custom_object(G, V, "default", P, name).get("status") or {}
                    if status.get("phase") in ("Succeeded", "Failed"):
                        break
                    if time.perf_counter() - applied > 600:
                        raise TimeoutError("the warm-up did not end within 10 minutes")
                    time.sleep(0.05)
                crd_s = time.perf_counter() - applied
            crd_ok = status["phase"] == "Succeeded" and verify(cache, s3, digests)
            cli_cache = tmp / f"cli-{repeat}"
            env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
            began = time.perf_counter()
            answer = subprocess.run(
                [sys.executable, "-m", "pffs.cli.main", "--endpoint-url", s3.endpoint_url, "--cache-dir",
                 str(cli_cache), "--cache-size", "4G", "warmup", f"s3://{BUCKET}/ds", "--workers", "8",
                 "--json"],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            cli_s = time.perf_counter() - began
            cli_ok = answer.returncode == 0 and verify(cli_cache, s3, digests)
            row = {
                "repeat": repeat,
                "datasetwarmup_seconds": round(crd_s, 2),
                "pffs_warmup_seconds": round(cli_s, 2),
                "datasetwarmup_mb_s": round(total / MB / crd_s, 1),
                "pffs_warmup_mb_s": round(total / MB / cli_s, 1),
                "ratio": round(crd_s / cli_s, 2),
                "verified": crd_ok and cli_ok,
            }
            rows.append(row)
            log(json.dumps(row))
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(cli_cache, ignore_errors=True)
    report = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "total_seconds": round(time.time() - started, 1),
        "nproc": os.cpu_count(),
        "dataset_bytes": total,
        "files": len(digests),
        "runs": rows,
        "verified": all(r["verified"] for r in rows),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warmups.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, out / "warmups.png")
    print(f"\n{'repeat':>6} {'DatasetWarmup s':>15} {'pffs warmup s':>13} {'ratio':>6} {'verified':>8}")
    for r in rows:
        print(
            f"{r['repeat']:>6} {r['datasetwarmup_seconds']:>15} {r['pffs_warmup_seconds']:>13} "
            f"{r['ratio']:>6} {r['verified']!s:>8}"
        )
    print(f"dataset: {total / MB:.0f} MB in {len(digests)} files; wrote {out / 'warmups.json'}")
    return 0 if report["verified"] else 1


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar(
        [x - 0.18 for x in xs], [r["datasetwarmup_seconds"] for r in rows], width=0.35, label="DatasetWarmup"
    )
    ax.bar([x + 0.18 for x in xs], [r["pffs_warmup_seconds"] for r in rows], width=0.35, label="pffs warmup")
    ax.set_xticks(list(xs), [f"repeat {r['repeat']}" for r in rows])
    ax.set_ylabel("seconds, apply to 100%")
    ax.set_title("warming one node's cache, cold", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
