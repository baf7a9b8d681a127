"""One node of a cache group, for tests/test_peers_netns.py: a pffs SDK filesystem in a process of its own
(run inside a network namespace), driven by JSON lines on stdin and answering JSON lines on stdout.

The first line is the node's configuration (its secrets travel here, never in argv or the environment):

    {"target": "s3://bucket/ds", "cache_dir": ..., "options": {<pffs options: peers, peer_listen, ...>},
     "hard_timeout_s": 90}

and the node answers {"ready": pid} once its filesystem (and its listener, if it serves) is up. Then each line
is one command, each answered by one line:

    {"op": "read", "files": [...], "chunk": N, "pace_s": S, "hold_at": H}
        reads the files in order, N bytes at a time, pausing S seconds after each read; once it has read H
        bytes of a file (if given), says {"held": file, "offset": n} and waits for a line {"op": "go"}
        with the file open; answers {"sha256": {file: hex}, "elapsed": seconds, ...the state below}
    {"op": "state"}   answers {"counts": peer counters, "gets": backend GETs, "members": the members now}
    {"op": "keys", "file": F}   answers {"keys": [the cache key of each block of F's version now]}
    {"op": "exit"}    (or the end of stdin) closes the node

A command that fails answers {"error": traceback}. The node exits by itself after hard_timeout_s whatever it
is doing, so a test that loses track of it cannot leave it running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import fsspec

OUT_LOCK = threading.Lock()


def say(message: dict[str, Any]) -> None:
    with OUT_LOCK:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def state(fs: Any) -> dict[str, Any]:
    requests = fs.vfs.backend.requests.snapshot()
    return {
        "counts": fs.peers.counts.snapshot(),
        "gets": int(requests.get("get", {}).get("requests", 0)),
        "members": list(fs.peers.members()),
    }


def read(fs: Any, files: list[str], chunk: int, pace_s: float, hold_at: int | None) -> dict[str, Any]:
    started = time.monotonic()
    digests = {}
    for name in files:
        digest = hashlib.sha256()
        with fs.open(name, "rb") as f:
            while data := f.read(chunk):
                digest.update(data)
                if hold_at is not None and f.tell() >= hold_at:
                    hold_at = None
                    say({"held": name, "offset": f.tell()})
                    if json.loads(sys.stdin.readline() or "{}").get("op") != "go":
                        raise RuntimeError("held, and told something other than go")
                if pace_s:
                    time.sleep(pace_s)
        digests[name] = digest.hexdigest()
    return {"sha256": digests, "elapsed": time.monotonic() - started, **state(fs)}


def keys(fs: Any, name: str) -> dict[str, Any]:
    info = fs.vfs.stat(fs._full(name), fresh=True)
    reader = fs.vfs.reader
    return {"keys": [reader.key(info, i) for i in range(reader.block_count(info))]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = json.loads(sys.stdin.readline())
    timer = threading.Timer(config.get("hard_timeout_s", 90), lambda: os._exit(3))
    timer.daemon = True
    timer.start()
    fs = fsspec.filesystem(
        "pffs",
        target=config["target"],
        cache_dir=config["cache_dir"],
        skip_instance_cache=True,
        **config["options"],
    )
    say({"ready": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        try:
            if op == "read":
                answer = read(
                    fs,
                    command["files"],
                    command.get("chunk", 1 << 20),
                    command.get("pace_s", 0.0),
                    command.get("hold_at"),
                )
            elif op == "state":
                answer = state(fs)
            elif op == "keys":
                answer = keys(fs, command["file"])
            else:
                answer = {"error": f"unknown op {op!r}"}
        except Exception:
            answer = {"error": traceback.format_exc()}
        say(answer)
    os._exit(0)  # the listener's and the fetchers' threads are daemons of a process that is done


if __name__ == "__main__":
    main()
