"""The network edge says what it means (issue 36, item 6), and unit files that
carry environment are not world-readable (item 7).

- the table inet fabric accepts the tailnet's range on the fabric's ports only
  when it arrives on the host's tailnet interface (`[host] tailnet_interface`);
- a port map's socat listens on the host's probed tailnet address, on every
  address when `allow_from` opens it, on loopback while the address is unknown;
- the edge's status page answers the tailnet only unless `[fleet]
  status_access = "public"`;
- a unit file with Environment= lines is 0640, on disk too.

The real nft, socat and Caddy: tests/integration/test_nftables.py,
test_socat.py and test_caddy.py.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.render.artifacts import UNIT_MODE, UNIT_WITH_ENVIRONMENT_MODE, render, unit_mode
from reconciler.core.render.status_site import TAILNET_ONLY_ANSWER
from tests.conftest import EXAMPLE_FLEET
from tests.support.cli import fabric
from tests.support.fleet import Fleet
from tests.support.render import facts, files, golden_plan


@pytest.fixture
def desired(tmp_path: Path) -> Path:
    tree = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, tree)
    return tree


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


# --------------------------------------------------------------------------
# nftables: the interface as well as the range


def test_every_tailnet_rule_names_the_tailnet_interface() -> None:
    nft = files(load_desired(EXAMPLE_FLEET), "racknerd")["etc/fabric/fabric.nft"]
    tailnet_rules = [line.strip() for line in nft.splitlines() if "100.64.0.0/10" in line or "fd7a:115c:a1e0::/48" in line]
    tailnet_rules = [rule for rule in tailnet_rules if not rule.startswith("#")]
    assert tailnet_rules == [
        'iifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept',
        'iifname "tailscale0" ip6 saddr fd7a:115c:a1e0::/48 tcp dport { 2222, 4445 } accept',
    ]


def test_the_host_file_names_another_tailnet_interface(desired: Path) -> None:
    _edit(desired / "qfox-1.toml", 'address = "100.88.57.96"\n', 'address = "100.88.57.96"\ntailnet_interface = "wg-tail"\n')
    nft = files(load_desired(desired), "qfox-1")["etc/fabric/fabric.nft"]
    assert 'iifname "wg-tail" ip saddr 100.64.0.0/10 tcp dport { 8701, 8702, 8703 } accept' in nft
    # The CachyOS/Arch forward fix follows it.
    assert 'iifname "wg-tail" accept\n\t\toifname "wg-tail" ct state established,related accept' in nft
    assert "tailscale0" not in nft


# --------------------------------------------------------------------------
# socat: the tailnet address


def _socat(state, host_facts, name: str = "qfox-ssh") -> str:  # type: ignore[no-untyped-def]
    rendered = render(state, "racknerd", host_facts, golden_plan())
    return next(a.content for a in rendered.artifacts if a.path.endswith(f"fabric-socat-{name}.service"))


def _exec_start(unit: str) -> str:
    return next(line for line in unit.splitlines() if line.startswith("ExecStart="))


def test_socat_binds_the_probed_tailnet_address() -> None:
    unit = _socat(load_desired(EXAMPLE_FLEET), facts("racknerd", tailscale_ip="100.101.7.99"))
    assert _exec_start(unit) == 'ExecStart="/usr/bin/socat" "TCP4-LISTEN:2222,bind=100.101.7.99,ip-freebind=1,fork,reuseaddr" "TCP4:100.88.57.96:22"'
    assert "# Listens on 100.101.7.99.\n# This host's tailnet address only (the probe's)" in unit


def test_allow_from_keeps_socat_on_every_address_and_says_why(desired: Path) -> None:
    _edit(desired / "fabric.toml", "target_port = 22\n", 'target_port = 22\nallow_from = ["203.0.113.0/24"]\n')
    unit = _socat(load_desired(desired), facts("racknerd"))
    assert _exec_start(unit) == 'ExecStart="/usr/bin/socat" "TCP-LISTEN:2222,fork,reuseaddr" "TCP4:100.88.57.96:22"'
    assert "# Listens on every address.\n# Every address: allow_from opens this port map beyond the tailnet (203.0.113.0/24)," in unit
    # The other port map stays on the tailnet address.
    assert "bind=100.101.7.2," in _socat(load_desired(desired), facts("racknerd"), "lux-smb")


@pytest.mark.parametrize(
    ("tailscale_ip", "missing", "why"),
    [
        (None, {"tailscale": "tailscale: command not found"}, "the probe found none: tailscale: command not found"),
        ("203.0.113.5", {}, "the probe's '203.0.113.5' is not in the tailnet's ranges"),
    ],
    ids=["no-tailscale", "outside-the-tailnet"],
)
def test_an_unknown_tailnet_address_binds_loopback_and_says_why(tailscale_ip: str | None, missing: dict[str, str], why: str) -> None:
    rendered = render(load_desired(EXAMPLE_FLEET), "racknerd", facts("racknerd", tailscale_ip=tailscale_ip, missing=missing), golden_plan())
    unit = next(a.content for a in rendered.artifacts if a.path.endswith("fabric-socat-qfox-ssh.service"))
    assert '"TCP4-LISTEN:2222,bind=127.0.0.1,ip-freebind=1,fork,reuseaddr"' in _exec_start(unit)
    assert "# Listens on 127.0.0.1.\n# Loopback only: this host's tailnet address is unknown (" + why in unit
    assert f"port map qfox-ssh: listens on 127.0.0.1 only: this host's tailnet address is unknown ({why}" in "\n".join(rendered.notes)


# --------------------------------------------------------------------------
# The status page: tailnet only unless public


def test_the_status_site_refuses_sources_outside_the_tailnet_by_default() -> None:
    caddy = files(load_desired(EXAMPLE_FLEET), "racknerd")["etc/caddy/fabric.caddy"]
    site = caddy[caddy.index("status.researchstack.info {") :]
    assert site.startswith(
        "status.researchstack.info {\n"
        "\t@outside_tailnet not remote_ip 100.64.0.0/10 fd7a:115c:a1e0::/48\n"
        f'\trespond @outside_tailnet "{TAILNET_ONLY_ANSWER}" 403\n'
        "\troot * /var/lib/fabric/status\n"
    )


def test_status_access_public_opens_the_page(desired: Path) -> None:
    _edit(desired / "fabric.toml", 'domain = "researchstack.info"\n', 'domain = "researchstack.info"\nstatus_access = "public"\n')
    caddy = files(load_desired(desired), "racknerd")["etc/caddy/fabric.caddy"]
    assert "@outside_tailnet" not in caddy and TAILNET_ONLY_ANSWER not in caddy
    assert "status.researchstack.info {\n\troot * /var/lib/fabric/status\n" in caddy
    # The capabilities API keeps its own sources ([fleet] capabilities_allow_from).
    assert '\t\trespond @outside "capabilities: tailnet only" 403' in caddy


def test_a_bad_status_access_exits_2_naming_file_and_key(desired: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit(desired / "fabric.toml", 'domain = "researchstack.info"\n', 'domain = "researchstack.info"\nstatus_access = "open"\n')
    before = {p.name: p.read_bytes() for p in desired.iterdir()}
    code, out, err = fabric(capsys, "validate", "--desired", str(desired))
    assert (code, out) == (2, "")
    assert f"{desired}/fabric.toml: fleet.status_access: " in err and "'tailnet'" in err and "'public'" in err
    assert {p.name: p.read_bytes() for p in desired.iterdir()} == before


def test_a_bad_tailnet_interface_exits_2_naming_file_and_key(desired: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit(desired / "racknerd.toml", 'address = "100.101.7.2"\n', 'address = "100.101.7.2"\ntailnet_interface = "tail scale0"\n')
    code, out, err = fabric(capsys, "validate", "--desired", str(desired))
    assert (code, out) == (2, "")
    assert f"{desired}/racknerd.toml: host.tailnet_interface: 'tail scale0' is not a network interface name" in err


# --------------------------------------------------------------------------
# Unit files that carry environment: 0640


def test_unit_mode_follows_environment_lines() -> None:
    assert unit_mode("[Service]\nEnvironment=A=1\nExecStart=/bin/true\n") == UNIT_WITH_ENVIRONMENT_MODE == 0o640
    assert unit_mode("[Service]\nExecStart=/bin/true\n# Environment= would go here\n") == UNIT_MODE == 0o644


@pytest.mark.parametrize("host", ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"])
def test_every_rendered_unit_with_environment_is_0640_and_the_others_0644(host: str) -> None:
    rendered = render(load_desired(EXAMPLE_FLEET), host, facts(host), golden_plan())
    for artifact in rendered.artifacts:
        if artifact.kind != "unit":
            continue
        carries = any(line.startswith("Environment=") for line in artifact.content.splitlines())
        assert artifact.mode == (0o640 if carries else 0o644), artifact.path


def test_the_example_units_with_environment() -> None:
    modes = {
        a.path.rsplit("/", 1)[-1]: a.mode
        for h in ("racknerd", "qfox-1")
        for a in render(load_desired(EXAMPLE_FLEET), h, facts(h), golden_plan()).artifacts
    }
    assert modes["fabric-socat-qfox-ssh.service"] == 0o644
    assert modes["fabric-nftables.service"] == 0o644
    # lupine's [services] environment, the Ray worker's own variables.
    assert modes["fabric-agent-lupine.service"] == 0o640
    assert modes["fabric-ray-worker.service"] == 0o640
    # A service without environment.
    assert modes["fabric-agent-flac-fft.service"] == 0o644


def test_a_pass_writes_environment_units_0640_on_disk(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "qfox-1")
    old_umask = os.umask(0)  # the mode is the pass's doing, not the umask's
    try:
        assert fleet.reconcile().ok
    finally:
        os.umask(old_umask)
    unit_dir = fleet.root / "etc/systemd/system"
    for unit in unit_dir.iterdir():
        carries = any(line.startswith("Environment=") for line in unit.read_text().splitlines())
        assert stat.S_IMODE(unit.stat().st_mode) == (0o640 if carries else 0o644), unit.name
    assert stat.S_IMODE((unit_dir / "fabric-agent-lupine.service").stat().st_mode) == 0o640
    assert stat.S_IMODE((unit_dir / "fabric-nftables.service").stat().st_mode) == 0o644


def test_a_unit_installed_world_readable_by_an_older_version_is_written_again_0640(tmp_path: Path) -> None:
    """Same bytes, mode 0644 on disk (before units with environment were
    0640): the next pass writes it again with 0640 and restarts nothing; a
    mode tighter than the artifact's is left as the operator set it."""
    fleet = Fleet(tmp_path, "qfox-1")
    assert fleet.reconcile().ok
    lupine = fleet.root / "etc/systemd/system/fabric-agent-lupine.service"
    nftables = fleet.root / "etc/systemd/system/fabric-nftables.service"
    lupine.chmod(0o644)
    nftables.chmod(0o600)
    fleet.machine.forget_calls()

    report = fleet.preview()
    assert report.stdout == "would write the following files:\n  etc/systemd/system/fabric-agent-lupine.service\n", report.stdout
    assert fleet.reconcile().ok
    assert stat.S_IMODE(lupine.stat().st_mode) == 0o640
    assert stat.S_IMODE(nftables.stat().st_mode) == 0o600
    assert fleet.machine.calls == []  # no daemon-reload, no restart
    assert fleet.preview().stdout == "nothing to do\n"
