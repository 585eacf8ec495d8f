"""Is the probed machine the one the host file describes? (pure)

A host file may declare the machine's tailnet name (`[host] tailnet_name`);
the probe reads the name Tailscale gives the machine. When both are known and
differ, the host file names another machine (a copied host file, a renamed
or re-joined machine, `--host` pointing at the wrong host): the pass says so.
It does not stop: the name is an identity check for the operator, and the
address other hosts reach this one on is declared separately.
"""

from __future__ import annotations

from reconciler.core.desired.model import DesiredState, HostFacts


def probed_tailnet_name(facts: HostFacts) -> str | None:
    """The machine's tailnet DNS name, or None when the probe did not get one.

    Without one the probe reports the host name in its place (see
    `tiering.build_node_facts`), which is also its `k3s_hostname`.
    """
    if "tailscale" in facts.missing or facts.tailnet_name in (facts.k3s_hostname, "unknown"):
        return None
    return facts.tailnet_name


def tailnet_name_note(desired: DesiredState, host: str, facts: HostFacts) -> str | None:
    """A note when the probe's tailnet name differs from the one `host`'s file declares; else None."""
    config = desired.hosts.get(host)
    declared = config.host.tailnet_name if config is not None else None
    found = probed_tailnet_name(facts)
    if declared is None or found is None:
        return None
    if found.rstrip(".").lower() == declared.rstrip(".").lower():
        return None
    return (
        f"host {host}: the probe finds tailnet name {found!r}, but the host file declares tailnet_name {declared!r}: "
        "is this the machine the host file describes? (fix [host] tailnet_name, or --host)"
    )
