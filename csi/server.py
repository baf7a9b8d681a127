"""`pffs csi`: the plugin process. Serves Identity always, Controller and/or Node by mode, on a unix socket
(or TCP, for tests); in node mode adopts the mounts a previous plugin process left, supervises them and
publishes the node's cache report. SIGTERM stops serving and leaves the mounts running.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pffs.config import CacheSettings
from pffs.csi import csi_pb2_grpc
from pffs.csi.cache_group import GROUP_ANNOTATION, GroupConfig, Membership, NodeWatch
from pffs.csi.controller import ControllerServicer
from pffs.csi.identity import DRIVER_NAME, IdentityServicer
from pffs.csi.kubelet import kubelet_problem
from pffs.csi.metrics import PluginMetrics
from pffs.csi.mount_runner import MountRunner
from pffs.csi.mounter import MounterClient
from pffs.csi.node import NodeServicer
from pffs.csi.periodic import Periodic
from pffs.csi.registration import KubeletRegistration
from pffs.csi.volumes import MountStarter, NodeConfig, VolumeManager
from pffs.processes import until_stopped

log = logging.getLogger(__name__)

MODES = ("node", "controller", "all")
ZONE_LABEL = "topology.kubernetes.io/zone"
TOR_LABEL = "pffs.io/tor"


@dataclass
class PluginOptions:
    endpoint: str
    node_id: str
    mode: str = "all"
    state_dir: Path = Path("/var/lib/pffs-csi")
    cache: CacheSettings = field(default_factory=CacheSettings)
    zone: str | None = None
    tor: str | None = None
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    check_interval_s: float = 1.0
    report_interval_s: float = 30.0
    kubeconfig: Path | None = None
    in_cluster: bool = False
    kubelet_registration_dir: Path | None = None  # register with the kubelet here (no registrar sidecar)
    kubelet_registration_path: str | None = None  # the CSI socket as the kubelet sees it (default: ours)
    mount_metrics_ports: tuple[int, int] | None = None
    kubelet_dir: Path | None = None  # the kubelet's root dir, at the same path as on the host
    mounter: Path | None = None  # the socket of `pffs csi-mounter` (None: start mounts in this process)
    cache_group: GroupConfig | None = None  # None: volumes asking for a cache group are refused
    warmups: bool = False  # DatasetWarmups: a node warms its cache; a controller resolves and rolls up
    namespace: str | None = None  # the plugin's own (warm-ups' Secrets, the controller's Lease)
    ready_file: Path | None = None  # "ok", or why the plugin is not ready (the readiness probe reads it)


def grpc_address(endpoint: str) -> tuple[str, str | None]:
    """(the address grpc binds, the socket file it makes) from unix:///path, unix:/path or tcp://host:port."""
    if endpoint.startswith("unix://"):
        path = endpoint[len("unix://") :]
    elif endpoint.startswith("unix:"):
        path = endpoint[len("unix:") :]
    elif endpoint.startswith("tcp://"):
        return endpoint[len("tcp://") :], None
    else:
        raise ValueError(f"--endpoint {endpoint!r}: use unix:///path/csi.sock (or tcp://127.0.0.1:PORT)")
    if not path.startswith("/"):
        raise ValueError(f"--endpoint {endpoint!r}: the socket path must be absolute")
    return f"unix://{path}", path


def kubernetes_api(options: PluginOptions) -> Any | None:
    """A CoreV1Api from the pod's service account or a kubeconfig (exec plugins and all, through the
    official client); None where neither is given (outside a cluster)."""
    if not options.in_cluster and options.kubeconfig is None:
        return None
    from kubernetes import client, config

    configuration = client.Configuration()
    if options.in_cluster:
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=str(options.kubeconfig), client_configuration=configuration)
    return client.CoreV1Api(client.ApiClient(configuration))


def node_topology(api: Any, node_name: str) -> tuple[str | None, str | None]:
    """The Node's zone and ToR switch labels, if the API server answers within a few seconds."""
    try:
        node = api.read_node(node_name, _request_timeout=5)
    except Exception as exc:
        log.warning("could not read Node %s's labels for topology (%s); give --zone/--tor", node_name, exc)
        return None, None
    labels = node.metadata.labels or {}
    return labels.get(ZONE_LABEL), labels.get(TOR_LABEL)


class Plugin:
    """The running plugin: the gRPC server and, in node mode, the volumes, supervisor and reporter."""

    def __init__(self, options: PluginOptions) -> None:
        if options.mode not in MODES:
            raise ValueError(f"--mode {options.mode!r}: use node, controller or all")
        if not options.node_id:
            raise ValueError("--node-id is required (or NODE_ID in the environment)")
        self.options = options
        self.address, self.socket_path = grpc_address(options.endpoint)
        self.metrics = PluginMetrics()
        self.volumes: VolumeManager | None = None
        self.supervisor: Periodic | None = None
        self.reporter: Any = None
        self.registration: KubeletRegistration | None = None
        self.runner: MountRunner | None = None
        self.group_watch: NodeWatch | None = None
        self.warmer: Any = None
        self.warmup_controller: Any = None
        self.kubelet_problem: str | None = None  # set while no kubelet serves at --kubelet-dir
        self._readiness_written: str | None = None
        self._readiness_lock = threading.Lock()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="csi-rpc"))
        serve_node = options.mode in ("node", "all")
        serve_controller = options.mode in ("controller", "all")
        csi_pb2_grpc.add_IdentityServicer_to_server(
            IdentityServicer(self.metrics, serve_controller, serve_node), self.server
        )
        if serve_controller:
            csi_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(self.metrics), self.server)
        if serve_node:
            self._setup_node()
        if serve_controller and options.warmups:
            self._setup_warmup_controller()

    def _setup_node(self) -> None:
        options = self.options
        api = kubernetes_api(options)
        zone, tor = options.zone, options.tor
        if api is not None and (zone is None or tor is None):
            labelled_zone, labelled_tor = node_topology(api, options.node_id)
            zone, tor = zone or labelled_zone, tor or labelled_tor
        config = NodeConfig(
            node_id=options.node_id,
            state_dir=options.state_dir,
            cache=options.cache,
            zone=zone,
            tor=tor,
            kubelet_dir=options.kubelet_dir,
        )
        starter: MountStarter
        if options.mounter is not None:
            starter = MounterClient(options.mounter)
        else:
            self.runner = MountRunner(options.mount_metrics_ports)
            self.metrics.registry.register(self.runner.collector())
            starter = self.runner
        membership = None
        if options.cache_group is not None:
            membership = Membership(options.node_id, options.cache_group, options.state_dir / "cache-groups")
            if api is None:
                log.warning(
                    "cache group: no API server (--in-cluster or --kubeconfig), so no other node is found; "
                    "this node's volumes share only among themselves"
                )
            else:
                from pffs.csi.cache_report import NodeAnnotation

                published = NodeAnnotation(options.node_id, api, GROUP_ANNOTATION)
                self.group_watch = NodeWatch(api, membership, published.write)
        self.volumes = VolumeManager(config, self.metrics, starter, api, membership)
        if options.warmups:
            if api is None:
                raise ValueError("--warmups needs the API server (--in-cluster or --kubeconfig)")
            from pffs.csi.warmup_node import NodeWarmer

            self.warmer = NodeWarmer(api.api_client, options.node_id, self.volumes, options.namespace)
        if options.kubelet_dir is not None:
            problem = kubelet_problem(options.kubelet_dir)
            if problem is not None:
                self.kubelet_problem = (
                    f"{problem}. Until then this node plugin stays unready, does not register with the "
                    "kubelet and leaves every mount of the node as it is"
                )
        if self.kubelet_problem is None:
            self.volumes.adopt()
        else:
            # Its records' staging and target paths are under the real kubelet dir, which this container
            # does not see: every live mount would look dead. Nothing is adopted, repaired or stopped.
            log.error("%s", self.kubelet_problem)
        csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(self.volumes, self.metrics), self.server)
        # Checks every mount and repairs the dead ones.
        if options.kubelet_registration_dir is not None:
            self.registration = KubeletRegistration(
                options.kubelet_registration_dir,
                DRIVER_NAME,
                options.kubelet_registration_path or self.socket_path or self.address,
            )
            self.registration.servicer.on_status = self.write_readiness  # Ready as soon as registered
        self.supervisor = Periodic("supervisor", self._supervise, options.check_interval_s)
        if api is not None:
            from pffs.csi.cache_report import CacheReporter, NodeAnnotation

            annotation = NodeAnnotation(options.node_id, api)
            self.reporter = CacheReporter(
                self.volumes,
                annotation.write,
                self.metrics,
                options.report_interval_s,
                f"Node {options.node_id}",
            )
            if self.warmer is not None:
                self.warmer.after_warmed = self.reporter.report_once

    def _setup_warmup_controller(self) -> None:
        from pffs.csi.warmup_controller import WarmupController

        api = kubernetes_api(self.options)
        if api is None or self.options.namespace is None:
            raise ValueError(
                "--warmups in controller mode needs the API (--in-cluster or --kubeconfig) and --namespace"
            )
        self.warmup_controller = WarmupController(api.api_client, self.options.namespace)

    def _supervise(self) -> None:
        if self.runner is not None:
            self.runner.reap()
        assert self.volumes is not None
        if self.kubelet_problem is not None:
            assert self.options.kubelet_dir is not None
            if kubelet_problem(self.options.kubelet_dir) is not None:
                self.write_readiness()
                return
            log.info("the kubelet now serves at %s: adopting this node's mounts", self.options.kubelet_dir)
            self.kubelet_problem = None
            self.volumes.adopt()
            if self.registration:
                self.registration.start()
        else:
            self.volumes.check()
        self.write_readiness()

    def readiness(self) -> str | None:
        """The readiness probe's answer: None once the plugin can serve this node's pods (the kubelet is at
        --kubelet-dir and, where the plugin registers itself, has registered it), else why not."""
        if self.kubelet_problem is not None:
            return self.kubelet_problem
        if self.registration is not None:
            servicer = self.registration.servicer
            if servicer.registered is None:
                return (
                    f"the kubelet has not registered {DRIVER_NAME} yet (it has not answered the "
                    f"registration socket {self.registration.socket}): is node.kubeletPath "
                    f"({self.options.kubelet_dir}) the kubelet's --root-dir?"
                )
            if not servicer.registered:
                return f"the kubelet refused to register {DRIVER_NAME}: {servicer.error}"
        return self.health()

    def write_readiness(self) -> None:
        """Writes readiness() to --ready-file when it changed ("ok", or the reason): the readiness probe
        prints it, so `kubectl describe pod` shows why the plugin is not ready."""
        path = self.options.ready_file
        if path is None:
            return
        with self._readiness_lock:  # the supervisor and the registration callback both write it
            text = self.readiness() or "ok"
            if text == self._readiness_written:
                return
            temporary = path.with_name(f".{path.name}.tmp")
            temporary.write_text(text + "\n")
            temporary.replace(path)
            if text != "ok":
                log.warning("not ready: %s", text)
            elif self._readiness_written is not None:
                log.info("ready: the kubelet registered %s", DRIVER_NAME)
            self._readiness_written = text

    def health(self) -> str | None:
        """/healthz: None while the plugin serves (its gRPC server runs and, on a node, its supervisor
        has checked the mounts lately), else why not."""
        # A round may take minutes (each repair waits for its mount): only one stuck for 30 counts.
        if self.supervisor is not None and not self.supervisor.is_current(stale_s=1800):
            return "the mount supervisor has not run lately"
        return None

    def start(self) -> None:
        if self.socket_path:
            Path(self.socket_path).parent.mkdir(parents=True, exist_ok=True)
            if os.path.exists(self.socket_path):
                os.unlink(self.socket_path)  # left by a plugin that was killed
        if self.server.add_insecure_port(self.address) == 0 and not self.socket_path:
            raise OSError(98, f"cannot listen on {self.options.endpoint}")
        self.server.start()
        if self.options.metrics_port:
            self.metrics.serve(self.options.metrics_address, self.options.metrics_port, self.health)
        if self.registration and self.kubelet_problem is None:
            self.registration.start()  # after the CSI socket answers: the kubelet calls it at once
        self.write_readiness()
        if self.supervisor:
            self.supervisor.start()
        if self.reporter:
            self.reporter.start()
        if self.group_watch:
            self.group_watch.start()
        if self.warmer:
            self.warmer.start()
        if self.warmup_controller:
            self.warmup_controller.start()
        log.info(
            "%s %s serving %s on %s (node %s)",
            DRIVER_NAME,
            self.options.mode,
            "Identity+" + self.options.mode,
            self.options.endpoint,
            self.options.node_id,
        )

    def stop(self) -> None:
        """Stops serving; mounts keep running for the next plugin process to adopt."""
        if self.registration:
            self.registration.stop()
        self.server.stop(grace=5).wait(10)
        if self.supervisor:
            self.supervisor.stop()
        if self.reporter:
            self.reporter.stop()
        if self.group_watch:
            self.group_watch.stop()
        if self.warmer:
            self.warmer.stop()
        if self.warmup_controller:
            self.warmup_controller.stop()
        if self.volumes:
            self.volumes.close()
        if self.runner:
            self.runner.close()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        log.info("stopped; %d volume mount(s) left running", self._staged_count())

    def _staged_count(self) -> int:
        if self.volumes is None:
            return 0
        with self.volumes.state.lock:
            return len(self.volumes.state.records.staged)


def serve(options: PluginOptions) -> int:
    plugin = Plugin(options)
    plugin.start()
    until_stopped("stopping (mounts keep running)")
    plugin.stop()
    return 0
