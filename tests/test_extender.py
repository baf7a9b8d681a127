"""`pffs extender` over real HTTP, in kube-scheduler's extender/v1 wire format (the JSON kube-scheduler sends:
Go field names as keys, full Kubernetes Pod and Node objects)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pffs.scheduler.kube.extender import MAX_BODY, make_server
from pffs.testing.s3_server import free_ports

GIB = 1 << 30
IMAGENET = "s3://datasets/imagenet"
COCO = "s3://datasets/coco"


def node(name: str, report: dict[str, tuple[int, int]] | None, raw: str | None = None) -> dict[str, Any]:
    """A Node as the API serves it; `report` is what its pffs publishes (dataset -> (cached, total))."""
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    if report is not None:
        datasets = {d: {"cached_bytes": c, "total_bytes": t} for d, (c, t) in report.items()}
        annotations["pffs.io/cache"] = json.dumps({"datasets": datasets, "updated": 1764000000})
    if raw is not None:
        annotations["pffs.io/cache"] = raw
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}, "annotations": annotations},
        "status": {"allocatable": {"cpu": "64", "memory": "256Gi", "nvidia.com/gpu": "8"}},
    }


def pod(datasets: str | None = None, inline_source: str | None = None) -> dict[str, Any]:
    annotations = {"pffs.io/datasets": datasets} if datasets is not None else {}
    volumes: list[dict[str, Any]] = [{"name": "scratch", "emptyDir": {}}]
    if inline_source is not None:
        attributes = {"source": inline_source, "cacheSize": "100G"}
        volumes.append({"name": "data", "csi": {"driver": "csi.pffs.io", "volumeAttributes": attributes}})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "trainer-0", "namespace": "ml", "annotations": annotations},
        "spec": {"containers": [{"name": "train", "image": "trainer:1"}], "volumes": volumes},
    }


NODES = [
    node("warm", {IMAGENET: (GIB, GIB), COCO: (0, 2 * GIB)}),
    node("half", {IMAGENET: (GIB // 2, GIB)}),
    node("no-pffs", None),
    node("cold", {}),
]


@pytest.fixture
def url() -> Iterator[str]:
    server = make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def post(url: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def node_list(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": nodes}


def test_filter_keeps_pffs_nodes_for_a_pod_reading_pffs_datasets(url: str) -> None:
    status, result = post(
        f"{url}/filter", {"Pod": pod(IMAGENET), "Nodes": node_list(NODES), "NodeNames": None}
    )
    assert status == 200
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["warm", "half", "cold"]
    assert result["NodeNames"] is None
    assert set(result["FailedAndUnresolvableNodes"]) == {"no-pffs"}
    assert "pffs does not run on this node" in result["FailedAndUnresolvableNodes"]["no-pffs"]
    assert result["FailedNodes"] == {} and result["Error"] == ""


def test_a_pod_without_datasets_passes_everywhere_with_no_preference(url: str) -> None:
    status, result = post(f"{url}/filter", {"Pod": pod(), "Nodes": node_list(NODES)})
    assert status == 200 and len(result["Nodes"]["items"]) == 4 and result["FailedAndUnresolvableNodes"] == {}
    status, scores = post(f"{url}/prioritize", {"Pod": pod(), "Nodes": node_list(NODES)})
    assert status == 200 and {s["Score"] for s in scores} == {0}


def test_scores_are_the_cached_fraction_of_the_pods_datasets_out_of_10(url: str) -> None:
    status, scores = post(f"{url}/prioritize", {"Pod": pod(IMAGENET), "Nodes": node_list(NODES)})
    assert status == 200
    assert scores == [
        {"Host": "warm", "Score": 10},
        {"Host": "half", "Score": 5},
        {"Host": "no-pffs", "Score": 0},
        {"Host": "cold", "Score": 0},
    ]
    # two datasets: the mean of the fractions (imagenet all, coco none -> 5); a trailing slash and s3a://
    # name the same datasets
    both = pod(f"{IMAGENET}/, s3a://datasets/coco")
    _, scores = post(f"{url}/prioritize", {"Pod": both, "Nodes": node_list(NODES)})
    assert {s["Host"]: s["Score"] for s in scores} == {"warm": 5, "half": 2, "no-pffs": 0, "cold": 0}


def test_datasets_of_pffs_csi_inline_volumes_count(url: str) -> None:
    _, scores = post(f"{url}/prioritize", {"Pod": pod(inline_source=IMAGENET), "Nodes": node_list(NODES)})
    assert scores[0] == {"Host": "warm", "Score": 10}


def test_node_cache_capable_requests_get_node_names_never_null(url: str) -> None:
    post(f"{url}/filter", {"Pod": pod(IMAGENET), "Nodes": node_list(NODES)})  # reports learnt here
    names = ["warm", "no-pffs", "never-seen"]
    status, result = post(f"{url}/filter", {"Pod": pod(IMAGENET), "Nodes": None, "NodeNames": names})
    assert status == 200
    assert result["NodeNames"] == ["warm", "never-seen"]  # an unknown node is not failed
    assert result["Nodes"] is None and set(result["FailedAndUnresolvableNodes"]) == {"no-pffs"}
    _, empty = post(f"{url}/filter", {"Pod": pod(IMAGENET), "NodeNames": []})
    assert empty["NodeNames"] == []
    _, scores = post(f"{url}/prioritize", {"Pod": pod(IMAGENET), "NodeNames": names})
    assert scores == [
        {"Host": "warm", "Score": 10},
        {"Host": "no-pffs", "Score": 0},
        {"Host": "never-seen", "Score": 0},
    ]


def test_keys_are_read_as_go_reads_them_case_insensitively(url: str) -> None:
    status, result = post(f"{url}/filter", {"pod": pod(IMAGENET), "nodenames": ["a"]})
    assert status == 200 and result["NodeNames"] == ["a"]


def test_a_malformed_cache_report_scores_zero_and_fails_nothing(url: str) -> None:
    nodes = [node("garbled", None, raw="{not json"), node("wrong-shape", None, raw='{"datasets": [1, 2]}')]
    status, scores = post(f"{url}/prioritize", {"Pod": pod(IMAGENET), "Nodes": node_list(nodes)})
    assert status == 200 and {s["Score"] for s in scores} == {0}
    _, result = post(f"{url}/filter", {"Pod": pod(IMAGENET), "Nodes": node_list(nodes)})
    assert len(result["Nodes"]["items"]) == 2


@pytest.mark.parametrize(
    ("body", "raw", "reason"),
    [
        (None, b"{not json", "bad filter request"),
        ([1, 2], None, "must be a JSON object"),
        ({"Nodes": node_list(NODES)}, None, "Pod is missing"),
        ({"Pod": pod(IMAGENET)}, None, "neither Nodes nor NodeNames"),
        ({"Pod": pod(IMAGENET), "Nodes": {"items": "x"}}, None, "Nodes must be a NodeList"),
        ({"Pod": pod(IMAGENET), "NodeNames": [1]}, None, "NodeNames must be a list of strings"),
        ({"Pod": pod(IMAGENET), "Nodes": node_list([{"metadata": {}}])}, None, "no metadata.name"),
        ({"Pod": {"metadata": {"annotations": {"pffs.io/datasets": 5}}}, "NodeNames": []}, None, "string"),
        ({"Pod": {"spec": {"volumes": "x"}}, "NodeNames": []}, None, "volumes must be a list"),
    ],
)
def test_malformed_requests_get_400_with_the_reason_and_the_server_goes_on(
    url: str, body: Any, raw: bytes | None, reason: str
) -> None:
    status, result = post(f"{url}/filter", body, raw)
    assert status == 400 and reason in result["Error"]
    assert post(f"{url}/filter", {"Pod": pod(), "NodeNames": ["n"]})[0] == 200


def test_unknown_verbs_oversized_bodies_and_health(url: str) -> None:
    assert post(f"{url}/bind", {"PodName": "x"})[0] == 404
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
        assert response.status == 200
    request = urllib.request.Request(
        f"{url}/filter", data=b"{}", headers={"Content-Length": str(MAX_BODY + 1)}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 413


def test_cli_serves_until_sigterm_and_rejects_a_bad_port() -> None:
    bad = subprocess.run([sys.executable, "-m", "pffs.cli.main", "extender", "--port", "70000"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--port" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pffs.cli.main", "extender", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    assert response.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
                time.sleep(0.1)
        status, _ = post(f"http://127.0.0.1:{port}/prioritize", {"Pod": pod(IMAGENET), "NodeNames": ["a"]})
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_sample_scheduler_configuration_reaches_the_extender(url: str) -> None:
    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "scheduler", "extender-config.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (ext,) = config["extenders"]
    assert ext["urlPrefix"].startswith("http://127.0.0.1:") and ext["nodeCacheCapable"] is False
    prefix = url + "/"  # the test server's port in place of the sample's
    assert post(prefix + ext["filterVerb"], {"Pod": pod(IMAGENET), "Nodes": node_list(NODES)})[0] == 200
    assert post(prefix + ext["prioritizeVerb"], {"Pod": pod(IMAGENET), "Nodes": node_list(NODES)})[0] == 200


def test_absurd_cache_reports_score_within_0_to_10(url: str) -> None:
    nodes = [
        node(
            "negative",
            None,
            raw='{"datasets": {"s3://datasets/imagenet": {"cached_bytes": -5, "total_bytes": 1}}}',
        ),
        node("huge", None, raw='{"datasets": {"s3://datasets/imagenet": {"cached_bytes": 1e400}}}'),
        node("deep", None, raw="[" * 100_000),
    ]
    status, scores = post(f"{url}/prioritize", {"Pod": pod(IMAGENET), "Nodes": node_list(nodes)})
    assert status == 200 and all(0 <= s["Score"] <= 10 for s in scores)


def test_a_deeply_nested_body_is_a_400(url: str) -> None:
    status, result = post(f"{url}/filter", None, raw=b"[" * 200_000)
    assert status == 400 and "bad filter request" in result["Error"]


def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes (a 10 s socket timeout fails the test)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_client_that_stalls_mid_body_is_dropped() -> None:
    server = make_server("127.0.0.1", 0, timeout=0.5)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        head = b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        _raw_exchange(url, head + b'{"Pod":')  # returns once the server gives up on the rest
    finally:
        server.shutdown()
        server.server_close()


def test_a_chunked_body_is_refused_and_the_connection_closed(url: str) -> None:
    head = b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    data = _raw_exchange(url, head + b"5\r\nhello\r\n0\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1]
    )
    assert len(body) == length  # nothing more: the chunks were not read as another request


def test_a_report_its_plugin_stopped_renewing_counts_as_nothing_cached(url: str) -> None:
    """A plugin rewrites its report at least every REPORT_HEARTBEAT_S; one older than REPORT_MAX_AGE_S
    is the last word of a plugin that is gone (uninstalled, broken) and draws no pod to its node."""
    from pffs.scheduler.kube.extender import NodeReports
    from pffs.scheduler.kube.locality import REPORT_MAX_AGE_S, node_cache

    def stamped(name: str, age_s: float) -> dict[str, Any]:
        written = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - age_s))
        report = {"datasets": {IMAGENET: {"cached_bytes": GIB, "total_bytes": GIB}}, "updated_at": written}
        return node(name, None, raw=json.dumps(report))

    nodes = [
        stamped("fresh", 60),
        stamped("gone", REPORT_MAX_AGE_S + 60),
        node("unstamped", {IMAGENET: (GIB, GIB)}),
    ]
    status, scores = post(f"{url}/prioritize", {"Pod": pod(IMAGENET), "Nodes": node_list(nodes)})
    assert status == 200
    assert {s["Host"]: s["Score"] for s in scores} == {"fresh": 10, "gone": 0, "unstamped": 10}
    _, result = post(f"{url}/filter", {"Pod": pod(IMAGENET), "Nodes": node_list(nodes)})
    assert len(result["Nodes"]["items"]) == 3  # a stale report fails no node: it only stops attracting

    # Known by name only (nodeCacheCapable): a report learnt while fresh stops counting once it ages,
    # though its Node never changes again.
    clock = [time.time()]
    reports = NodeReports(clock=lambda: clock[0])
    reports.update("fresh", nodes[0])
    assert reports.get("fresh")[1] == {IMAGENET: node_cache(nodes[0])[IMAGENET]}  # type: ignore[index]
    clock[0] += REPORT_MAX_AGE_S
    assert reports.get("fresh") == (True, {})
