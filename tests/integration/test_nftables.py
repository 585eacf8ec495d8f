"""NftCommand with the real nft inside a network namespace, checked with real traffic.

Two namespaces joined by a veth: `client` 10.250.1.1 and `server` 10.250.1.2.
The server runs TCP listeners on 8080 and 8081; the table `inet fabric` is
loaded in the server's namespace and connections from the client show what it
lets through, drops or forwards. The rendered template's tests play the
tailnet with 10.250.1.0/24 and the world outside it with 10.250.2-3.0/24
(a port map's allow_from); the server's end of the tailnet's link is named
tailscale0, as the rules match the interface as well as the range. The
forged-source test uses the real rendered table and Tailscale's own range.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import jinja2
import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.nftables import NftCommand
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts, PortMap
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import TEMPLATES_DIR, nft_opening, render
from reconciler.ports import ActivationError
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.netns import Namespace, network_lab, tcp_probe

pytestmark = pytest.mark.integration

SERVER_ADDRESS = "10.250.1.2"

# Shaped like the rendered fabric table: accept the fabric's ports from the
# fabric's own network (here the test subnet stands in for the tailnet), and a
# declared port forward 9090 -> 8080.
FABRIC_ALLOWS_8080 = """\
table inet fabric {
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		iifname "lo" accept
		ip saddr 10.250.1.0/24 tcp dport 8080 accept
	}

	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		tcp dport 9090 redirect to :8080
	}
}
"""

FABRIC_ALLOWS_8081 = FABRIC_ALLOWS_8080.replace("tcp dport 8080 accept", "tcp dport 8081 accept")

# A typo ("acept"): nft refuses to parse it.
FABRIC_BROKEN = FABRIC_ALLOWS_8080.replace("tcp dport 8080 accept", "tcp dport 8080 acept")

# Somebody else's table that must survive every fabric load.
OTHER_TABLE = """\
table ip other {
	set keep {
		type ipv4_addr
		elements = { 10.250.9.9 }
	}
}
"""


@dataclass
class Topology:
    client: Namespace
    server: Namespace
    nft: NftCommand

    def fabric_table(self) -> str:
        return self.server.check("nft", "list", "table", "inet", "fabric")

    def other_table(self) -> str:
        return self.server.check("nft", "list", "table", "ip", "other")

    def probe(self, port: int) -> str:
        return tcp_probe(self.client, SERVER_ADDRESS, port)


@pytest.fixture
def topology() -> Iterator[Topology]:
    require_root()
    require("ip", "nft", "socat", "python3", "ss")
    with network_lab() as lab:
        client, server = lab.namespace("client"), lab.namespace("server")
        lab.link(client, "10.250.1.1/24", server, f"{SERVER_ADDRESS}/24")
        for port in (8080, 8081):
            server.spawn("socat", f"TCP-LISTEN:{port},fork,reuseaddr", "EXEC:/bin/cat")
        for port in (8080, 8081):
            server.wait_listening(port)
        server.check("nft", "-f", "-", input=OTHER_TABLE)
        yield Topology(client, server, NftCommand(SubprocessRunner(), prefix=server.exec_prefix))


def test_ruleset_lets_through_drops_and_forwards_as_declared(topology: Topology) -> None:
    # Without the table both listeners answer: any later timeout is the ruleset's doing.
    assert topology.probe(8080) == "connected"
    assert topology.probe(8081) == "connected"

    topology.nft.check(FABRIC_ALLOWS_8080)
    topology.nft.apply(FABRIC_ALLOWS_8080)

    assert topology.probe(8080) == "connected"
    assert topology.probe(8081) == "timeout"  # dropped by policy
    assert topology.probe(9090) == "connected"  # the port forward to 8080


def test_loading_replaces_the_table_rather_than_adding_to_it(topology: Topology) -> None:
    topology.nft.apply(FABRIC_ALLOWS_8080)
    topology.nft.apply(FABRIC_ALLOWS_8081)

    assert topology.probe(8081) == "connected"
    assert topology.probe(8080) == "timeout"  # the old accept rule is gone
    assert "dport 8080 accept" not in topology.fabric_table()


def test_table_loaded_tells_when_a_flush_dropped_the_table(topology: Topology) -> None:
    assert topology.nft.table_loaded() is False
    topology.nft.apply(FABRIC_ALLOWS_8080)
    assert topology.nft.table_loaded() is True
    # What a distro's own ruleset reload does (nftables.service: flush ruleset).
    topology.server.check("nft", "flush", "ruleset")
    assert topology.nft.table_loaded() is False


def test_reapplying_the_same_ruleset_changes_nothing(topology: Topology) -> None:
    topology.nft.apply(FABRIC_ALLOWS_8080)
    first = topology.fabric_table()
    topology.nft.apply(FABRIC_ALLOWS_8080)

    assert topology.fabric_table() == first
    assert first.count("tcp dport 8080 accept") == 1
    assert topology.probe(8080) == "connected"


def test_broken_ruleset_is_rejected_and_the_previous_table_stays_in_force(topology: Topology) -> None:
    topology.nft.apply(FABRIC_ALLOWS_8080)
    before = topology.fabric_table()

    with pytest.raises(ActivationError) as rejected_check:
        topology.nft.check(FABRIC_BROKEN)
    assert "acept" in str(rejected_check.value)  # nft's own words, pointing at the typo
    with pytest.raises(ActivationError):
        topology.nft.apply(FABRIC_BROKEN)

    assert topology.fabric_table() == before
    assert topology.probe(8080) == "connected"
    assert topology.probe(8081) == "timeout"


def test_other_tables_in_the_namespace_are_untouched(topology: Topology) -> None:
    other_before = topology.other_table()
    topology.nft.apply(FABRIC_ALLOWS_8080)
    topology.nft.apply(FABRIC_ALLOWS_8081)
    with pytest.raises(ActivationError):
        topology.nft.apply(FABRIC_BROKEN)

    assert topology.other_table() == other_before
    tables = topology.server.check("nft", "list", "tables").split("\n")
    assert sorted(t for t in tables if t) == ["table inet fabric", "table ip other"]


@pytest.mark.parametrize(
    "ruleset",
    [
        "flush ruleset\n" + FABRIC_ALLOWS_8080,
        FABRIC_ALLOWS_8080 + "delete table ip other\n",
        FABRIC_ALLOWS_8080 + "add rule ip other input drop\n",
    ],
    ids=["flush-ruleset", "delete-other-table", "rule-in-other-table"],
)
def test_ruleset_reaching_beyond_the_fabric_table_is_refused_before_nft_runs(topology: Topology, ruleset: str) -> None:
    topology.nft.apply(FABRIC_ALLOWS_8080)
    fabric_before, other_before = topology.fabric_table(), topology.other_table()

    with pytest.raises(ActivationError, match="beyond table inet fabric"):
        topology.nft.check(ruleset)
    with pytest.raises(ActivationError, match="beyond table inet fabric"):
        topology.nft.apply(ruleset)

    assert topology.fabric_table() == fabric_before
    assert topology.other_table() == other_before


def test_ruleset_that_replaces_the_table_itself_is_loaded_as_written(topology: Topology) -> None:
    self_replacing = "table inet fabric\ndelete table inet fabric\n" + FABRIC_ALLOWS_8081
    assert NftCommand.transaction(self_replacing) == self_replacing
    topology.nft.apply(FABRIC_ALLOWS_8080)
    topology.nft.apply(self_replacing)
    assert topology.probe(8081) == "connected"
    assert topology.probe(8080) == "timeout"


def test_missing_nft_program_is_an_activation_error() -> None:
    nft = NftCommand(SubprocessRunner(), nft="/nonexistent/nft")
    with pytest.raises(ActivationError, match="not installed"):
        nft.check(FABRIC_ALLOWS_8080)


def test_the_empty_ruleset_removes_only_the_fabric_table(topology: Topology) -> None:
    # What apply loads when a host no longer has a ruleset at all.
    topology.nft.apply(FABRIC_ALLOWS_8080)
    other_before = topology.other_table()

    topology.nft.apply("table inet fabric\ndelete table inet fabric\n")

    tables = [t for t in topology.server.check("nft", "list", "tables").split("\n") if t]
    assert tables == ["table ip other"]
    assert topology.other_table() == other_before
    assert topology.probe(8081) == "connected"


def render_fabric_template(**values: object) -> str:
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return environment.get_template("fabric.nft.j2").render(**values)


def test_rendered_fabric_template_admits_fabric_ports_from_the_fabric_network_only() -> None:
    """templates/fabric.nft.j2 with the tailnet played by 10.250.1.0/24: a fabric
    port answers a peer inside it, is dropped for one outside it, and a port the
    fabric does not own is left to the host's own policy."""
    require_root()
    require("ip", "nft", "socat", "python3", "ss")
    ruleset = render_fabric_template(
        host="server", tailnet="10.250.1.0/24", tailnet_interface="tailscale0", tcp_ports=["8080"], udp_ports=[], openings=[], nftables_fix=True
    )
    with network_lab() as lab:
        peer, outsider, server = lab.namespace("peer"), lab.namespace("outsider"), lab.namespace("server")
        lab.link(peer, "10.250.1.1/24", server, f"{SERVER_ADDRESS}/24", b_name="tailscale0")
        lab.link(outsider, "10.250.2.1/24", server, "10.250.2.2/24")
        for port in (8080, 8081):
            server.spawn("socat", f"TCP-LISTEN:{port},fork,reuseaddr", "EXEC:/bin/cat")
        for port in (8080, 8081):
            server.wait_listening(port)
        nft = NftCommand(SubprocessRunner(), prefix=server.exec_prefix)

        nft.check(ruleset)
        nft.apply(ruleset)
        nft.apply(ruleset)  # the template's own prologue keeps a second load idempotent

        assert tcp_probe(peer, SERVER_ADDRESS, 8080) == "connected"
        assert tcp_probe(outsider, "10.250.2.2", 8080) == "timeout"
        assert tcp_probe(outsider, "10.250.2.2", 8081) == "connected"
        listed = server.check("nft", "list", "table", "inet", "fabric")
        assert listed.count("tcp dport 8080 accept") == 1
        assert 'iifname "tailscale0" accept' in listed  # the CachyOS/Arch forward fix loaded


# --------------------------------------------------------------------------
# allow_from: a port map opened beyond the tailnet


def port_map(name: str, port: int, allow_from: list[str]) -> PortMap:
    return PortMap(name=name, host="server", listen_port=port, target_host="target", target_port=22, allow_from=allow_from)


def test_allow_from_opens_a_port_map_to_its_networks_and_leaves_the_others_closed() -> None:
    """The tailnet is played by 10.250.1.0/24 (peer), the outside world by
    10.250.2.0/24 (near) and 10.250.3.0/24 (far). Port map `opened` (8080)
    allows near's network, `closed` (8081) allows nobody beyond the tailnet,
    `everyone` (8082) allows 0.0.0.0/0 and ::/0."""
    require_root()
    require("ip", "nft", "socat", "python3", "ss")
    maps = [port_map("closed", 8081, []), port_map("everyone", 8082, ["0.0.0.0/0", "::/0"]), port_map("opened", 8080, ["10.250.2.0/24"])]
    ruleset = render_fabric_template(
        host="server",
        tailnet="10.250.1.0/24",
        tailnet_interface="tailscale0",
        tcp_ports=["8080", "8081", "8082"],
        udp_ports=[],
        openings=[nft_opening(m) for m in maps if m.allow_from],
        nftables_fix=False,
    )
    with network_lab() as lab:
        peer, near, far, server = lab.namespace("peer"), lab.namespace("near"), lab.namespace("far"), lab.namespace("server")
        lab.link(peer, "10.250.1.1/24", server, f"{SERVER_ADDRESS}/24", b_name="tailscale0")
        lab.link(near, "10.250.2.1/24", server, "10.250.2.2/24")
        lab.link(far, "10.250.3.1/24", server, "10.250.3.2/24")
        for port in (8080, 8081, 8082):
            server.spawn("socat", f"TCP-LISTEN:{port},fork,reuseaddr", "EXEC:/bin/cat")
        for port in (8080, 8081, 8082):
            server.wait_listening(port)
        nft = NftCommand(SubprocessRunner(), prefix=server.exec_prefix)

        nft.check(ruleset)
        nft.apply(ruleset)
        first = server.check("nft", "list", "table", "inet", "fabric")
        nft.apply(ruleset)  # idempotent: the same table, not a second copy of each rule
        assert server.check("nft", "list", "table", "inet", "fabric") == first
        assert first.count("ip saddr 10.250.2.0/24 tcp dport 8080 accept") == 1
        assert first.count("ip saddr 0.0.0.0/0 tcp dport 8082 accept") == 1
        assert first.count("ip6 saddr ::/0 tcp dport 8082 accept") == 1

        # The tailnet reaches every port map.
        assert [tcp_probe(peer, SERVER_ADDRESS, port) for port in (8080, 8081, 8082)] == ["connected"] * 3
        # A client outside the tailnet reaches the port map opened to its network, not the closed one.
        assert tcp_probe(near, "10.250.2.2", 8080) == "connected"
        assert tcp_probe(near, "10.250.2.2", 8081) == "timeout"
        # Another outside network: only the port map open to everyone.
        assert tcp_probe(far, "10.250.3.2", 8080) == "timeout"
        assert tcp_probe(far, "10.250.3.2", 8081) == "timeout"
        assert tcp_probe(far, "10.250.3.2", 8082) == "connected"


def test_the_edge_table_with_allow_from_passes_nft_and_reloads_idempotently(tmp_path) -> None:
    """render() of the example fleet with both port maps opened (IPv4, IPv6 and
    everyone): the real nft accepts the table and a second load changes nothing."""
    require_root()
    require("ip", "nft")
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    fleet = (desired / "fabric.toml").read_text()
    fleet = fleet.replace("target_port = 22\n", 'target_port = 22\nallow_from = ["0.0.0.0/0", "::/0"]\n', 1)
    fleet = fleet.replace("target_port = 445\n", 'target_port = 445\nallow_from = ["10.250.2.0/24", "2001:db8:42::/48"]\n', 1)
    (desired / "fabric.toml").write_text(fleet)
    facts = HostFacts(node_id="racknerd", k3s_hostname="racknerd", hardware=Hardware(arch="x86_64"), tier="relay")
    plan = FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())
    [ruleset] = [a.content for a in render(load_desired(desired), "racknerd", facts, plan).artifacts if a.kind == "nft"]
    assert "ip6 saddr 2001:db8:42::/48 tcp dport 4445 accept" in ruleset
    with network_lab() as lab:
        server = lab.namespace("edge")
        nft = NftCommand(SubprocessRunner(), prefix=server.exec_prefix)
        nft.check(ruleset)
        nft.apply(ruleset)
        first = server.check("nft", "list", "table", "inet", "fabric")
        # What fabric-nftables.service runs (`nft -f`), without the adapter's
        # transaction: the file's own prologue keeps the reload idempotent.
        server.check("nft", "-f", "-", input=ruleset)
        assert server.check("nft", "list", "table", "inet", "fabric") == first
        for rule in (
            'iifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept',
            "ip saddr 10.250.2.0/24 tcp dport 4445 accept",
            "ip6 saddr 2001:db8:42::/48 tcp dport 4445 accept",
            "ip saddr 0.0.0.0/0 tcp dport 2222 accept",
            "ip6 saddr ::/0 tcp dport 2222 accept",
            "tcp dport { 2222, 4445 } drop",
        ):
            assert first.count(rule) == 1, rule


# --------------------------------------------------------------------------
# The tailnet interface: a tailnet source on another interface is forged


def test_a_tailnet_source_is_accepted_on_the_tailnet_interface_and_dropped_on_another() -> None:
    """racknerd's table as render() writes it (100.64.0.0/10 on tailscale0,
    port maps 2222 and 4445). The peer reaches the server over the server's
    tailscale0; the forger, whose address (100.64.9.1) lies in the tailnet's
    range too, over another interface: what a spoofed tailnet source on the
    public interface looks like. Its packets to the fabric's ports are
    dropped, whichever of the server's addresses they aim at; a port the
    fabric does not own is left to the host."""
    require_root()
    require("ip", "nft", "socat", "python3", "ss")
    state = load_desired(EXAMPLE_FLEET)
    facts = HostFacts(node_id="racknerd", k3s_hostname="racknerd", hardware=Hardware(arch="x86_64"), tier="relay", tailscale_ip="100.101.7.2")
    plan = FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())
    [ruleset] = [a.content for a in render(state, "racknerd", facts, plan).artifacts if a.kind == "nft"]
    assert 'iifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept' in ruleset
    with network_lab() as lab:
        peer, forger, server = lab.namespace("peer"), lab.namespace("forger"), lab.namespace("edge")
        lab.link(peer, "100.101.7.1/24", server, "100.101.7.2/24", b_name="tailscale0")
        lab.link(forger, "100.64.9.1/24", server, "100.64.9.2/24")
        # The forger also aims at the server's tailnet address, through its own link.
        forger.check("ip", "route", "add", "100.101.7.2/32", "via", "100.64.9.2")
        for port in (2222, 4445, 8081):
            server.spawn("socat", f"TCP-LISTEN:{port},fork,reuseaddr", "EXEC:/bin/cat")
        for port in (2222, 4445, 8081):
            server.wait_listening(port)
        # Without the table the forger gets through: any later timeout is the table's doing.
        assert tcp_probe(forger, "100.64.9.2", 2222) == "connected"

        NftCommand(SubprocessRunner(), prefix=server.exec_prefix).apply(ruleset)

        assert [tcp_probe(peer, "100.101.7.2", port) for port in (2222, 4445)] == ["connected"] * 2
        assert [tcp_probe(forger, "100.64.9.2", port) for port in (2222, 4445)] == ["timeout"] * 2
        assert tcp_probe(forger, "100.101.7.2", 2222) == "timeout"
        assert tcp_probe(forger, "100.64.9.2", 8081) == "connected"
