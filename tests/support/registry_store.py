"""A registry under test: a sqlite file or a private prefix of a real etcd.

Shared by the registry, lane-queue and leader tests so every behaviour is
checked on both backends the same way (the `store` fixture in conftest.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from reconciler.core.desired.model import FleetConfig
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.ports import Clock, Registry
from reconciler.wiring import open_registry
from tests.support.plan_keys import SignedFleet, signed_example_fleet

# The example fleet's [registry] lines, replaced to point at a store.
_EXAMPLE_REGISTRY = 'backend = "sqlite"        # embedded default; "etcd" for the fleet\npath = "/var/lib/fabric/registry.sqlite"'


@dataclass
class Store:
    backend: str
    settings: dict
    sqlite_path: str | None
    # None: the registry's own system clock; a FakeClock moves by hand.
    clock: Clock | None = None
    opened: list = field(default_factory=list)
    signed: SignedFleet | None = None
    # More sections of fabric.toml for the registries `open` makes ([timing], [flap]).
    config: dict = field(default_factory=dict)

    def fleet(self) -> FleetConfig:
        return FleetConfig.model_validate(
            {"fleet": {"domain": "t.example", "leader_candidates": ["lux", "qfox-1"]}, "registry": self.settings, **self.config}
        )

    def open(self, clock: Clock | None = None) -> Registry:
        registry = open_registry(self.fleet(), clock=clock or self.clock, sqlite_path=self.sqlite_path)
        self.opened.append(registry)
        return registry

    def close(self) -> None:
        """Close every registry `open` made."""
        while self.opened:
            self.opened.pop().close()

    def as_json(self) -> str:
        """What a child process needs to open the same store."""
        return json.dumps({"registry": self.settings, "sqlite_path": self.sqlite_path})

    def desired_dir(self, tmp: Path) -> Path:
        """The example fleet with [registry] pointing at this store (for CLI
        processes), and throwaway plan keys: `self.signed.key_file(host)` is a
        candidate's --plan-key-file."""
        self.signed = signed_example_fleet(tmp)
        target = self.signed.desired
        text = (target / "fabric.toml").read_text()
        assert _EXAMPLE_REGISTRY in text
        if self.backend == "etcd":
            endpoints = ", ".join(f'"{e}"' for e in self.settings["endpoints"])
            new = f'backend = "etcd"\nendpoints = [{endpoints}]\nprefix = "{self.settings["prefix"]}"'
        else:
            new = f'backend = "sqlite"\npath = "{self.sqlite_path}"'
        (target / "fabric.toml").write_text(text.replace(_EXAMPLE_REGISTRY, new))
        return target


# -- small helpers the registry suites share ---------------------------------


def record(node: str, tier: str = "cpu_ffmpeg", **kw: object) -> NodeRecord:
    """A node's heartbeat record (limit 2 unless given)."""
    limit = kw.pop("max_concurrent_tasks", 2)
    return NodeRecord(node_id=node, tier=tier, max_concurrent_tasks=limit, **kw)  # type: ignore[arg-type]


# The example fleet's hosts as the scale tests and bench/leader_scale beat
# them: (tier, arch, max_concurrent_tasks).
EXAMPLE_HOSTS = {
    "qfox-1": ("gpu_cuda", "x86_64", 4),
    "a1-arm64": ("cpu_ffmpeg", "aarch64", 2),
    "x86-spill": ("cpu_ffmpeg", "x86_64", 4),
    "lux": ("cpu_ffmpeg", "x86_64", 2),
    "racknerd": ("relay", "x86_64", 1),
}


def scale_fleet_records(others: list[str]) -> list[NodeRecord]:
    """The example fleet's hosts, then `others` as small x86 ffmpeg nodes (limit 2)."""
    records = [NodeRecord(node_id=h, tier=tier, arch=arch, max_concurrent_tasks=limit) for h, (tier, arch, limit) in EXAMPLE_HOSTS.items()]
    return records + [NodeRecord(node_id=n, tier="cpu_ffmpeg", arch="x86_64", max_concurrent_tasks=2) for n in others]


def example_record(host: str, **changes: object) -> NodeRecord:
    """`host`'s heartbeat as the example fleet's (tier, arch, limit of EXAMPLE_HOSTS)."""
    tier, arch, limit = EXAMPLE_HOSTS[host]
    values: dict = {"node_id": host, "tier": tier, "arch": arch, "max_concurrent_tasks": limit, **changes}
    return NodeRecord(**values)


def beat_example_fleet(registry: Registry, ttl_s: float | None = 86_400, hosts: list[str] | None = None) -> None:
    """A heartbeat from every example host (or `hosts`): their lanes come
    online (a lane is as healthy as its agent host). The long TTL keeps them
    alive while a test moves its clock by hand; None: the fleet's node timeout."""
    for host in hosts or list(EXAMPLE_HOSTS):
        registry.heartbeat(example_record(host), ttl_s)


@contextmanager
def beating_registry(tmp_path: Path, fleet: SignedFleet) -> Iterator[Registry]:
    """A real sqlite registry (tmp_path/registry.sqlite) with every example host's heartbeat."""
    from reconciler.adapters.clock import SystemClock
    from reconciler.adapters.registry_sqlite import SqliteRegistry
    from reconciler.core.desired.load import load_desired

    desired = load_desired(fleet.desired)
    reg = SqliteRegistry(tmp_path / "registry.sqlite", timing=desired.fleet.timing, flap=desired.fleet.flap, clock=SystemClock())
    try:
        beat_example_fleet(reg)
        yield reg
    finally:
        reg.close()


def status_of(registry: Registry, node: str) -> str | None:
    return next((s.status for s in registry.node_states() if s.node_id == node), None)


def leader_name(registry: Registry) -> str | None:
    info = registry.leader()
    return info.candidate if info else None


def a_plan() -> FleetPlan:
    return FleetPlan(epoch=0, leader="whoever", created=datetime.now(UTC))
