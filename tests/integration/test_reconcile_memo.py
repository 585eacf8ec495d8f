"""The memoized pass against real systemd and nft: it does nothing while nothing
changes, and the world's drift (a rendered file edited, a unit stopped, the
table flushed) makes the next pass a full one that repairs it.

The edge host "racknerd" of the example fleet in a systemd container, as in
test_reconcile_activation.py (tests/support/edge_host.py, and its pass).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.edge_host import edge_container, invocation, reconcile
from tests.support.harness.systemd import SystemdContainer
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration

MEMO = "/var/lib/fabric/pass-memo.json"
UNITS = ("fabric-socat-qfox-ssh.service", "fabric-socat-lux-smb.service", "fabric-nftables.service")
DROP_RULE = "tcp dport { 2222, 4445 } drop"


@pytest.fixture(scope="module")
def edge() -> Iterator[SystemdContainer]:
    with edge_container() as container:
        container.write_file("/etc/caddy/Caddyfile", "{\n\tadmin localhost:2019\n\tauto_https off\n}\n")
        assert container.systemctl("daemon-reload").returncode == 0
        assert container.systemctl("start", "caddy.service").returncode == 0
        yield container


def memo_written_at(container: SystemdContainer) -> float:
    return float(json.loads(container.read_file(MEMO))["written_at"])


def memoized_noop(container: SystemdContainer) -> None:
    """A pass that finds nothing: nothing restarted, no file rewritten, the memo kept as it was."""
    ids = {unit: invocation(container, unit) for unit in UNITS}
    written_at = memo_written_at(container)
    done = reconcile(container)
    assert done.returncode == 0 and done.stdout == "nothing to do (generation 1)\n", done.stdout + done.stderr
    assert "drift" not in done.stderr
    assert memo_written_at(container) == written_at  # a full pass would have written a new memo
    assert {unit: invocation(container, unit) for unit in UNITS} == ids


def repaired(container: SystemdContainer, drift: str) -> str:
    done = reconcile(container)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"note: drift since the last pass: {drift}; full pass" in done.stderr, done.stderr
    return done.stdout


def test_the_memoized_pass_repairs_an_edited_file_a_stopped_unit_and_a_flushed_table(edge: SystemdContainer) -> None:
    first = reconcile(edge)
    assert first.returncode == 0 and "generation 1 is active" in first.stdout, first.stdout + first.stderr
    for unit in UNITS:
        assert edge.systemctl("is-active", unit).stdout.strip() == "active", unit
    memoized_noop(edge)

    # A rendered file edited by hand: written back (the generation's copy).
    snippet = "/etc/caddy/fabric.caddy"
    good = edge.read_file(snippet)
    edge.write_file(snippet, "# edited by hand\n")
    out = repaired(edge, "etc/caddy/fabric.caddy was changed")
    assert "etc/caddy/fabric.caddy" in out
    assert edge.read_file(snippet) == good
    memoized_noop(edge)

    # A unit stopped: started again.
    assert edge.systemctl("stop", "fabric-socat-lux-smb.service").returncode == 0
    out = repaired(edge, "fabric-socat-lux-smb.service is inactive, was active")
    assert "fabric-socat-lux-smb.service" in out
    wait_until(lambda: edge.systemctl("is-active", "fabric-socat-lux-smb.service").stdout.strip() == "active", what="lux-smb started again")
    memoized_noop(edge)

    # The table flushed (still loaded, but empty): loaded again.
    assert edge.run("nft", "flush", "table", "inet", "fabric").returncode == 0
    assert DROP_RULE not in edge.run("nft", "list", "table", "inet", "fabric").stdout
    out = repaired(edge, "the nftables table changed")
    assert "nftables" in out
    assert DROP_RULE in edge.run("nft", "list", "table", "inet", "fabric").stdout
    memoized_noop(edge)
