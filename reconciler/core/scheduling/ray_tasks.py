"""Ray tasks and the fleet: placing one at call time, Ray's view joining the
leader's snapshot, and which Ray workers to start or stop. Pure.

Placing a task (the seed's `select_worker`, "Ray integration with the scheduler")
    A driver asks for `Requirement(min_tier, payload_size, floor)`. The
    candidates are the registry's nodes that run a live Ray node (a host
    whose Ray node is gone cannot run a Ray task, whatever its record says),
    each loaded with what it reported (services and lane jobs as of its beat)
    plus the tasks this driver sent there that still run. Then exactly the
    scheduler's rules (`placement.Placer.place`): the highest tier at or above
    min_tier, the lowest utilization, fallback one tier at a time down to the
    floor, and a `deferred` assignment with the scheduler's reason when
    nothing is left (inadmissible when no node of the fleet could ever take
    it, e.g. CUDA-only work without a CUDA node). The seed's fallback goes
    down to tier 0 (relay), so that is the default floor; CUDA-only work
    says `floor="gpu_cuda"`.

Ray's view in the leader's snapshot (`with_ray_view`)
    The leader reads Ray's state API (the `RayState` port): the tasks running
    per fabric host and the hosts whose Ray node died. A node's Ray tasks are
    its `engine_tasks` and join its `in_flight` (what runs there, for the
    scaling rules' utilization) and the scheduler's account of the host
    (`lanes.account_load`), so a host busy with Ray work gets no new service
    or lane job beyond its limit. The services it runs stay (`Placer.keep`
    weighs lane jobs, not Ray tasks): a Ray task is short, a service moving
    is not, and the driver admitted the task against the same account (the
    services are in the in_flight it reads). A host whose Ray node died
    has its Ray worker unit shown `failed` in the snapshot's `units`, as a
    host's heartbeat shows a unit of its own that failed. (Only the leader's
    snapshot has Ray's view: `fabric status` and the status page read the
    registry, where no host writes it.)

Ray workers on idle capacity (the seed's `_scale_ray_workers`, `decide_ray_workers`)
    A host of the `[ray]` set whose Ray node is not alive while it takes new
    work (active, not drained, not held off) and has a free slot gets a
    `start`: idle capacity Ray could use. A host whose Ray node is alive
    while it does not take new work (lost, draining, drained, held off) gets
    a `stop`, so Ray sends it no new task (the seed's "scale down Ray
    workers on that node" of on_node_lost).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from reconciler.core.desired.model import TIER_ORDER, Tier
from reconciler.core.live.models import Snapshot, SnapshotNode
from reconciler.core.scheduling.placement import Choice, Placer, Request, Strategy, accepts_new_work
from reconciler.core.scheduling.suspicion import with_suspects

# The seed's fallback goes down to tier 0.
LOWEST_TIER: Tier = TIER_ORDER[-1]
# A deferral names at most this many hosts without a live Ray node.
_NAMES = 4


@dataclass(frozen=True)
class Requirement:
    """What one Ray task needs: at least `min_tier`, falling back no lower than `floor`."""

    min_tier: Tier
    payload_size: int = 0
    floor: Tier = LOWEST_TIER

    def __post_init__(self) -> None:
        if self.payload_size < 0:
            raise ValueError(f"payload_size: {self.payload_size} is negative")
        self.request()  # the tiers are checked as the scheduler checks them

    def request(self) -> Request:
        return Request(min_tier=self.min_tier, floor=self.floor)


@dataclass(frozen=True)
class NodeAssignment:
    """Where a task goes (`assigned`: a fabric host and its tier), or why it cannot (`deferred`)."""

    status: Literal["assigned", "deferred"]
    host: str | None = None
    tier: Tier | None = None
    # Assigned below min_tier (one of the fallback tiers).
    fallback: bool = False
    reason: str | None = None
    # Deferred because no node of the fleet could ever take it (waiting will not help).
    inadmissible: bool = False


def ray_candidates(snapshot: Snapshot, ray_hosts: Collection[str], own_in_flight: Mapping[str, int]) -> list[SnapshotNode]:
    """The snapshot's nodes that run a live Ray node, with the driver's own
    running tasks added to what each reported (its services and lane jobs as
    of its beat): a task sent since the beat holds its slot."""
    alive = set(ray_hosts)
    nodes = []
    for node in snapshot.nodes:
        if node.node_id not in alive:
            continue
        own = max(0, own_in_flight.get(node.node_id, 0))
        # services_running None: the account is the node's in_flight as reported plus the driver's tasks.
        nodes.append(node.model_copy(update={"in_flight": node.in_flight + node.engine_tasks + own, "services_running": None}))
    return nodes


def select_assignment(
    snapshot: Snapshot,
    requirement: Requirement,
    *,
    ray_hosts: Collection[str],
    own_in_flight: Mapping[str, int] | None = None,
    strategy: Strategy = "highest_tier",
) -> NodeAssignment:
    """The seed's select_worker over `snapshot` (module docstring); a node
    the leader suspects (the plan's `suspects`, core.scheduling.suspicion) is skipped."""
    snapshot = with_suspects(snapshot, snapshot.suspects) if snapshot.suspects else snapshot
    placer = Placer(ray_candidates(snapshot, ray_hosts, own_in_flight or {}), snapshot.now, strategy)
    outcome = placer.place(requirement.request())
    if isinstance(outcome, Choice):
        return NodeAssignment("assigned", host=outcome.node, tier=outcome.tier, fallback=outcome.fallback)
    # The scheduler's reason covers the nodes that run Ray; a node of the
    # range without a live Ray node is named too, and while there is one the
    # task is not inadmissible (its Ray worker may come back).
    in_range = set(TIER_ORDER[: TIER_ORDER.index(requirement.floor) + 1])
    alive = set(ray_hosts)
    absent = sorted({n.node_id for n in snapshot.nodes if n.node_id not in alive and n.tier in in_range})
    reason = outcome.reason
    if absent:
        named = ", ".join(absent[:_NAMES]) + (f" and {len(absent) - _NAMES} more" if len(absent) > _NAMES else "")
        reason += f"; no live Ray node on {named}"
    return NodeAssignment("deferred", reason=reason, inadmissible=outcome.inadmissible and not absent)


@dataclass
class FallbackCount:
    """The seed's burst check: tasks dispatched, and how many went below their min_tier."""

    dispatched: int = 0
    fallbacks: int = 0

    def count(self, assignment: NodeAssignment) -> None:
        if assignment.status != "assigned":
            return
        self.dispatched += 1
        if assignment.fallback:
            self.fallbacks += 1

    def line(self) -> str:
        return f"{self.dispatched} tasks dispatched, fallback tiers used: {self.fallbacks}"


# -- Ray's view in the leader's snapshot -------------------------------------


@dataclass(frozen=True)
class RayView:
    """What Ray's state API says, by fabric host (the Ray node's host label)."""

    # Tasks running per host.
    running: Mapping[str, int]
    # Hosts with a live Ray node.
    alive: frozenset[str] = frozenset()
    # Hosts whose Ray node died (and none of theirs is alive).
    dead: frozenset[str] = frozenset()


def ray_view(nodes: Iterable[tuple[str, bool, Mapping[str, str]]], running_on: Iterable[str | None], *, host_label: str) -> RayView:
    """Ray's node table ((node id, alive, labels) each) and the node ids of its
    RUNNING tasks, by fabric host (the node's `host_label`). Only a live node
    runs anything: a task that ran on a node that died can stay RUNNING in
    Ray's task events (its final event never came)."""
    live_host: dict[str, str] = {}
    alive: set[str] = set()
    dead: set[str] = set()
    for node_id, is_alive, labels in nodes:
        host = labels.get(host_label)
        if not host:
            continue
        if is_alive:
            live_host[node_id] = host
            alive.add(host)
        else:
            dead.add(host)
    running: dict[str, int] = {}
    for task_node in running_on:
        on = live_host.get(task_node or "")
        if on is not None:
            running[on] = running.get(on, 0) + 1
    return RayView(running=running, alive=frozenset(alive), dead=frozenset(dead - alive))


def with_ray_view(snapshot: Snapshot, view: RayView, *, worker_unit: str) -> Snapshot:
    """`snapshot` with each node's Ray tasks in its load and a dead Ray
    node's worker unit (`worker_unit`, render.ray_node.RAY_WORKER_UNIT: the
    renderer names it, a layer above this one) failed."""
    nodes = []
    for node in snapshot.nodes:
        tasks = max(0, view.running.get(node.node_id, 0))
        update: dict[str, object] = {}
        if tasks:
            update["engine_tasks"] = tasks
            update["in_flight"] = node.in_flight - node.engine_tasks + tasks
        if node.node_id in view.dead and node.node_id not in view.alive:
            update["units"] = {**node.units, worker_unit: "failed"}
        nodes.append(node.model_copy(update=update) if update else node)
    return snapshot.model_copy(update={"nodes": nodes})


# -- Ray workers on idle capacity (the seed's _scale_ray_workers) ------------


@dataclass(frozen=True)
class RayWorkerAction:
    kind: Literal["start", "stop"]
    host: str
    reason: str


def decide_ray_workers(snapshot: Snapshot, ray_hosts: Collection[str], view: RayView, now: datetime) -> list[RayWorkerAction]:
    """Which Ray workers of the `[ray]` hosts to start or stop (module docstring), by host name."""
    wanted = set(ray_hosts)
    actions = []
    for node in sorted(snapshot.nodes, key=lambda n: n.node_id):
        if node.node_id not in wanted:
            continue
        takes_work = accepts_new_work(node, now)
        alive = node.node_id in view.alive
        load = node.in_flight - node.engine_tasks + max(0, view.running.get(node.node_id, 0))
        if not alive and takes_work and load < node.max_concurrent_tasks:
            why = "its Ray node died" if node.node_id in view.dead else "it runs no Ray node"
            actions.append(
                RayWorkerAction("start", node.node_id, f"{why} while it has idle capacity ({load}/{node.max_concurrent_tasks}, tier {node.tier})")
            )
        elif alive and not takes_work:
            state = "drained" if node.drained else node.status if node.status != "active" else "held off"
            actions.append(RayWorkerAction("stop", node.node_id, f"the host is {state}: its Ray node must take no new task"))
    return actions
