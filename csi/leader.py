"""Leader election on a coordination.k8s.io Lease, for a controller that may run more than once.

The holder renews the Lease every RENEW_S; another candidate takes it over once it has not been renewed
for LEASE_S, or at its next look (RENEW_S) when the holder stopped and handed it back. A candidate that
cannot reach the API server stops leading after LEASE_S (it cannot know whether another took over).
Writes carry the Lease's resourceVersion, so two candidates never both win.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

LEASE_S = 15
RENEW_S = 5.0


class LeaseLeader:
    def __init__(self, api_client: Any, namespace: str, name: str, identity: str) -> None:
        from kubernetes import client

        self.api: Any = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self._renewed_at = float("-inf")  # monotonic time of our last successful renewal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops renewing and, if this candidate leads, hands the Lease back at once (as client-go's
        ReleaseOnCancel): the next leader (a rollout's new replica) takes over in seconds, not LEASE_S."""
        self._stop.set()
        self._thread.join(timeout=2)
        if self.is_leader():
            try:
                self._release()
            except Exception as exc:  # it then expires after LEASE_S, as if this process had died
                log.info("leader election: could not hand the Lease back (%s)", exc)
        self._renewed_at = float("-inf")

    def _release(self) -> None:
        lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
        if lease.spec.holder_identity != self.identity:
            return
        # No holder, and a duration of 1 s: expired for any candidate at its next look
        lease.spec.holder_identity = ""
        lease.spec.lease_duration_seconds = 1
        self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
        log.info("leader election: handed the Lease back (%s)", self.identity)

    def is_leader(self) -> bool:
        return time.monotonic() - self._renewed_at < LEASE_S

    def _run(self) -> None:
        was_leader = False
        while not self._stop.is_set():
            try:
                if self._try_acquire_or_renew():
                    self._renewed_at = time.monotonic()
            except Exception as exc:
                log.info("leader election: %s", exc)
            if self.is_leader() != was_leader:
                was_leader = self.is_leader()
                log.info(
                    "leader election: %s the leader (%s)", "now" if was_leader else "no longer", self.identity
                )
            self._stop.wait(RENEW_S)

    def _try_acquire_or_renew(self) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        now = datetime.datetime.now(datetime.UTC)
        spec = client.V1LeaseSpec(
            holder_identity=self.identity, lease_duration_seconds=LEASE_S, renew_time=now, acquire_time=now
        )
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name), spec=spec)
            try:
                self.api.create_namespaced_lease(self.namespace, body, _request_timeout=5)
            except ApiException as created:
                if created.status == 409:  # another candidate made it first
                    return False
                raise
            return True
        held = lease.spec
        renewed = held.renew_time or held.acquire_time
        expired = renewed is None or (now - renewed).total_seconds() > (
            held.lease_duration_seconds or LEASE_S
        )
        if held.holder_identity != self.identity and not expired:
            return False
        if held.holder_identity == self.identity and held.acquire_time is not None:
            spec.acquire_time = held.acquire_time
        lease.spec = spec
        try:  # with the resourceVersion read above: a candidate that wrote in between wins, not both
            self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=5)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True
