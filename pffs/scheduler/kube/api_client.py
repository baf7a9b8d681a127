"""The Kubernetes REST calls `pffs scheduler` and `pffs extender` make: one request (JSON in and out), a
paged list with its resourceVersion, and a watch (a stream of events), over urllib3's kept-alive connections.

Two ways to sign in share them: ``KubeApi`` takes a bearer token or a client certificate from a kubeconfig or
the pod's service account (read here, so a bad one is one clear line at start), ``ClientApi`` goes through the
official `kubernetes` client for what only it does (exec credential plugins and auth providers: EKS, GKE, AKS,
OIDC). Tokens and keys are never logged or put in an error message."""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import json
import logging
import os
import ssl
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import urllib3

from pffs.scheduler.kube.json_fields import BadObject, json_list, json_object

log = logging.getLogger(__name__)

# What a broken connection or answer raises below urllib3's own retries (which are off: the loop retries).
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError, ValueError)


class ApiError(Exception):
    """The API server refused a request (or could not be reached: status 0)."""

    def __init__(self, method: str, path: str, status: int, message: str) -> None:
        super().__init__(f"{method} {path}: {status or 'no answer'}: {message}")
        self.status = status
        self.message = message


class WatchUnsupported(ApiError):
    """The server answered a watch with something else (a list: a proxy or a test server that ignores
    ``watch=1``): the caller lists instead."""


class RestCalls:
    """One REST call (``request``), every item of a list (``list_all``), and a watch (``watch``), each
    raising ApiError on any failure; subclasses only open the HTTP exchange (``_send``)."""

    server: str
    timeout: float

    def _send(
        self, method: str, path: str, body: Any, content_type: str, timeout: Any
    ) -> urllib3.BaseHTTPResponse:
        """The server's answer to ``body`` (JSON-encoded here), unread, of any status; ApiError (status 0) if
        there is none."""
        raise NotImplementedError

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        response = self._send(method, path, body, content_type, self.timeout)
        try:
            payload = response.read()
        except TRANSPORT_ERRORS as exc:  # cut short (IncompleteRead) or timed out mid-body
            raise ApiError(method, path, 0, f"{self.server} gave a broken answer: {_reason(exc)}") from None
        finally:
            response.release_conn()
        if response.status >= 400:
            raise ApiError(
                method, path, response.status, status_message(response.status, payload, response.reason or "")
            )
        try:
            return json.loads(payload) if payload else None
        except ValueError:  # a proxy's HTML page, say
            raise ApiError(method, path, response.status, "the answer is not JSON") from None

    def list_items(self, path: str, page: int = 500) -> list[Any]:
        """Every item of a list, page by page (limit/continue)."""
        return self.list_all(path, page)[0]

    def list_all(self, path: str, page: int = 500) -> tuple[list[Any], str]:
        """Every item of a list and the list's resourceVersion (where a watch of it starts)."""
        items: list[Any] = []
        token, version = "", ""
        while True:
            query = {"limit": str(page)} | ({"continue": token} if token else {})
            answer = self.request("GET", f"{path}?{urllib.parse.urlencode(query)}")
            if not isinstance(answer, Mapping) or not isinstance(answer.get("items"), list):
                raise ApiError("GET", path, 200, "the answer is not a list object (items missing)")
            items += answer["items"]
            metadata = json_object(answer.get("metadata"), "list metadata")
            version = version or str(
                metadata.get("resourceVersion") or ""
            )  # the first page's: the snapshot's
            token = metadata.get("continue") or ""
            if not token:
                return items, version

    def watch(self, path: str, resource_version: str, seconds: int = 300) -> WatchStream:
        """The events of a list since ``resource_version`` (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR), for
        about ``seconds`` (then the server ends the stream and the caller watches again). Connected when this
        returns; ApiError if the server refuses, WatchUnsupported if it answers with something else."""
        query = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        url = f"{path}?{urllib.parse.urlencode(query)}"
        # A read deadline past the server's own end of the stream: a silent, dead connection is noticed.
        timeout = urllib3.Timeout(connect=self.timeout, read=seconds + 30)
        response = self._send("GET", url, None, "application/json", timeout)
        if response.status >= 400:
            payload = response.read()
            response.release_conn()
            if response.status in (400, 405, 501):
                raise WatchUnsupported("GET", url, response.status, "the server does not watch this list")
            raise ApiError(
                "GET", url, response.status, status_message(response.status, payload, response.reason or "")
            )
        return WatchStream(response, url)


class WatchStream:
    """The JSON events of a watch, one per line, as the chunks arrive; ``close()`` from another thread ends
    a read that waits for the next event."""

    def __init__(self, response: urllib3.BaseHTTPResponse, url: str) -> None:
        self.response, self.url = response, url

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        pending = b""
        try:
            for chunk in self.response.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line, self.url)
            if pending.strip():
                yield _event(pending, self.url)
        except TRANSPORT_ERRORS as exc:
            raise ApiError("GET", self.url, 0, f"the watch broke: {_reason(exc)}") from None
        finally:
            self.response.release_conn()

    def close(self) -> None:
        # shutdown() unblocks the reading thread, which then ends; a stream already back in the pool refuses
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            self.response.shutdown()


def _event(line: bytes, url: str) -> Mapping[str, Any]:
    try:
        event = json.loads(line)
    except ValueError:
        raise WatchUnsupported("GET", url, 200, "the answer is not a stream of watch events") from None
    if not isinstance(event, Mapping) or "type" not in event or not isinstance(event.get("object"), Mapping):
        raise WatchUnsupported("GET", url, 200, "the answer is not a stream of watch events")
    return event


def _reason(exc: BaseException) -> str:
    """A transport failure in a few words (urllib3 nests the cause), never a header's value."""
    reason = getattr(exc, "reason", None) or exc
    if isinstance(exc, ValueError) and not isinstance(exc, urllib3.exceptions.HTTPError):
        return type(exc).__name__  # http.client's ValueErrors quote the header (the token)
    return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__


class KubeApi(RestCalls):
    """The REST calls over a urllib3 pool, with a bearer token or a client certificate."""

    def __init__(
        self,
        server: str,
        *,
        context: ssl.SSLContext | None = None,
        token: str | None = None,
        token_file: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.server = server.rstrip("/")
        self._context = context
        self._token = token
        self._token_file = token_file  # re-read: projected service account tokens rotate
        self.timeout = timeout
        # Kept-alive connections, one per parallel Binding (loop.BIND_PARALLELISM): binds and status patches
        # would otherwise each pay a TLS handshake.
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=16, ssl_context=context, retries=False)

    def __repr__(self) -> str:  # never the token
        return f"KubeApi({self.server!r})"

    def _send(
        self, method: str, path: str, body: Any, content_type: str, timeout: Any
    ) -> urllib3.BaseHTTPResponse:
        headers = {"Accept": "application/json", "User-Agent": "pffs-scheduler"}
        token = self._token
        if self._token_file:
            try:
                token = Path(self._token_file).read_text()
            except OSError as exc:
                raise ApiError(method, path, 0, f"cannot read the token file: {exc.strerror}") from None
        token = str(token).strip() if token else ""  # a YAML block scalar (`token: |`) ends in a newline
        if token:
            if not token.isprintable():  # http.client would refuse it with the token in its message
                raise ApiError(method, path, 0, "the token holds characters not allowed in an HTTP header")
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            return self._pool.request(
                method,
                self.server + path,
                body=json.dumps(body).encode() if body is not None else None,
                headers=headers,
                timeout=timeout,
                preload_content=False,
                redirect=False,
            )
        except TRANSPORT_ERRORS as exc:
            raise ApiError(method, path, 0, f"cannot reach {self.server}: {_reason(exc)}") from None


def status_message(status: int, body: bytes, reason: str) -> str:
    """The API server's own message (a Status object's), and what to check for 401 and 403."""
    try:
        answer = json.loads(body)
        message = answer.get("message") if isinstance(answer, Mapping) else None
    except ValueError:
        message = None
    hint = {
        401: " (the credentials are not accepted)",
        403: " (RBAC: see deploy/scheduler/pffs-scheduler.yaml)",
    }
    return f"{message or reason}{hint.get(status, '')}"


class ClientApi(RestCalls):
    """The same calls through the official `kubernetes` client's authentication: what a kubeconfig with an
    exec credential plugin or an auth provider needs (EKS, GKE, AKS, OIDC), whose tokens the client gets
    from the plugin and refreshes before they expire."""

    def __init__(self, api_client: Any, timeout: float = 30.0) -> None:
        self.client = api_client
        self.server = str(api_client.configuration.host).rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:  # never the token
        return f"ClientApi({self.server!r})"

    def _send(
        self, method: str, path: str, body: Any, content_type: str, timeout: Any
    ) -> urllib3.BaseHTTPResponse:
        resource, _, query = path.partition("?")
        headers = {"Accept": "application/json", "User-Agent": "pffs-scheduler"}
        if body is not None:
            headers["Content-Type"] = content_type
        if isinstance(timeout, urllib3.Timeout):
            timeout = (timeout.connect_timeout, timeout.read_timeout)
        try:
            method, url, headers, data, _ = self.client.param_serialize(
                method,
                resource,
                query_params=urllib.parse.parse_qsl(query),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            return self.client.call_api(
                method, url, header_params=headers, body=data, _request_timeout=timeout
            ).response
        except Exception as exc:  # urllib3's, or the exec plugin's own failure: one line, no token
            raise ApiError(method, path, 0, f"cannot reach {self.server}: {type(exc).__name__}") from None


def plugin_kubeconfig_api(path: Path, context_name: str | None, where: str) -> ClientApi:
    """A kubeconfig whose user runs an exec plugin or an auth provider, through the official client."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_kube_config(
            config_file=str(path), context=context_name, client_configuration=configuration
        )
        configuration.auth_settings()  # runs the plugin now: a broken one fails at start, in one line
    except Exception as exc:  # ConfigException, or the plugin failing: its message names no secret
        raise BadObject(f"{where}: the kubeconfig's credential plugin failed: {exc}") from None
    # The client logs a plugin that fails and goes on without credentials: refuse that here.
    if not (configuration.api_key.get("BearerToken") or configuration.cert_file):
        raise BadObject(
            f"{where}: the kubeconfig's credential plugin failed: it gave no token or client certificate "
            "(its own message is logged above)"
        )
    return ClientApi(client.ApiClient(configuration))


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # what the kubelet mounts


def in_cluster_api() -> KubeApi:
    """The API server as a pod sees it: its service account's token and CA."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    account = SERVICE_ACCOUNT_DIR
    if not host or not (account / "token").exists():
        raise BadObject(
            "not running in a pod (KUBERNETES_SERVICE_HOST or the service account token is missing): "
            "pass --kubeconfig PATH"
        )
    try:
        context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    except (OSError, ssl.SSLError) as exc:
        raise BadObject(
            f"{account / 'ca.crt'}: cannot load the cluster's CA ({exc}); is the token mounted?"
        ) from None
    host = f"[{host}]" if ":" in host else host
    return KubeApi(f"https://{host}:{port}", context=context, token_file=str(account / "token"))


def kubeconfig_api(path: Path, context_name: str | None = None) -> RestCalls:
    """The API server and credentials of a kubeconfig's current (or named) context.

    Token, tokenFile, client certificate and key (files or -data), certificate-authority(-data) and
    insecure-skip-tls-verify are read here; a user with an exec credential plugin or an auth provider goes
    through the official client (ClientApi), which runs the plugin and refreshes its tokens."""
    import yaml

    where = str(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise BadObject(f"{where}: cannot read the kubeconfig: {exc}") from None
    config = json_object(config, f"{where}: the kubeconfig")
    name = context_name or config.get("current-context")
    if not name:
        raise BadObject(f"{where}: no current-context")

    def named(section: str, wanted: Any) -> Mapping[str, Any]:
        for entry in json_list(config.get(section), f"{where}: {section}"):
            if isinstance(entry, Mapping) and entry.get("name") == wanted:
                return json_object(entry.get(section.rstrip("s")), f"{where}: {section} {wanted}")
        raise BadObject(f"{where}: no {section.rstrip('s')} named {wanted!r}")

    ctx = named("contexts", name)
    cluster = named("clusters", ctx.get("cluster"))
    user = named("users", ctx.get("user")) if ctx.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise BadObject(f"{where}: cluster {ctx.get('cluster')!r} has no server")
    if "exec" in user or "auth-provider" in user:
        return plugin_kubeconfig_api(path, context_name, where)
    base = path.parent
    context = None
    if server.startswith("https:"):
        context = _server_context(cluster, base, where)
        try:
            cert = _pem(user, "client-certificate", base)
            key = _pem(user, "client-key", base)
            if cert and key:
                _load_client_cert(context, cert, key)
        except (binascii.Error, ValueError, TypeError, OSError) as exc:  # not the key: ssl names no data
            raise BadObject(
                f"{where}: user {ctx.get('user')!r}: unusable client certificate or key: "
                f"{type(exc).__name__}: {exc}"
            ) from None
    token_file = user.get("tokenFile")
    return KubeApi(
        server,
        context=context,
        token=user.get("token"),
        token_file=str(base / token_file) if token_file else None,
    )


def _server_context(cluster: Mapping[str, Any], base: Path, where: str) -> ssl.SSLContext:
    """TLS to the API server: the kubeconfig's CA alone when it names one (as client-go does: the system's
    CAs are not trusted then), the system's otherwise; no verification only if insecure-skip-tls-verify."""
    if cluster.get("insecure-skip-tls-verify") is True:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        if cluster.get("certificate-authority-data"):
            what = "certificate-authority-data"
            cadata = base64.b64decode(cluster["certificate-authority-data"], validate=True).decode()
            return ssl.create_default_context(cadata=cadata)
        if cluster.get("certificate-authority"):
            what = f"certificate-authority {cluster['certificate-authority']}"
            return ssl.create_default_context(cafile=str(base / cluster["certificate-authority"]))
    except (binascii.Error, ValueError, TypeError, OSError) as exc:  # ssl.SSLError is an OSError
        raise BadObject(f"{where}: {what} is not a usable PEM CA certificate: {exc}") from None
    return ssl.create_default_context()


def _pem(user: Mapping[str, Any], key: str, base: Path) -> bytes | None:
    if user.get(f"{key}-data"):
        return base64.b64decode(user[f"{key}-data"], validate=True)
    if user.get(key):
        return (base / user[key]).read_bytes()
    return None


def _load_client_cert(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl loads a key only from a file: a private directory, removed at once (the context keeps the key).
    with tempfile.TemporaryDirectory(prefix="pffs-kube-") as folder:
        cert_path, key_path = Path(folder, "cert.pem"), Path(folder, "key.pem")
        for target, data in ((cert_path, cert), (key_path, key)):
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(str(cert_path), str(key_path))
