"""The e2e fleet's bridge keeps its own MAC address while hosts come and go
(tests/e2e/fleet.add_bridge): a bridge without one takes its lowest port's
and changes it when that port goes, which made phaze's broker on the bridge
a black hole for the other hosts after a node loss."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require, require_root
from tests.e2e.fleet import add_bridge, bridge_mac

pytestmark = pytest.mark.integration


def ip(*argv: str, check: bool = True) -> None:
    subprocess.run(["ip", *argv], check=check, capture_output=True, text=True)


def mac_of(link: str) -> str:
    return Path(f"/sys/class/net/{link}/address").read_text().strip()


def test_the_bridge_keeps_its_address_when_the_port_with_the_lowest_one_comes_and_goes() -> None:
    require_root()
    require("ip")
    tag = str(os.getpid() % 100000)
    bridge, port, peer = f"fbt{tag}", f"fbt{tag}p", f"fbt{tag}q"
    mac = bridge_mac(tag)
    add_bridge(bridge, mac)
    try:
        ip("link", "set", bridge, "up")
        # The lowest unicast MAC there is: a bridge without its own would take it.
        ip("link", "add", port, "address", "00:00:00:00:00:01", "type", "veth", "peer", "name", peer)
        ip("link", "set", port, "master", bridge, "up")
        assert mac_of(bridge) == mac
        ip("link", "del", port)
        assert mac_of(bridge) == mac
    finally:
        ip("link", "del", port, check=False)
        ip("link", "del", bridge, check=False)
