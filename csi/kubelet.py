"""Whether the kubelet is where the node plugin was told it is (`--kubelet-dir`, Helm `node.kubeletPath`), and
where it really is when not.

A live kubelet listens on a unix socket under its root dir, the pod-resources API's
(`ROOT/pod-resources/kubelet.sock`; its device-plugin socket is no guide: kubelets put it at
/var/lib/kubelet/device-plugins whatever their root). A connect there answers only if a kubelet serves
there now (a socket file left by an old kubelet refuses). Where nothing answers, the kubelet's real root
comes from the paths of the unix sockets listening in the host's network namespace (`/proc/1/net/unix`,
readable with hostPID) and in ours, and from a `kubelet` process's `--root-dir` flag.

A plugin whose kubelet is elsewhere must not touch the node's mounts: it would not see the staging and target
paths of its records (they are under the real kubelet dir, not mounted into it) and take live mounts for dead
ones. server.py keeps such a plugin unready, unregistered and hands-off until the kubelet answers.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

KUBELET_SOCKETS = ("pod-resources/kubelet.sock",)
SOCKET_FOLDERS = ("pod-resources", "pods-api")  # folders of the kubelet's own sockets, under its root
DEFAULT_ROOT = "/var/lib/kubelet"
CONNECT_TIMEOUT_S = 2.0
SO_ACCEPTCON = 0x10000  # /proc/net/unix's Flags of a listening socket


def kubelet_answers(root: Path | str, host_root: str = "") -> bool:
    """Whether a kubelet serves at `root` now (one of its sockets accepts a connection). `host_root`: where
    the host's / is seen from here ("/proc/1/root" in a pod with hostPID; "" where `root` is mounted at the
    same path)."""
    for name in KUBELET_SOCKETS:
        folder, _, leaf = f"{host_root}{root}/{name}".rpartition("/")
        try:
            dir_fd = os.open(folder, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(CONNECT_TIMEOUT_S)
                # Through the folder's descriptor: a unix socket's path may hold only 107 bytes.
                conn.connect(f"/proc/self/fd/{dir_fd}/{leaf}")
                return True
        except OSError:
            continue
        finally:
            os.close(dir_fd)
    return False


def listening_kubelet_roots(proc: Path = Path("/proc")) -> list[str]:
    """The root dirs of the kubelets listening on this host, from the paths of their listening unix sockets
    in the host's network namespace (pid 1's, seen with hostPID) and in this process's."""
    roots: list[str] = []
    for table in (proc / "1" / "net" / "unix", proc / "self" / "net" / "unix"):
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # Num RefCount Protocol Flags Type St Inode Path
            if len(fields) < 8 or not int(fields[3], 16) & SO_ACCEPTCON:
                continue
            # The kubelet binds a temporary name in the socket's folder, then renames it: the table shows
            # ROOT/pod-resources/<digits>, not .../kubelet.sock.
            folder = os.path.dirname(" ".join(fields[7:]))
            if os.path.basename(folder) in SOCKET_FOLDERS:
                root = os.path.dirname(folder)
                if root not in roots:
                    roots.append(root)
    return roots


def kubelet_process_roots(proc: Path = Path("/proc")) -> list[str]:
    """The `--root-dir` of every process named kubelet (its default where the flag is not given)."""
    roots: list[str] = []
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if os.path.basename(argv[0].decode(errors="replace")) != "kubelet":
                continue
            root = DEFAULT_ROOT
            args = [arg.decode(errors="replace") for arg in argv[1:]]
            for i, arg in enumerate(args):
                if arg.startswith("--root-dir="):
                    root = arg.split("=", 1)[1]
                elif arg == "--root-dir" and i + 1 < len(args):
                    root = args[i + 1]
            root = root.rstrip("/") or "/"
            if root not in roots:
                roots.append(root)
    return roots


def real_kubelet_roots(proc: Path = Path("/proc")) -> tuple[list[str], str]:
    """Where the kubelet(s) of this host keep their root, and how that was found."""
    listening, processes = listening_kubelet_roots(proc), kubelet_process_roots(proc)
    roots = listening + [root for root in processes if root not in listening]
    how = " and ".join(
        what
        for what, found in (("from the sockets it listens on", listening), ("its --root-dir", processes))
        if found
    )
    return roots, how


def kubelet_problem(kubelet_dir: Path | str, proc: Path = Path("/proc"), host_root: str = "") -> str | None:
    """None if a kubelet serves at `kubelet_dir`; else one message naming node.kubeletPath, the path given
    and the path the kubelet really uses, when it can be found."""
    given = str(kubelet_dir).rstrip("/") or "/"
    if kubelet_answers(given, host_root):
        return None
    roots, how = real_kubelet_roots(proc)
    if given in kubelet_process_roots(proc):
        return None  # a kubelet runs with this --root-dir (its pod-resources API off or not up yet)
    others = [root for root in roots if root != given]
    if len(others) == 1:
        where = f"the kubelet on this node uses {others[0]} ({how}): set node.kubeletPath={others[0]}"
    elif others:
        where = f"kubelets on this host use {', '.join(others)} ({how}): set node.kubeletPath to this node's"
    else:
        where = (
            "no kubelet was found on this node (no pod-resources socket listens in the host's network "
            f"namespace, no kubelet process; the usual root is {DEFAULT_ROOT}): set node.kubeletPath to the "
            "kubelet's --root-dir"
        )
    sockets = " or ".join(f"{given}/{name}" for name in KUBELET_SOCKETS)
    return f"node.kubeletPath is {given}, but no kubelet serves there (nothing answers at {sockets}); {where}"
