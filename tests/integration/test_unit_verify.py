"""SystemdAnalyzeVerifier with the real `systemd-analyze verify`, on units outside /etc."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier
from reconciler.ports import ActivationError
from tests.conftest import require

pytestmark = pytest.mark.integration

# Shaped like a rendered agent unit: hardening, a credential, restart policy.
AGENT_UNIT = """\
[Unit]
Description=fabric agent for lane transcode
After=network-online.target
Wants=network-online.target

[Service]
ExecStart=/bin/sleep infinity
Environment=FABRIC_QUEUE=transcode
LoadCredential=registry-token:/etc/fabric/secrets/registry-token
Restart=on-failure
RestartSec=5s
DynamicUser=yes
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""


@pytest.fixture
def verifier() -> SystemdAnalyzeVerifier:
    require("systemd-analyze", "env")
    return SystemdAnalyzeVerifier(SubprocessRunner())


def write(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_good_units_outside_etc_pass(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    agent = write(tmp_path / "generation-7" / "units", "fabric-agent-transcode.service", AGENT_UNIT)
    verifier.verify([agent])


def test_missing_program_fails_naming_the_unit(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    unit = write(tmp_path, "fabric-agent-broken.service", AGENT_UNIT.replace("/bin/sleep infinity", "/nonexistent/agent"))
    with pytest.raises(ActivationError, match=r"fabric-agent-broken\.service: Command /nonexistent/agent is not executable"):
        verifier.verify([unit])


@pytest.mark.parametrize(
    ("wrong", "complaint"),
    [
        ("ProtectSystem=stric", r"Failed to parse protect system value"),
        ("ProtectSytem=strict", r"Unknown key 'ProtectSytem'"),
    ],
)
def test_setting_systemd_would_ignore_fails(verifier: SystemdAnalyzeVerifier, tmp_path: Path, wrong: str, complaint: str) -> None:
    unit = write(tmp_path, "fabric-agent-typo.service", AGENT_UNIT.replace("ProtectSystem=strict", wrong))
    with pytest.raises(ActivationError, match=rf"fabric-agent-typo\.service:\d+: {complaint}"):
        verifier.verify([unit])


def test_dependencies_among_the_given_units_resolve(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    socat = write(
        tmp_path,
        "fabric-socat-web.service",
        "[Unit]\nRequires=fabric-agent-web.service\nAfter=fabric-agent-web.service\n[Service]\nExecStart=/bin/true\n",
    )
    agent = write(tmp_path, "fabric-agent-web.service", AGENT_UNIT)
    verifier.verify([socat, agent])


def test_dependency_on_a_unit_that_exists_nowhere_fails(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    socat = write(tmp_path, "fabric-socat-web.service", "[Unit]\nRequires=fabric-agent-gone.service\n[Service]\nExecStart=/bin/true\n")
    with pytest.raises(ActivationError, match=r"Unit fabric-agent-gone\.service not found"):
        verifier.verify([socat])


def test_drop_in_is_verified_merged_into_the_unit_it_extends(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    base = write(tmp_path, "fabric-node.service", "[Service]\nExecStart=/bin/sleep infinity\n")
    good = write(tmp_path, "fabric-node.service.d/fabric-labels.conf", "[Service]\nEnvironment=NODE_LABELS=tier=gpu_cuda\n")
    verifier.verify([base, good])
    verifier.verify([good, base])  # order does not matter

    bad = write(tmp_path, "fabric-node.service.d/fabric-labels.conf", "[Service]\nEnviroment=NODE_LABELS=tier=gpu_cuda\n")
    with pytest.raises(ActivationError, match=r"fabric-labels\.conf:2: Unknown key 'Enviroment'"):
        verifier.verify([base, bad])


def test_drop_in_for_a_unit_that_is_not_installed_fails(verifier: SystemdAnalyzeVerifier, tmp_path: Path) -> None:
    orphan = write(tmp_path, "fabric-nothing-here.service.d/labels.conf", "[Service]\nEnvironment=A=b\n")
    with pytest.raises(ActivationError, match=r"Unit fabric-nothing-here\.service not found"):
        verifier.verify([orphan])


def test_relative_path_is_refused(verifier: SystemdAnalyzeVerifier) -> None:
    with pytest.raises(ActivationError, match="must be absolute"):
        verifier.verify(["units/fabric-agent-web.service"])


def test_missing_systemd_analyze_is_an_activation_error(tmp_path: Path) -> None:
    require("env")
    unit = write(tmp_path, "fabric-agent-web.service", AGENT_UNIT)
    with pytest.raises(ActivationError, match="not installed"):
        SystemdAnalyzeVerifier(SubprocessRunner(), systemd_analyze="/nonexistent/systemd-analyze").verify([unit])
