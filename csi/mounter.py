"""`pffs csi-mounter`: the node's mount processes, in a pod of their own.

A container's processes end with the container, so mounts started by the node plugin die with every
rollout, upgrade or crash of the plugin, and the files pods hold open on them give ENOTCONN for ever. The
mounter runs in a second DaemonSet updated only `OnDelete`: the plugin (which changes often) asks it over a
unix socket in the node's state dir to start each mount, and the mounts live as long as the mounter's pod.
The plugin still owns everything else: the records, binds into pods, health checks, repairs (it signals a
mount's pid to stop it: both pods share the host's pid namespace).

The protocol is one JSON line each way per connection:
    {"op": "start", "volume": ID, "options": {...}, "ready_timeout_s": 60}
        → {"pid": N} or {"error": WHY, "exit_code": N}
    {"op": "ping"} → {"ok": true}
The socket is 0600 (root's only): the options carry the volume's credentials, as the mount process's stdin
pipe does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pffs.csi.metrics import MounterMetrics, serve_http
from pffs.csi.mount_runner import MountRunner
from pffs.fuse.launch import MountStartError, options_with_credentials
from pffs.fuse.options import MountOptions
from pffs.processes import until_stopped

log = logging.getLogger(__name__)

REQUEST_LIMIT = 1 << 20
TOO_OLD = (
    "this node's pffs mounter is older than the node plugin and does not know the option(s) {}: delete "
    "the pffs-csi-mounter pod on this node (after draining it) to update it"
)
CONNECT_TIMEOUT_S = 5.0


class MounterUnavailable(Exception):
    """The mounter did not answer: its pod is not running (yet) on this node."""


class MounterTooOld(Exception):
    """The mounter runs an older pffs than the plugin (it is updated only when its pod is deleted) and does
    not know an option the volume uses."""


class MounterClient:
    """What the node plugin calls instead of starting a mount itself."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def start(self, options: MountOptions, volume: str, ready_timeout_s: float) -> int:
        request = {
            "op": "start",
            "volume": volume,
            "options": json.loads(options_with_credentials(options, without_defaults=True)),
            "ready_timeout_s": ready_timeout_s,
        }
        answer = self._call(request, ready_timeout_s + 10)
        if "pid" in answer:
            return int(answer["pid"])
        reason = str(answer.get("error", "the mounter gave no reason"))
        if answer.get("too_old"):
            raise MounterTooOld(reason)
        raise MountStartError(reason, int(answer.get("exit_code", 1)))

    def ping(self) -> bool:
        try:
            return bool(self._call({"op": "ping"}, CONNECT_TIMEOUT_S).get("ok"))
        except MounterUnavailable:
            return False

    def _call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(CONNECT_TIMEOUT_S)
                conn.connect(str(self.socket_path))
                conn.settimeout(timeout_s)
                conn.sendall(json.dumps(request).encode() + b"\n")
                reply = conn.makefile("rb").readline(REQUEST_LIMIT)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise MounterUnavailable(
                f"the pffs mounter does not answer at {self.socket_path} ({exc.strerror}): is the "
                "pffs-csi-mounter pod running on this node?"
            ) from None
        except OSError as exc:
            raise MounterUnavailable(f"the pffs mounter at {self.socket_path} failed: {exc}") from None
        if not reply:
            raise MounterUnavailable(f"the pffs mounter at {self.socket_path} closed without an answer")
        try:
            answer = json.loads(reply)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise MounterUnavailable(f"the pffs mounter at {self.socket_path} answered {reply[:80]!r}")
        return answer


class _Handler(socketserver.StreamRequestHandler):
    server: MounterServer

    def handle(self) -> None:
        self.connection.settimeout(CONNECT_TIMEOUT_S)  # for the request; a start then takes its own time
        try:
            request = json.loads(self.rfile.readline(REQUEST_LIMIT))
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
            self.connection.settimeout(None)
            answer = self.server.answer(request)
        except ValidationError as exc:
            unknown = sorted(
                {".".join(map(str, e["loc"])) for e in exc.errors() if e["type"] == "extra_forbidden"}
            )
            if unknown:
                answer = {"error": TOO_OLD.format(", ".join(unknown)), "exit_code": 2, "too_old": True}
            else:
                answer = {"error": f"bad request: {exc.error_count()} invalid option(s)", "exit_code": 2}
        except (ValueError, TypeError, KeyError) as exc:
            answer = {"error": f"bad request: {type(exc).__name__}", "exit_code": 2}
        except Exception as exc:
            log.exception("could not answer a request")
            answer = {"error": f"the mounter failed: {exc}", "exit_code": 1}
        try:
            self.wfile.write(json.dumps(answer).encode() + b"\n")
        except OSError:  # the plugin went away (restarted mid-call): its retry finds the mount (answer())
            log.warning("the plugin did not wait for the answer %s", answer)


class MounterServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, socket_path: Path, runner: MountRunner) -> None:
        self.runner = runner
        socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if socket_path.is_socket():
            socket_path.unlink()  # a mounter that was killed leaves its socket
        old_umask = os.umask(0o177)
        try:
            super().__init__(str(socket_path), _Handler)
        finally:
            os.umask(old_umask)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True}
        if op != "start":
            return {"error": f"unknown op {op!r}", "exit_code": 2}
        options = MountOptions.model_validate(request["options"])
        volume = str(request["volume"])
        for mount in self.runner.running():
            if mount.mountpoint == str(options.mountpoint) and mount.popen.poll() is None:
                return {"pid": mount.pid}  # started for a caller that did not wait for the answer
        try:
            pid = self.runner.start(options, volume, float(request.get("ready_timeout_s", 60)))
        except MountStartError as exc:
            return {"error": str(exc), "exit_code": exc.exit_code}
        log.info("mounted volume %s at %s (pid %d)", volume, options.mountpoint, pid)
        return {"pid": pid}


def serve_mounter(
    socket_path: Path,
    metrics_address: str,
    metrics_port: int | None,
    mount_metrics_ports: tuple[int, int] | None,
) -> int:
    """Serves until SIGTERM, then stops every mount it runs (they end with this pod anyway: stopping them
    first lets each upload what is pending and unmount cleanly)."""
    metrics = MounterMetrics()
    runner = MountRunner(mount_metrics_ports, metrics)
    server = MounterServer(socket_path, runner)
    serving = threading.Thread(target=server.serve_forever, name="mounter", daemon=True)
    serving.start()
    if metrics_port:
        metrics.registry.register(runner.collector())

        def health() -> str | None:
            return None if serving.is_alive() else f"the mounter no longer answers on {socket_path}"

        serve_http(metrics_address, metrics_port, metrics.registry, health)
    log.info("pffs mounter serving on %s", socket_path)
    until_stopped("stopping every mount of this node", runner.reap)
    server.shutdown()
    server.server_close()  # callers now get "refused" at once, not a call that waits for nothing
    socket_path.unlink(missing_ok=True)
    for mount in runner.running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(mount.pid, signal.SIGTERM)
    for mount in runner.running():
        try:
            mount.popen.wait(timeout=60)
        except Exception:
            mount.popen.kill()
    runner.reap()
    runner.close()
    return 0
