"""select_worker and adaptive calls for a Ray driver: the live registry in, a pinned Ray task out.

The decision is the core's (`ray_tasks.select_assignment`: the scheduler's
rules over the registry's nodes that run a live Ray node); this module reads
what it needs and submits:

- the registry's snapshot, read at every call (the seed's "picks the best node
  AT CALL TIME"), through the same `Registry` port and wiring `fabric` uses;
- Ray's node table, which maps a fabric host to its Ray node by the host label
  the fabric rendered (`render.ray_node.HOST_LABEL`); it is re-read when older
  than `node_table_max_age_s` or when a chosen host has no Ray node;
- the tasks this driver sent that still run, per host: a task sent since a
  host's last beat holds its slot (the host's beat does not count Ray tasks;
  the leader adds them to its own snapshot from Ray's state API).

Each call is pinned with NodeAffinitySchedulingStrategy(soft=False): Ray runs it
on that node or fails it, never elsewhere. It also asks for one unit of the
assigned tier's resource, which the node offers as many times as its
max_concurrent_tasks, so Ray itself holds the fabric's concurrency too.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from reconciler.core.desired.model import FleetConfig, Tier
from reconciler.core.live.models import Snapshot
from reconciler.core.render.ray_node import HOST_LABEL, tier_resource
from reconciler.core.scheduling.placement import Strategy
from reconciler.core.scheduling.ray_tasks import LOWEST_TIER, FallbackCount, NodeAssignment, Requirement, select_assignment
from reconciler.ports import Registry


class CapacityError(RuntimeError):
    """No Ray node of the fleet can take the call now (or ever: `inadmissible`); the reason says why."""

    def __init__(self, reason: str, *, inadmissible: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.inadmissible = inadmissible


def ray_node_ids() -> dict[str, str]:
    """Fabric host -> the node id of its live Ray node, by the host label the fabric rendered."""
    ids: dict[str, str] = {}
    for node in ray.nodes():
        host = (node.get("Labels") or {}).get(HOST_LABEL)
        if node.get("Alive") and host:
            ids[host] = node["NodeID"]
    return ids


def open_fabric_registry(where: str | Path) -> Registry:
    """The fleet's registry as `fabric` opens it: `where` is a desired-state
    directory (its fabric.toml's [registry]), a sqlite registry file, or an
    etcd endpoint URL (comma-separated for several)."""
    from reconciler.wiring import open_existing_registry

    text = str(where)
    if text.startswith(("http://", "https://")):
        return open_existing_registry(_reader_config({"backend": "etcd", "endpoints": text.split(",")}))
    path = Path(where)
    if path.is_dir():
        fleet = FleetConfig.model_validate(tomllib.loads((path / "fabric.toml").read_text()))
        return open_existing_registry(fleet)
    return open_existing_registry(_reader_config({"backend": "sqlite"}), sqlite_path=path)


def _reader_config(registry: dict[str, Any]) -> FleetConfig:
    """The fabric.toml of a client that only reads the registry: [registry] as
    given, the default timings; the [fleet] section a fabric.toml must have is
    never read by a client that does not campaign."""
    fleet = {"domain": "fabric.invalid", "leader_candidates": ["ray-driver"]}
    return FleetConfig.model_validate({"fleet": fleet, "registry": registry})


class Dispatcher:
    """select_worker and the adaptive calls over one registry (module docstring)."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        *,
        strategy: Strategy = "highest_tier",
        node_table_max_age_s: float = 1.0,
    ) -> None:
        self._snapshot = snapshot
        self.strategy: Strategy = strategy
        self.node_table_max_age_s = node_table_max_age_s
        self.fallbacks = FallbackCount()
        self._nodes: dict[str, str] = {}
        self._nodes_read = float("-inf")
        self._running: list[tuple[str, ray.ObjectRef]] = []

    @classmethod
    def connect(cls, where: str | Path, **kwargs: Any) -> Dispatcher:
        registry = open_fabric_registry(where)
        return cls(registry.snapshot, **kwargs)

    # -- what the decision reads ----------------------------------------------

    def ray_nodes(self, *, fresh: bool = False) -> dict[str, str]:
        """Fabric host -> Ray node id, re-read when older than node_table_max_age_s."""
        now = time.monotonic()
        if fresh or now - self._nodes_read > self.node_table_max_age_s:
            self._nodes = ray_node_ids()
            self._nodes_read = now
        return self._nodes

    def own_in_flight(self) -> dict[str, int]:
        """The tasks this driver sent that have not finished, per host."""
        if self._running:
            refs = [ref for _, ref in self._running]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            still = set(pending)
            self._running = [(host, ref) for host, ref in self._running if ref in still]
        counts: dict[str, int] = {}
        for host, _ in self._running:
            counts[host] = counts.get(host, 0) + 1
        return counts

    # -- the seed's API ---------------------------------------------------------

    def select_worker(self, requirement: Requirement) -> NodeAssignment:
        """The node for `requirement` now, or deferred with the reason; fallbacks are counted."""
        assignment = select_assignment(
            self._snapshot(), requirement, ray_hosts=self.ray_nodes(), own_in_flight=self.own_in_flight(), strategy=self.strategy
        )
        self.fallbacks.count(assignment)
        return assignment

    def submit(self, function: Any, requirement: Requirement, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Run the remote `function` on the node select_worker chose; CapacityError when none."""
        assignment = self.select_worker(requirement)
        if assignment.status != "assigned":
            raise CapacityError(assignment.reason or "deferred", inadmissible=assignment.inadmissible)
        assert assignment.host is not None and assignment.tier is not None
        node_id = self.ray_nodes().get(assignment.host) or self.ray_nodes(fresh=True).get(assignment.host)
        if node_id is None:
            raise CapacityError(f"{assignment.host} has no live Ray node any more", inadmissible=False)
        ref = function.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            resources={tier_resource(assignment.tier): 1},
        ).remote(*args, **kwargs)
        self._running.append((assignment.host, ref))
        return ref

    def adaptive_remote(self, function: Any, *, min_tier: Tier, floor: Tier = LOWEST_TIER) -> AdaptiveFunction:
        """`function` (a ray.remote function) placed at every `.remote(...)` call."""
        return AdaptiveFunction(self, function, min_tier, floor)

    def adaptive_compute(self, function: Any, data: Any, *, min_tier: Tier, floor: Tier = LOWEST_TIER) -> ray.ObjectRef:
        """The seed's adaptive_compute: `function(data)` on the best node for min_tier at call time."""
        return self.adaptive_remote(function, min_tier=min_tier, floor=floor).remote(data)


class AdaptiveFunction:
    """A remote function whose every call is placed by the fabric."""

    def __init__(self, dispatcher: Dispatcher, function: Any, min_tier: Tier, floor: Tier) -> None:
        self._dispatcher = dispatcher
        self._function = function
        self._min_tier = min_tier
        self._floor = floor

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        payload = len(args[0]) if args and isinstance(args[0], Sized) else 0
        requirement = Requirement(min_tier=self._min_tier, payload_size=payload, floor=self._floor)
        return self._dispatcher.submit(self._function, requirement, *args, **kwargs)
