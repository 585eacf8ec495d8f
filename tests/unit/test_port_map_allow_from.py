"""A port map's `allow_from`: who besides the tailnet may reach it, said.

Validation of the CIDRs (the bad-input corpus in tests/fixtures/bad_desired
has the CLI's exact messages), the nft rules the edge's table gets, the note
`fabric plan` prints, and the exposure line of `fabric status` and the status
page. tests/integration/test_nftables.py checks the rules with the real nft and
real traffic.
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, PortMap
from reconciler.core.desired.problems import ProblemsError
from reconciler.core.live.models import Snapshot
from reconciler.core.render.artifacts import render
from reconciler.core.views.cards import fleet_status, render_text, status_document
from reconciler.core.views.page import render_status_page
from tests.conftest import EXAMPLE_FLEET
from tests.support.cli import fabric
from tests.support.fleet import GOLDEN, Fleet, cli_pass
from tests.support.render import facts, files, golden_plan

NOW = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)

SSH = "target_port = 22\n"
SMB = "target_port = 445\n"
EVERYONE = 'allow_from = ["0.0.0.0/0", "::/0"]\n'
TWO_NETWORKS = 'allow_from = ["203.0.113.0/24", "2001:db8:42::/48"]\n'


def port_map(*allow_from: str) -> PortMap:
    return PortMap(name="ssh", host="racknerd", listen_port=2222, target_host="qfox-1", target_port=22, allow_from=list(allow_from))


def opened(tmp_path: Path, ssh: str = EVERYONE, smb: str = TWO_NETWORKS) -> Path:
    """A copy of the example fleet with qfox-ssh and lux-smb opened."""
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    fleet = (desired / "fabric.toml").read_text()
    assert fleet.count(SSH) == 1 and fleet.count(SMB) == 1
    (desired / "fabric.toml").write_text(fleet.replace(SSH, SSH + ssh).replace(SMB, SMB + smb))
    return desired


# --------------------------------------------------------------------------
# Validation


def test_absent_or_empty_is_the_tailnet_only() -> None:
    state = load_desired(EXAMPLE_FLEET)
    assert all(m.allow_from == [] and not m.open_to_everyone for m in state.fleet.port_maps)
    assert port_map().allow_from == []


def test_cidrs_are_normalized_and_everyone_is_either_family() -> None:
    assert port_map("2001:DB8::/32", "198.51.100.7").allow_from == ["2001:db8::/32", "198.51.100.7/32"]
    assert port_map("0.0.0.0/0").open_to_everyone
    assert port_map("::/0").open_to_everyone
    assert not port_map("203.0.113.0/24", "2001:db8::/32").open_to_everyone


@pytest.mark.parametrize(
    ("allow_from", "where", "reason"),
    [
        (["nope"], "allow_from.0", "'nope' is not a CIDR"),
        (["203.0.113.0/24", "10.0.0.0/33"], "allow_from.1", "'10.0.0.0/33' is not a CIDR"),
        (["203.0.113.7/24"], "allow_from.0", "'203.0.113.7/24' has host bits set; the network is 203.0.113.0/24"),
        (["2001:db8::1/32"], "allow_from.0", "'2001:db8::1/32' has host bits set; the network is 2001:db8::/32"),
        (["fe80::%eth0/64"], "allow_from.0", "has a zone"),
        (["10.0.0.0/8", "203.0.113.0/24", "10.0.0.0/8"], "allow_from", "10.0.0.0/8 is listed twice (allow_from[0] and allow_from[2])"),
        (["2001:DB8::/32", "2001:db8::/32"], "allow_from", "2001:db8::/32 is listed twice"),
    ],
)
def test_bad_allow_from_is_refused_at_its_key(allow_from: list[str], where: str, reason: str) -> None:
    with pytest.raises(ValidationError) as refused:
        port_map(*allow_from)
    [error] = refused.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == where
    assert reason in error["msg"]


def test_the_loader_names_the_key_path(tmp_path: Path) -> None:
    desired = opened(tmp_path, ssh='allow_from = ["203.0.113.7/24"]\n', smb="")
    with pytest.raises(ProblemsError) as refused:
        load_desired(desired)
    assert [str(p).replace(f"{desired}/", "") for p in refused.value.problems] == [
        "fabric.toml: port_maps[0].allow_from[0]: '203.0.113.7/24' has host bits set; the network is 203.0.113.0/24"
    ]


# --------------------------------------------------------------------------
# The edge's nft table


def test_the_table_accepts_the_tailnet_and_each_allowed_cidr_then_drops_the_rest(tmp_path: Path) -> None:
    nft = files(load_desired(opened(tmp_path)), "racknerd")["etc/fabric/fabric.nft"]
    chain = nft[nft.index("\tchain input {") : nft.index("\t}\n")]
    assert chain.splitlines()[1:] == [
        "\t\ttype filter hook input priority filter - 10; policy accept;",
        '\t\tiifname "lo" accept',
        '\t\tiifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept',
        '\t\tiifname "tailscale0" ip6 saddr fd7a:115c:a1e0::/48 tcp dport { 2222, 4445 } accept',
        "\t\t# port map lux-smb: allow_from",
        "\t\tip saddr 203.0.113.0/24 tcp dport 4445 accept",
        "\t\tip6 saddr 2001:db8:42::/48 tcp dport 4445 accept",
        "\t\t# port map qfox-ssh: allow_from (open to everyone)",
        "\t\tip saddr 0.0.0.0/0 tcp dport 2222 accept",
        "\t\tip6 saddr ::/0 tcp dport 2222 accept",
        "\t\ttcp dport { 2222, 4445 } drop",
    ]
    assert "this host and the\n\t# networks a port map's allow_from names" in nft


def test_one_opened_port_map_leaves_the_other_tailnet_only(tmp_path: Path) -> None:
    nft = files(load_desired(opened(tmp_path, ssh='allow_from = ["198.51.100.0/24"]\n', smb="")), "racknerd")["etc/fabric/fabric.nft"]
    rules = [line.strip() for line in nft.splitlines() if "saddr" in line]
    assert rules == [
        'iifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept',
        'iifname "tailscale0" ip6 saddr fd7a:115c:a1e0::/48 tcp dport { 2222, 4445 } accept',
        "ip saddr 198.51.100.0/24 tcp dport 2222 accept",
    ]


def test_a_udp_port_map_is_opened_with_udp_rules(tmp_path: Path) -> None:
    desired = opened(tmp_path, ssh="", smb='allow_from = ["203.0.113.0/24"]\n')
    fleet = (desired / "fabric.toml").read_text()
    (desired / "fabric.toml").write_text(fleet.replace('name = "lux-smb"\n', 'name = "lux-smb"\nprotocol = "udp"\n'))
    nft = files(load_desired(desired), "racknerd")["etc/fabric/fabric.nft"]
    assert "ip saddr 203.0.113.0/24 udp dport 4445 accept\n\t\tudp dport { 4445 } drop" in nft
    assert "tcp dport 4445" not in nft


def test_without_allow_from_the_table_is_the_golden_one() -> None:
    golden = (Path(__file__).resolve().parents[1] / "golden" / "render" / "racknerd" / "etc" / "fabric" / "fabric.nft").read_text()
    assert files(load_desired(EXAMPLE_FLEET), "racknerd")["etc/fabric/fabric.nft"] == golden


def test_other_hosts_are_not_opened(tmp_path: Path) -> None:
    state = load_desired(opened(tmp_path))
    for host in ("qfox-1", "lux"):
        assert "allow_from" not in files(state, host)["etc/fabric/fabric.nft"]


# --------------------------------------------------------------------------
# Said: fabric plan, fabric status, the status page


def test_render_notes_say_open_to_everyone(tmp_path: Path) -> None:
    rendered = render(load_desired(opened(tmp_path)), "racknerd", facts("racknerd"), golden_plan())
    assert rendered.notes == (
        "port map lux-smb: tcp 4445 on racknerd is open beyond the tailnet to 203.0.113.0/24, 2001:db8:42::/48 (allow_from)",
        "port map qfox-ssh: tcp 2222 on racknerd is open to everyone (allow_from 0.0.0.0/0, ::/0), not only the tailnet",
    )
    assert render(load_desired(EXAMPLE_FLEET), "racknerd", facts("racknerd"), golden_plan()).notes == ()
    assert render(load_desired(opened(tmp_path / "again")), "qfox-1", facts("qfox-1"), golden_plan()).notes == ()


def test_fabric_plan_prints_the_exposure_as_notes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = Fleet(tmp_path, "racknerd")
    fleet.edit_fleet(SSH, SSH + EVERYONE)
    argv = cli_pass(fleet, "--plan-file", str(GOLDEN / "fleet-plan.json"), command="plan")

    code, out, err = fabric(capsys, *argv)
    assert code == 0
    assert "note: port map qfox-ssh: tcp 2222 on racknerd is open to everyone (allow_from 0.0.0.0/0, ::/0), not only the tailnet" in err.splitlines()
    assert "would load the nftables table inet fabric" in out

    code, out, _ = fabric(capsys, *argv, "--json")
    assert code == 0
    # The golden capture has no Tailscale: lux-smb, tailnet only, listens on loopback and says so.
    assert json.loads(out)["notes"] == [
        "port map lux-smb: listens on 127.0.0.1 only: this host's tailnet address is unknown (the probe found none: tailscale: not installed)",
        "port map qfox-ssh: tcp 2222 on racknerd is open to everyone (allow_from 0.0.0.0/0, ::/0), not only the tailnet",
    ]


def status_of(state: DesiredState) -> str:
    return render_text(fleet_status(state, Snapshot(now=NOW), None, NOW))


def test_fabric_status_lists_the_port_maps_open_beyond_the_tailnet(tmp_path: Path) -> None:
    state = load_desired(opened(tmp_path))
    text = status_of(state)
    assert text.splitlines()[-4:] == [
        "EXPOSURE · port maps open beyond the tailnet (2)",
        "  PORT MAP  ON                 OPEN TO",
        "  lux-smb   racknerd tcp 4445  203.0.113.0/24, 2001:db8:42::/48",
        "  qfox-ssh  racknerd tcp 2222  everyone (0.0.0.0/0, ::/0)",
    ]
    doc = status_document(fleet_status(state, Snapshot(now=NOW), None, NOW))
    assert doc["exposure"] == [
        {
            "port_map": "lux-smb",
            "host": "racknerd",
            "protocol": "tcp",
            "port": 4445,
            "allow_from": ["203.0.113.0/24", "2001:db8:42::/48"],
            "everyone": False,
        },
        {"port_map": "qfox-ssh", "host": "racknerd", "protocol": "tcp", "port": 2222, "allow_from": ["0.0.0.0/0", "::/0"], "everyone": True},
    ]


def test_fabric_status_of_a_tailnet_only_fleet_says_so() -> None:
    state = load_desired(EXAMPLE_FLEET)
    assert status_of(state).splitlines()[-2:] == [
        "EXPOSURE · port maps open beyond the tailnet (0)",
        "  (none: every port map is reachable from the tailnet only)",
    ]
    assert status_document(fleet_status(state, Snapshot(now=NOW), None, NOW))["exposure"] == []


def test_the_status_page_has_an_exposure_line(tmp_path: Path) -> None:
    page = render_status_page(load_desired(opened(tmp_path)), Snapshot(now=NOW), None, NOW)
    line = page[page.index('<p id="exposure"') : page.index("</p>", page.index('<p id="exposure"'))]
    assert 'class="exposed"' in line
    assert (
        '<span class="exposure" data-port-map="qfox-ssh" data-everyone="true"><strong>qfox-ssh</strong> (racknerd tcp 2222) to <strong>everyone (0.0.0.0/0, ::/0)</strong></span>'
        in line
    )
    assert (
        '<span class="exposure" data-port-map="lux-smb"><strong>lux-smb</strong> (racknerd tcp 4445) to 203.0.113.0/24, 2001:db8:42::/48</span>'
        in line
    )

    tailnet_only = render_status_page(load_desired(EXAMPLE_FLEET), Snapshot(now=NOW), None, NOW)
    assert '<p id="exposure">exposure: tailnet only (no port map has allow_from)</p>' in tailnet_only
    assert "data-everyone" not in tailnet_only
