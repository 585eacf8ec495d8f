"""node.toml (reconciler.core.install.nodeconfig) and the units derived from it (reconciler.core.install.units)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier
from reconciler.cli import main
from reconciler.core.install.nodeconfig import NodeConfig, NodeConfigError, parse_node_config
from reconciler.core.install.units import (
    DAEMON_HARDENING,
    HARDENING,
    Install,
    host_units,
    reconcile_argv,
    reconcile_service,
    reconcile_timer,
    watch_service,
)
from tests.conftest import require


def problems(text: str) -> list[str]:
    with pytest.raises(NodeConfigError) as exc:
        parse_node_config(text, "node.toml")
    return [str(p) for p in exc.value.problems]


def test_absent_sections_are_defaults() -> None:
    node = parse_node_config("")
    assert node == NodeConfig()
    assert node.node.unit_dir == "/etc/systemd/system"
    assert node.timer.interval == "30s"
    assert node.source is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[node]\ndesired = "relative"\n', "node.toml: node.desired: 'relative' must be an absolute path"),
        ('[node]\nhost = "Bad Host"\n', "node.toml: node.host: 'Bad Host' is not a safe name"),
        ('[timer]\ninterval = "30s; rm -rf /"\n', "node.toml: timer.interval: String should match pattern"),
        ('[source]\nbranch = "main"\n', "node.toml: source.remote: required key is missing"),
        (
            '[source]\nremote = "/srv/fleet.git"\nrequire_signed_commits = true\n',
            "node.toml: source.allowed_signers_file: required: commits must be signed",
        ),
        (
            # The gate is on unless node.toml turns it off in so many words.
            '[source]\nremote = "/srv/fleet.git"\n',
            "node.toml: source.allowed_signers_file: required: commits must be signed (require_signed_commits is true unless",
        ),
        (
            '[source]\nremote = "git@git.example:fleet.git"\nrequire_signed_commits = false\n',
            "node.toml: source.ssh_host_key: required for an ssh remote",
        ),
        (
            '[source]\nremote = "ssh://git@git.example/fleet.git"\nrequire_signed_commits = false\nssh_host_key = "ssh-ed25519 not base64!"\n',
            "node.toml: source.ssh_host_key: String should match pattern",
        ),
        ('[bootstrap]\nk3s_token_file = "/run/secrets/k3s"\n', "node.toml: bootstrap.k3s_server: k3s_server and k3s_token_file go together"),
        (
            '[bootstrap]\nk3s_server = "http://plain:6443"\nk3s_token_file = "/run/k"\n',
            "node.toml: bootstrap.k3s_server: String should match pattern",
        ),
        (
            '[bootstrap]\ntailscale_auth_key = "tskey-abc"\n',
            "node.toml: bootstrap.tailscale_auth_key: unknown key; did you mean 'tailscale_auth_key_file'?",
        ),
        ("[node\n", "node.toml: line 1: TOML syntax error:"),
        (
            '[node]\ndesired = "/srv/fleet"\n[source]\nremote = "/srv/fleet.git"\nrequire_signed_commits = false\n',
            "node.toml: node.desired: with [source] the checkout must be inside node.state_dir (/var/lib/fabric)",
        ),
    ],
)
def test_bad_node_toml_names_file_key_and_reason(text: str, expected: str) -> None:
    assert any(p.startswith(expected) for p in problems(text)), problems(text)


def test_reconcile_command_and_units_from_node_toml() -> None:
    node = parse_node_config('[node]\nhost = "racknerd"\nunit_dir = "/run/systemd/system"\n[timer]\ninterval = "45s"\n')
    install = Install(fabric_bin="/opt/fabric/bin/fabric", node=node, search_path="/opt/fabric/bin:/usr/bin")
    assert reconcile_argv(install) == [
        "/opt/fabric/bin/fabric",
        "reconcile",
        "--desired",
        "/var/lib/fabric/desired",
        "--unit-dir",
        "/run/systemd/system",
        "--host",
        "racknerd",
    ]
    service = reconcile_service(install).values("Service")
    assert service["Type"] == "oneshot"
    assert service["Environment"] == ("PATH=/opt/fabric/bin:/usr/bin", "HOME=/var/lib/fabric")
    assert "ExecStartPre" not in service
    for key, value in HARDENING.items():
        assert service[key] == value
    # The trust anchors stay read-only though the pass writes the nft file beside them.
    assert "-/etc/fabric" in service["ReadWritePaths"]
    assert {"-/etc/fabric/node.toml", "-/etc/fabric/allowed_signers", "-/etc/fabric/plan-signing.key", "-/etc/fabric/etcd"} <= set(
        service["ReadOnlyPaths"]
    )
    assert set(service["CapabilityBoundingSet"].split()) == {
        "CAP_NET_ADMIN",
        "CAP_NET_BIND_SERVICE",
        "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH",
        "CAP_FOWNER",
        "CAP_CHOWN",
    }
    timer = reconcile_timer(install).values("Timer")
    assert timer["OnUnitActiveSec"] == "45s" and timer["Persistent"] == "true" and timer["AccuracySec"] == "1s"
    assert [u.name for u in host_units(install, leader_candidate=True)] == [
        "fabric-reconcile.service",
        "fabric-reconcile.timer",
        "fabric-watch.service",
        "fabric-bootstrap.service",
        "fabric-leader.service",
    ]


def test_units_text_lists_repeated_settings_once_each() -> None:
    text = reconcile_service(Install(fabric_bin="/opt/fabric/bin/fabric", node=NodeConfig())).text()
    assert text.count("ReadWritePaths=") == len(HARDENING["ReadWritePaths"])
    assert "\n[Service]\nType=oneshot\n" in text


def test_units_cli_json_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[node]\nhost = "lux"\n[source]\nremote = "/srv/fleet.git"\nrequire_signed_commits = false\n')
    args = ["units", "--config", str(config), "--fabric-bin", "/opt/fabric/bin/fabric"]
    assert main([*args, "--json"]) == 0
    units = json.loads(capsys.readouterr().out)
    assert units["fabric-reconcile.service"]["Service"]["ExecStartPre"] == [f"/opt/fabric/bin/fabric pull --config {config}"]
    out = tmp_path / "units"
    assert main([*args, "--write", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "fabric-bootstrap.service",
        "fabric-reconcile.service",
        "fabric-reconcile.timer",
        "fabric-watch.service",
    ]
    # The bootstrap agent pulls the desired state first, as the pass does.
    assert units["fabric-bootstrap.service"]["Service"]["ExecStartPre"] == [f"/opt/fabric/bin/fabric pull --config {config}"]
    capsys.readouterr()
    assert main([*args, "--write", str(out)]) == 0
    assert capsys.readouterr().out.count("unchanged") == 4


def test_units_cli_bad_config_is_exit_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[timer]\ninterval = "soon"\n')
    out = tmp_path / "units"
    assert main(["units", "--config", str(config), "--fabric-bin", "/opt/fabric/bin/fabric", "--write", str(out)]) == 2
    assert f"{config}: timer.interval:" in capsys.readouterr().err
    assert not out.exists()


def test_installed_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """Every key of the fabric's own units is one systemd knows (a misspelled
    hardening option would otherwise be dropped silently)."""
    require("systemd-analyze")
    fabric_bin = shutil.which("fabric") or str(Path(sys.executable).with_name("fabric"))
    node = parse_node_config('[node]\nhost = "lux"\n[source]\nremote = "/srv/fleet.git"\nrequire_signed_commits = false\n')
    install = Install(fabric_bin=fabric_bin, node=node, search_path="/usr/bin:/bin")
    paths = []
    for unit in host_units(install, leader_candidate=True):
        path = tmp_path / unit.name
        path.write_text(unit.text())
        paths.append(str(path))
    SystemdAnalyzeVerifier(SubprocessRunner()).verify(paths)


def test_watch_service_restarts_on_failure_hardened_as_a_daemon(tmp_path: Path) -> None:
    """fabric-watch.service: `fabric watch` with the pass's desired state,
    host and registry, the daemons' hardening (no capability, nothing
    writable but its state), brought back only after a failure;
    `systemd-analyze verify` knows every key of it."""
    require("systemd-analyze")
    node = parse_node_config('[node]\nhost = "lux"\nregistry_path = "/var/lib/fabric/registry.sqlite"\n')
    fabric_bin = shutil.which("fabric") or str(Path(sys.executable).with_name("fabric"))
    unit = watch_service(Install(fabric_bin=fabric_bin, node=node))
    service = unit.values("Service")
    assert service["ExecStart"] == f"{fabric_bin} watch --desired /var/lib/fabric/desired --host lux"
    assert service["Type"] == "simple" and service["Restart"] == "on-failure"
    assert service["Environment"] == ("FABRIC_REGISTRY=/var/lib/fabric/registry.sqlite", "HOME=/var/lib/fabric")
    for key, value in DAEMON_HARDENING.items():
        assert service[key] == value, key
    assert "ReadWritePaths" not in service and service["CapabilityBoundingSet"] == ""
    assert unit.values("Install")["WantedBy"] == "multi-user.target"
    path = tmp_path / unit.name
    path.write_text(unit.text())
    SystemdAnalyzeVerifier(SubprocessRunner()).verify([str(path)])
