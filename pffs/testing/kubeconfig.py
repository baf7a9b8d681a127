"""A kubeconfig that signs in with a bearer token: for tests against a fake or a real API server."""

from __future__ import annotations

from pathlib import Path


def token_kubeconfig(
    path: Path, server: str, token: str, user: str = "test", ca_file: Path | None = None
) -> Path:
    """A kubeconfig at `path` whose one context reaches `server` as `user` with `token`; the server's
    certificate is checked against `ca_file` when given."""
    cluster = f'server: "{server}"'
    if ca_file is not None:
        cluster += f', certificate-authority: "{ca_file}"'
    path.write_text(
        f"""apiVersion: v1
kind: Config
current-context: {user}
clusters:
- name: cluster
  cluster: {{{cluster}}}
contexts:
- name: {user}
  context: {{cluster: cluster, user: {user}}}
users:
- name: {user}
  user: {{token: "{token}"}}
"""
    )
    return path
