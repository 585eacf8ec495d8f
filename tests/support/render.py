"""The example fleet's renders: a host's files for the golden fleet plan and
simple probe facts (tests/unit/test_render.py holds the golden texts' test)."""

from __future__ import annotations

import tomllib

from reconciler.core.desired.model import DesiredState, Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import render
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden"


def golden_plan(**changes: object) -> FleetPlan:
    plan = FleetPlan.model_validate_json((GOLDEN / "fleet-plan.json").read_text())
    return plan.model_copy(update=changes)


def example_address(host: str) -> str | None:
    """The example host's declared (tailnet) address, None for a host not in hosts/."""
    path = REPO / "hosts" / f"{host}.toml"
    return tomllib.loads(path.read_text())["host"]["address"] if path.exists() else None


def facts(host: str, arch: str | None = None, **extra: object) -> HostFacts:
    """Probe facts of an example host: its tailnet address is its declared one
    (give tailscale_ip=None for a probe that found no Tailscale)."""
    arch = arch or ("aarch64" if host == "a1-arm64" else "x86_64")
    extra.setdefault("tailscale_ip", example_address(host))
    return HostFacts(node_id=host, k3s_hostname=host, hardware=Hardware(arch=arch), tier="cpu_ffmpeg", **extra)  # type: ignore[arg-type]


def files(state: DesiredState, host: str, plan: FleetPlan | None = None, **kw: object) -> dict[str, str]:
    rendered = render(state, host, kw.pop("node_facts", None) or facts(host), plan or golden_plan(), **kw)  # type: ignore[arg-type]
    return {a.path: a.content for a in rendered.artifacts}
