"""A real Kubernetes node on loopback, for tests: Debian's containerd (its own configuration, root, state and
socket in a folder of the caller's) and kubelet v1.37.2 registered as a Node of a `KubeControlPlane`, with
the registry-less test images of `pffs.testing.oci_image` imported; everything stopped and removed after.

    with NodeControlPlane(tmp_path / "cp", node_names=["node-1"]) as cluster:
        with KubeNode(tmp_path / "node", cluster, "node-1") as node:
            ...  # pods with hostNetwork: true, image pffs.test/busybox:1, imagePullPolicy: Never

What this machine needs, and how the node is set up for it:
- no CNI plugins: pods run with `hostNetwork: true`; the CRI still wants one network configuration before it
  reports its network ready (else the Node stays NotReady: "cni plugin not initialized"), so a conflist
  naming a plugin that does not exist is written; only a pod without hostNetwork would call it (and fail);
- root lacks CAP_SYS_RESOURCE: containerd's CRI runs with `restrict_oom_score_adj` (else every sandbox fails
  with "can't get final child's PID from pipe"), and the kubelet keeps `oomScoreAdj: 0`;
- cgroup v1 with the cgroupfs driver (`failCgroupV1: false`, `cgroupDriver: cgroupfs`, SystemdCgroup off);
- no registry: the test images are imported with `ctr images import`; the CRI's sandbox ("pause") image is
  `pffs.test/pause:1`, busybox running sleep;
- the kubelet listens on 127.0.0.1 only, and refuses a loopback `--node-ip`: it runs with
  `--cloud-provider external`, and this fixture, as the cloud provider, gives the Node its one address,
  InternalIP 127.0.0.1 (no Hostname address, which the API server would prefer and fail to resolve), so
  that logs, exec and port-forward through the API server reach it.

The kubelet signs in as `system:node:NAME` (group system:nodes, through the Node authorizer) when the control
plane is a `NodeControlPlane` that has a token for NAME; with a plain `KubeControlPlane` it uses the admin
kubeconfig. Hostpath mounts with `mountPropagation: Bidirectional` need their host folder under
`node.kubelet_root` (the kubelet makes its root folder a shared mount; the rest of the machine is private).

Outside its folder the node touches only what a kubelet or containerd cannot be told to leave alone, and
puts back or removes each on exit: /var/lib/kubelet/device-plugins (a fixed path of the kubelet),
/var/log/containers (symlinks to container logs), /run/containerd/s (containerd's shim sockets), the
`kubepods` cgroups of every hierarchy, and six kernel settings the kubelet sets (vm.overcommit_memory,
vm.panic_on_oom, kernel.panic, kernel.panic_on_oops, kernel.keys.root_maxkeys/root_maxbytes). The fixed
paths make it one node per machine at a time: a lock file (/run/lock/pffs-kube-node.lock) serializes them.
On exit the node deletes its pods (at once), its Node and its Lease from the API too. What a killed
(SIGKILL) test process leaves behind is not cleaned up by the next KubeNode.

`python -m pffs.testing.kube_node DIR` runs a control plane and one node by hand, until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pffs.testing.kube_cluster import KubeControlPlane, kube_bin_dir, missing_binaries
from pffs.testing.oci_image import BUSYBOX_IMAGE, PAUSE_IMAGE, find_busybox, write_test_images
from pffs.testing.s3_server import free_ports

NODE_IMAGES = (BUSYBOX_IMAGE, PAUSE_IMAGE)
HOST_BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_NAMES = ("kubepods", "k8s.io")  # the kubelet's (cgroupfs driver), and containerd's default parent
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
CONTAINER_LOGS = Path("/var/log/containers")
SHIM_SOCKETS = Path("/run/containerd/s")
LOCK_FILE = Path("/run/lock/pffs-kube-node.lock")
KERNEL_SETTINGS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
LIFTED_TAINTS = (
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.cloudprovider.kubernetes.io/uninitialized",
)
T = TypeVar("T")


def missing_node_binaries() -> list[str]:
    """What a KubeNode needs besides a control plane and this machine lacks (empty when it can run)."""
    missing = [
        f"{name} (apt-get install containerd runc)" for name in HOST_BINARIES if not shutil.which(name)
    ]
    if not (kube_bin_dir() / "kubelet").exists():
        missing.append("kubelet (scripts/build_kube.sh)")
    if find_busybox() is None:
        missing.append("a static busybox (apt-get install busybox-static)")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


class NodeControlPlane(KubeControlPlane):
    """KubeControlPlane with a node identity for real kubelets: a token per node name in tokens.csv (read
    by the API server at its start), signing in as `system:node:NAME` in group `system:nodes`, so that the
    Node authorizer (not the admin's system:masters) decides what each kubelet may do."""

    def __init__(self, workdir: Path, node_names: Iterable[str] = ("pffs-node",), **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.node_tokens = {name: os.urandom(16).hex() for name in node_names}

    def _make_keys(self) -> None:
        super()._make_keys()
        with open(self.workdir / "tokens.csv", "a") as tokens:
            for name, token in self.node_tokens.items():
                tokens.write(f'{token},system:node:{name},system:node:{name},"system:nodes"\n')

    def node_kubeconfig(self, node_name: str, path: Path) -> Path:
        return self.kubeconfig_for_token(path, self.node_tokens[node_name], f"system:node:{node_name}")


class KubeNode:
    def __init__(
        self,
        workdir: Path,
        control_plane: KubeControlPlane,
        node_name: str = "pffs-node",
        labels: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        lock_timeout_s: float = 300.0,
        log_level: int = 2,
    ) -> None:
        self.workdir = workdir.resolve()
        self.control_plane = control_plane
        self.node_name = node_name
        self.labels = labels or {}
        self.ready_timeout_s = ready_timeout_s
        self.lock_timeout_s = lock_timeout_s
        self.log_level = log_level
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.kubelet_port, self.healthz_port = free_ports(2)
        self.containerd_root = self.workdir / "containerd" / "root"
        self.containerd_state = self.workdir / "containerd" / "state"
        self.runc_root = self.workdir / "containerd" / "runc"
        self.kubelet_root = self.workdir / "kubelet"
        self.pod_logs = self.workdir / "pod-logs"
        self.run_dir = self.workdir / "run"  # sockets (elsewhere if this path is too long for one)
        self._own_run_dir: Path | None = None
        self._lock: int | None = None
        self._created: list[Path] = []  # outside workdir, removed at stop (deepest last in the list)
        self._cgroups_before: set[Path] = set()
        self._kernel_before: dict[str, str] = {}
        self._container_logs_mode: int | None = None
        self._started = False

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int = 4000) -> str:
        """The end of the kubelet's and containerd's logs, for failure messages."""
        return "\n".join(
            f"--- {name}.log (end) ---\n{self.log(name)[-tail:]}" for name in ("containerd", "kubelet")
        )

    def ctr(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        """`ctr` on this node's containerd, in the CRI's namespace k8s.io."""
        result = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def api(self) -> Any:
        return self.control_plane.api()

    # Start and stop

    def start(self) -> KubeNode:
        missing = missing_node_binaries()
        if missing:
            raise FileNotFoundError(f"a KubeNode needs {', '.join(missing)}")
        self._take_lock()
        self._started = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        for folder in (self.containerd_root, self.containerd_state, self.kubelet_root, self.pod_logs):
            folder.mkdir(parents=True, exist_ok=True)
        self._choose_run_dir()
        self._remember_host()
        self._start_containerd()
        self._import_images()
        self._start_kubelet()
        self._wait_node_ready()
        return self

    def stop(self) -> None:
        """Stops the kubelet, containers and containerd, and removes what the node made outside workdir and
        every mount under it. Safe to call more than once, and after a failed start."""
        if not self._started:
            return
        errors: list[str] = []

        def attempt(what: str, step: Callable[[], object]) -> None:
            try:
                step()
            except Exception as exc:  # go on: later steps clean up what this one left
                errors.append(f"{what}: {exc!r}")

        attempt("delete this node's pods", self._delete_pods)
        attempt("stop the kubelet", lambda: self._stop_process("kubelet", timeout_s=20))
        attempt("remove containers", self._remove_containers)
        attempt("stop containerd", lambda: self._stop_process("containerd", timeout_s=20))
        attempt("kill leftover processes", self._kill_leftovers)
        attempt("unmount", self._unmount_all)
        attempt("remove cgroups", self._remove_cgroups)
        attempt("restore the host", self._restore_host)
        attempt("delete the Node", self._delete_node)
        self._started = False
        self._release_lock()
        if errors:
            print(f"KubeNode {self.node_name}: cleanup problems: {'; '.join(errors)}", file=sys.stderr)

    def __enter__(self) -> KubeNode:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # What is left (empty after stop)

    def leftover_processes(self) -> list[str]:
        """Processes of this node still running: ours by pid, anything naming our socket or folders (shims
        name the socket, runc its root), and whatever is in the cgroups this node made; never the control
        plane's, nor this process."""
        pids = {p.pid for p in self.processes.values() if p.poll() is None}
        markers = [str(self.socket), str(self.runc_root), str(self.kubelet_root), str(self.containerd_root)]
        for pid, cmdline in _processes():
            if any(marker in cmdline for marker in markers):
                pids.add(pid)
        for cgroup in self._our_cgroups():
            pids |= _cgroup_pids(cgroup)
        pids -= {os.getpid()} | {p.pid for p in self.control_plane.processes.values()}
        return [f"{pid}: {_cmdline(pid)}" for pid in sorted(pids) if _cmdline(pid) is not None]

    def leftover_mounts(self) -> list[str]:
        roots = [self.workdir, self.run_dir]
        return [str(point) for point in _mount_points() if any(_is_under(point, root) for root in roots)]

    def leftover_paths(self) -> list[str]:
        """What this node made outside its folder and has not removed (cgroups, device-plugins...)."""
        left = [str(path) for path in self._created if path.exists() or path.is_symlink()]
        left += [str(cgroup) for cgroup in self._our_cgroups()]
        left += [str(link) for link in self._our_log_links()]
        return left

    # Pieces

    def _take_lock(self) -> None:
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise TimeoutError(f"another KubeNode holds {LOCK_FILE}") from None
                time.sleep(0.5)
        self._lock = fd

    def _release_lock(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None

    def _choose_run_dir(self) -> None:
        # A unix socket path has at most 107 bytes; containerd adds ".ttrpc" to its own.
        if len(str(self.socket)) + len(".ttrpc") > 100:
            self._own_run_dir = Path(tempfile.mkdtemp(prefix="pffs-node-", dir="/run"))
            self.run_dir = self._own_run_dir
            (self.workdir / "run").unlink(missing_ok=True)
            (self.workdir / "run").symlink_to(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _remember_host(self) -> None:
        """What exists before the node starts, so that stop removes only what it made."""
        for path in (
            Path("/var/lib/kubelet"),
            DEVICE_PLUGINS,
            CONTAINER_LOGS,
            SHIM_SOCKETS.parent,
            SHIM_SOCKETS,
        ):
            if not path.exists():
                self._created.append(path)
        if CONTAINER_LOGS.exists():
            self._container_logs_mode = CONTAINER_LOGS.stat().st_mode & 0o7777
        self._cgroups_before = set(_cgroups(CGROUP_NAMES))
        for key in KERNEL_SETTINGS:
            with contextlib.suppress(OSError):
                self._kernel_before[key] = (Path("/proc/sys") / key).read_text().strip()

    def _start_containerd(self) -> None:
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        # Only for the CRI to report its network ready: hostNetwork pods never call a CNI plugin.
        (cni_conf / "10-pffs-host-only.conflist").write_text(
            json.dumps({"cniVersion": "0.4.0", "name": "pffs-host-only", "plugins": [{"type": "pffs-none"}]})
        )
        config = self.workdir / "containerd.toml"
        q = json.dumps  # a TOML basic string is a JSON string for paths
        config.write_text(
            f"""version = 2
root = {q(str(self.containerd_root))}
state = {q(str(self.containerd_state))}
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = {q(str(self.socket))}

[ttrpc]
  address = {q(str(self.socket) + ".ttrpc")}

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(self.workdir / "containerd" / "opt"))}

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {q(PAUSE_IMAGE)}
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = {q(str(self.runc_root))}

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {q(str(self.workdir / "cni" / "bin"))}
    conf_dir = {q(str(cni_conf))}
"""
        )
        self._run("containerd", ["containerd", "--config", str(config)])
        self._wait("containerd to answer", self._containerd_answers)

    def _containerd_answers(self) -> bool:
        if not self.socket.exists():
            return False
        result = subprocess.run(
            ["ctr", "--address", str(self.socket), "version"], capture_output=True, timeout=10
        )
        return result.returncode == 0

    def _import_images(self) -> None:
        archive = write_test_images(self.workdir / "images" / "pffs-test-images.tar")
        self.ctr("images", "import", str(archive), timeout=120)
        names = set(self.ctr("images", "ls", "--quiet").split())
        missing = [name for name in NODE_IMAGES if name not in names]
        if missing:
            raise RuntimeError(f"images not imported: {missing} (have {sorted(names)})")

    def _start_kubelet(self) -> None:
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\noptions ndots:1\n")
        kubeconfig = self.workdir / "kubelet.kubeconfig"
        if (
            isinstance(self.control_plane, NodeControlPlane)
            and self.node_name in self.control_plane.node_tokens
        ):
            self.control_plane.node_kubeconfig(self.node_name, kubeconfig)
        else:
            shutil.copyfile(self.control_plane.kubeconfig, kubeconfig)  # admin: no Node authorizer
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": True,
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "containerRuntimeEndpoint": self.endpoint,
            "imageServiceEndpoint": self.endpoint,
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            # The API server calls the kubelet (logs, exec) without a client certificate: anonymous, on
            # loopback only.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "registerNode": True,
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "podLogsDir": str(self.pod_logs),
            "resolvConf": str(resolv),
            "oomScoreAdj": 0,  # lowering it needs CAP_SYS_RESOURCE
            "hairpinMode": "none",
            "localStorageCapacityIsolation": False,
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "4s",
            "nodeLeaseDurationSeconds": 10,  # renewed every 2.5 s
            "syncFrequency": "10s",
            "serializeImagePulls": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
        }
        config_file = self.workdir / "kubelet-config.json"
        config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
        args = [
            str(kube_bin_dir() / "kubelet"),
            "--config",
            str(config_file),
            "--kubeconfig",
            str(kubeconfig),
            "--root-dir",
            str(self.kubelet_root),
            "--cert-dir",
            str(self.kubelet_root / "pki"),
            "--hostname-override",
            self.node_name,
            "--cloud-provider",
            "external",  # the node's address is this fixture's to set
            f"--v={self.log_level}",
        ]
        if self.labels:
            args += ["--node-labels", ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))]
        self._run("kubelet", args)

    def _wait_node_ready(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self.api())

        def node() -> Any:
            try:
                return core.read_node(self.node_name)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        self._wait(f"the kubelet to register Node {self.node_name}", node, self.ready_timeout_s)
        # As the cloud provider: the only address is 127.0.0.1, where the kubelet listens (the kubelet
        # refuses a loopback --node-ip, and the API server would otherwise call it by its Hostname).
        self._wait(f"the address of {self.node_name}", lambda: self._set_address(core), 30)

        def ready() -> Any:
            found = node()
            conditions = {c.type: c for c in ((found.status.conditions or []) if found else [])}
            return found if "Ready" in conditions and conditions["Ready"].status == "True" else None

        try:
            self._wait(f"Node {self.node_name} to be Ready", ready, self.ready_timeout_s)
        except TimeoutError as exc:
            found = node()
            conditions = [
                f"{c.type}={c.status} ({c.message})"
                for c in ((found.status.conditions or []) if found else [])
            ]
            raise TimeoutError(f"{exc}\nNode conditions: {'; '.join(conditions)}") from None
        # The API server taints a new Node not-ready, the kubelet taints it uninitialized for the cloud
        # provider; no node lifecycle controller or cloud controller runs here to lift them.
        self._wait(f"the taints of {self.node_name} to go", lambda: self._untaint(core), 30)

    def _set_address(self, core: Any) -> bool:
        addresses = [{"type": "InternalIP", "address": "127.0.0.1"}]
        found = core.read_node(self.node_name)
        current = [{"type": a.type, "address": a.address} for a in (found.status.addresses or [])]
        if current == addresses:
            return True
        core.patch_node_status(
            self.node_name, [{"op": "add", "path": "/status/addresses", "value": addresses}]
        )
        return False

    def _untaint(self, core: Any) -> bool:
        from kubernetes.client.exceptions import ApiException

        node = core.read_node(self.node_name)
        taints = [t for t in (node.spec.taints or []) if t.key not in LIFTED_TAINTS]
        if len(taints) == len(node.spec.taints or []):
            return True
        body = {
            "metadata": {"resourceVersion": node.metadata.resource_version},
            "spec": {
                "taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in taints] or None
            },
        }
        try:
            core.patch_node(self.node_name, body)
        except ApiException as exc:
            if exc.status != 409:  # the kubelet updated the Node meanwhile: read it again
                raise
        return False

    def _wait(self, what: str, check: Callable[[], T | None], timeout_s: float = 30.0) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"waiting for {what}: {name} exited with {process.returncode}\n{self.logs()}"
                    )
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what}: not within {timeout_s:.0f} s\n{self.logs()}")
            time.sleep(0.25)

    def _run(self, name: str, args: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            # Its own session: a Ctrl-C in a terminal reaches the test, whose stop() ends these in order.
            self.processes[name] = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.workdir,
                start_new_session=True,
            )

    def _stop_process(self, name: str, timeout_s: float) -> None:
        process = self.processes.get(name)
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def _delete_pods(self) -> None:
        """Pods bound to this node are deleted at once, and the kubelet (if running) stops their
        containers through the CRI, which also unmounts their volumes and sandboxes; bounded wait."""
        kubelet = self.processes.get("kubelet")
        if kubelet is None or not self.control_plane.processes:  # no kubelet, or no API server any more
            return
        from kubernetes import client

        core = client.CoreV1Api(self.api())
        pods: list[Any] = core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}"
        ).items
        for pod in pods:
            with contextlib.suppress(Exception):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        if kubelet.poll() is not None or self.processes["containerd"].poll() is not None:
            return
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self._running_tasks():
            time.sleep(0.25)

    def _running_tasks(self) -> list[str]:
        lines = self.ctr("tasks", "ls", timeout=10).splitlines()[1:]
        return [line.split()[0] for line in lines if line.split() and line.split()[-1] == "RUNNING"]

    def _remove_containers(self) -> None:
        """Whatever the kubelet left to containerd: tasks killed and deleted, containers removed."""
        containerd = self.processes.get("containerd")
        if containerd is None or containerd.poll() is not None:
            return
        for line in self.ctr("tasks", "ls", timeout=10).splitlines()[1:]:
            if line.split():
                self.ctr("tasks", "kill", "--signal", "SIGKILL", line.split()[0], timeout=10, check=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._running_tasks():
            time.sleep(0.2)
        for line in self.ctr("tasks", "ls", timeout=10).splitlines()[1:]:
            if line.split():
                self.ctr("tasks", "delete", "--force", line.split()[0], timeout=20, check=False)
        for container in self.ctr("containers", "ls", "--quiet", timeout=10).split():
            self.ctr("containers", "delete", container, timeout=20, check=False)

    def _kill_leftovers(self) -> None:
        """Shims and container processes of this node that outlived containerd (SIGKILL)."""
        for attempt in range(20):
            pids = [int(line.split(":", 1)[0]) for line in self.leftover_processes()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1 * (attempt + 1))

    def _unmount_all(self) -> None:
        """Every mount under workdir and the socket folder, the deepest (latest) first: the kubelet makes
        its root folder a shared bind mount of itself, and sandboxes have their own /dev/shm there."""
        for _attempt in range(5):
            points = self.leftover_mounts()
            if not points:
                return
            for point in reversed(points):
                result = subprocess.run(["umount", point], capture_output=True)
                if result.returncode != 0:
                    subprocess.run(["umount", "-l", point], capture_output=True)
        if self.leftover_mounts():
            raise RuntimeError(f"still mounted: {self.leftover_mounts()}")

    def _our_cgroups(self) -> list[Path]:
        return sorted(set(_cgroups(CGROUP_NAMES)) - self._cgroups_before)

    def _remove_cgroups(self) -> None:
        for _attempt in range(20):
            left = self._our_cgroups()
            if not left:
                return
            for top in left:
                for pid in _cgroup_pids(top):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for folder, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
            time.sleep(0.1)
        if self._our_cgroups():
            raise RuntimeError(f"cgroups left: {self._our_cgroups()}")

    def _our_log_links(self) -> list[Path]:
        if not CONTAINER_LOGS.is_dir():
            return []
        links = []
        for link in CONTAINER_LOGS.iterdir():
            if link.is_symlink() and _is_under(Path(os.readlink(link)), self.pod_logs):
                links.append(link)
        return links

    def _restore_host(self) -> None:
        for link in self._our_log_links():
            link.unlink(missing_ok=True)
        if DEVICE_PLUGINS in self._created:
            shutil.rmtree(DEVICE_PLUGINS, ignore_errors=True)
        if SHIM_SOCKETS in self._created and SHIM_SOCKETS.is_dir():
            for entry in SHIM_SOCKETS.iterdir():  # sockets of shims that are gone (ours: none run now)
                with contextlib.suppress(OSError):
                    if entry.is_socket():
                        entry.unlink()
        for path in sorted(self._created, key=lambda p: -len(p.parts)):  # the folders it made, if empty
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.rmdir()
                except OSError as exc:
                    if exc.errno != errno.ENOTEMPTY:
                        raise
        if self._container_logs_mode is not None and CONTAINER_LOGS.is_dir():
            os.chmod(CONTAINER_LOGS, self._container_logs_mode)
        for key, value in self._kernel_before.items():
            path = Path("/proc/sys") / key
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value + "\n")
        if self._own_run_dir is not None:
            shutil.rmtree(self._own_run_dir, ignore_errors=True)

    def _delete_node(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        if not self.control_plane.processes:  # the control plane is already down
            return
        api = self.api()
        deletes = (
            lambda: client.CoreV1Api(api).delete_node(self.node_name),
            # else a node of the same name started soon after adopts the Lease, which the garbage
            # collector then deletes for its owner, the Node deleted here
            lambda: client.CoordinationV1Api(api).delete_namespaced_lease(self.node_name, "kube-node-lease"),
        )
        for delete in deletes:
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    raise


# The host's state


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmdline = _cmdline(int(entry))
            if cmdline is not None:
                found.append((int(entry), cmdline))
    return found


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or f"[{_comm(pid)}]"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _cgroups(names: Iterable[str]) -> list[Path]:
    """`/sys/fs/cgroup/<hierarchy>/<name>` folders that exist (cgroup v1), or `/sys/fs/cgroup/<name>`."""
    found: list[Path] = []
    if not CGROUP_ROOT.is_dir():
        return found
    tops = [CGROUP_ROOT] + [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()]
    for top in tops:
        for name in names:
            if (top / name / "cgroup.procs").exists():
                found.append(top / name)
    return found


def _cgroup_pids(top: Path) -> set[int]:
    pids: set[int] = set()
    for folder, _dirs, files in os.walk(top):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids |= {int(p) for p in Path(folder, "cgroup.procs").read_text().split()}
    return pids


def _mount_points() -> list[Path]:
    points = []
    with open("/proc/self/mountinfo", "rb") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            points.append(Path(_unescape(fields[4])))
    return points


def _unescape(raw: bytes) -> str:
    """mountinfo's octal escapes (\\040 for a space) decoded, as bytes first."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i : i + 1] == b"\\" and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode(errors="surrogateescape")


def _is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def main() -> None:
    """`python -m pffs.testing.kube_node DIR`: a control plane and one node, until Ctrl-C."""
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pffs-kube-node")
    missing = missing_binaries() + missing_node_binaries()
    if missing:
        sys.exit(f"missing: {', '.join(missing)}")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored)
        signal.signal(signum, interrupt)
    with (
        NodeControlPlane(workdir / "control-plane", node_names=["pffs-node"]) as cluster,
        KubeNode(workdir / "node", cluster, "pffs-node"),
    ):
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
