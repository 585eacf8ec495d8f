"""A three-host desired state with one VA-API service, `enc`, for the leader's
liveness tests (suspicion, takeover, the edge's failed upstreams): each host
of `tiers` a compute node (roles of its own where given), `enc` placed by
tier, and the liveness records' timings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reconciler.core.desired.model import DesiredState, FleetConfig, HostConfig


def enc_fleet(
    tiers: Mapping[str, str],
    *,
    candidates: Sequence[str],
    liveness_s: int,
    liveness_ttl_s: int,
    singleton: bool = False,
    roles: Mapping[str, Sequence[str]] | None = None,
) -> DesiredState:
    fleet = FleetConfig.model_validate(
        {
            "fleet": {"domain": "example.test", "leader_candidates": list(candidates)},
            "timing": {"liveness_s": liveness_s, "liveness_ttl_s": liveness_ttl_s},
            "services": [{"id": "enc", "min_tier": "gpu_vaapi", "command": {"any": ["/bin/enc"]}, "singleton": singleton}],
        }
    )
    hosts = {
        name: HostConfig.model_validate({"host": {"name": name, "roles": list((roles or {}).get(name, ["compute"])), "address": f"100.64.0.{i + 1}"}})
        for i, name in enumerate(tiers)
    }
    return DesiredState(fleet=fleet, hosts=hosts)
