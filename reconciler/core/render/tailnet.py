"""The tailnet as the fabric's edge rules see it: Tailscale's address ranges,
and this host's own tailnet address as its probe found it.

Tailnet-only means three things on a host (issue 36, item 6): the table
`inet fabric` accepts the ranges below on the fabric's ports only when they
arrive on the host's tailnet interface (`HostSettings.tailnet_interface`); a
port map's socat listens on the host's tailnet address (`tailnet_address`);
the edge's status page answers only these ranges (`[fleet] status_access`).
"""

from __future__ import annotations

import ipaddress

from reconciler.core.desired.model import HostFacts

# Tailscale's address ranges: CGNAT IPv4 and its IPv6 ULA prefix.
TAILNET = "100.64.0.0/10"
TAILNET6 = "fd7a:115c:a1e0::/48"
TAILNET_RANGES = (TAILNET, TAILNET6)

# Where a port map listens while the probe knows no tailnet address.
LOOPBACK = "127.0.0.1"


def tailnet_address(facts: HostFacts, ranges: tuple[str, ...] = TAILNET_RANGES) -> str | None:
    """The probe's tailnet IP of this host when it lies in the tailnet's
    ranges; None when the probe found none (Tailscale absent, not running,
    timed out) or an address outside them."""
    if facts.tailscale_ip is None:
        return None
    try:
        address = ipaddress.ip_address(facts.tailscale_ip)
    except ValueError:
        return None
    if not any(address in ipaddress.ip_network(cidr) for cidr in ranges if ipaddress.ip_network(cidr).version == address.version):
        return None
    return str(address)


def unknown_reason(facts: HostFacts) -> str:
    """Why `tailnet_address` is None, in the probe's words where it has some."""
    if facts.tailscale_ip is None:
        return f"the probe found none: {facts.missing['tailscale']}" if "tailscale" in facts.missing else "the probe found none"
    return f"the probe's {facts.tailscale_ip[:60]!r} is not in the tailnet's ranges ({', '.join(TAILNET_RANGES)})"
