"""One version everywhere a user reads it: the package, `pffs --version`, the CSI plugin's GetPluginInfo and
the Helm chart (its version and the appVersion whose image it runs)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

import pffs

REPO = Path(__file__).resolve().parent.parent


def test_the_package_the_cli_the_csi_plugin_and_the_chart_report_one_version() -> None:
    from pffs.csi import csi_pb2
    from pffs.csi.identity import IdentityServicer
    from pffs.csi.metrics import PluginMetrics

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    cli = subprocess.run(
        [sys.executable, "-c", "from pffs.cli.main import main; main(['--version'])"],
        capture_output=True, text=True, timeout=60,
    ).stdout.split()  # fmt: skip
    plugin = IdentityServicer(PluginMetrics(), controller=True, node=True).GetPluginInfo(
        csi_pb2.GetPluginInfoRequest(), None
    )
    chart = yaml.safe_load((REPO / "deploy/helm/pffs-csi/Chart.yaml").read_text())
    assert cli == ["pffs", project]
    assert pffs.__version__ == project
    assert (plugin.name, plugin.vendor_version) == ("csi.pffs.io", project)
    assert chart["version"] == chart["appVersion"] == project
