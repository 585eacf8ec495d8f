"""Node placement: a snapshot and the desired state in, a `FleetPlan` out.

Pure: no I/O, no clock (the snapshot's `now` is the time), no randomness, so the
same inputs always give the same plan and any saved snapshot is a what-if.

The rules (self-adapting-compute-fabric.md, "Adaptive Scheduler Engine"):

Eligible node (for NEW work)
    status "active", not drained, not suspected (`SnapshotNode.suspected`,
    core.scheduling.suspicion), `held_off_until` not after `now`,
    load < max_concurrent_tasks (load counts the placements made in this pass),
    arch in the request's arch list when it has one (a node of unknown arch
    matches only an unrestricted request), labels a superset of the request's.

Choosing
    Candidates are the eligible nodes at or above `min_tier`. Strategy
    "highest_tier" (the seed's) prefers the highest tier; "best_fit" the lowest
    tier that satisfies, so CUDA boxes stay free for CUDA-only work. Among
    the nodes of one tier, the cheaper cost class (`SnapshotNode.cost`, from
    the host file through its heartbeat: free, owned, paid) wins first, so a
    paid host takes work only while the cheaper hosts of its tier are full.
    Then the lowest utilization (load / max_concurrent_tasks), then the node
    id. A request with `cost_first` (a service's or the fleet's cost_order
    "before_tier": work that does not care for speed) takes the cheapest
    class first and, within it, the tier order down to the floor
    (`preference_steps`); a floor is still a floor either way.
    Replicas of one service go to distinct nodes: a host runs one unit per
    service, so two replicas on one host would be one replica. A node running
    a sibling is not a candidate at all; a replica with no distinct node left
    (down to the floor) is deferred, and its reason says so. (`Placer.place`'s
    `avoid` is the soft form, a preference, for one-off tasks.)
    No candidate: fall back one tier at a time below `min_tier`, down to the
    floor. Still nothing: `Deferred`, with a reason naming each tier tried and
    why its nodes were not usable, and `inadmissible=True` when no node of the
    snapshot, whatever its status or load, has a tier at or above the floor
    and the required arch and labels (e.g. CUDA-only work in a fleet without
    CUDA) - waiting for capacity would not help.

Load: one account of capacity per host
    Services placed on a host and lane jobs running on the lanes whose agent
    runs there (reconciler.core.scheduling.lanes: a compute lane's push host,
    the local lane's control host) draw from the same max_concurrent_tasks.
    A node's load starts at
        placements kept on it + lane jobs on it (the registry's claims now)
    when its record says which part of in_flight is its services running
    (`services_running`; the rest is the lane jobs it read from the claims
    when it beat, older than the claims now), else at
        max(reported in_flight, placements kept on it + lane jobs on it)
    (`lanes.account_load`). `in_flight` is what the node measured when it
    beat: its active services plus the lane jobs of its lanes, so lane jobs
    are never added to it (that would count each twice); the services it runs
    are the scheduler's own placements, counted as placements (a leader with
    no plan in force, after a forged one, must not take a host's own services
    for foreign load). The registry's account is the other term: a kept
    placement the node has not applied yet still holds its slot, and a lane
    job claimed since the beat holds one too. Every new placement adds
    one. A node never receives work that would take it past
    max_concurrent_tasks, and a placement is kept only while the kept ones
    plus its lane jobs fit: running lane jobs cannot be moved by the
    scheduler, a service can. So services placed + lane jobs <= the limit on
    every node whose lane jobs alone fit it. Lane dispatch reads the same
    account the other way round (`lanes.lane_views`: a lane's free slots are
    the smaller of its cap left and its host's capacity left).

Existing placements (`snapshot.placements`)
    stay where they are while still feasible: the node is in the snapshot,
    "active" (or "draining" within its grace), not drained, of a tier at or
    above the service's floor, matching arch and labels, and the kept
    placements on it fit its max_concurrent_tasks. A node joining never moves
    work (the seed's "new node appears before the old one drains": old work
    stays, new work may go to the new node). Work on a lost node, or on a
    drained one whose grace is over, is placed again.
    A held-off (flapping) node keeps what it runs - hold-off stops new
    placements, it does not evict - which is exactly the churn damping is for.

Work comes home (`bring_home`, `split_moves`, `room_memory`)
    Stickiness is not forever on a paid host. While replicas run on paid
    hosts, the plan remembers (`FleetPlan.room_since`, read back as
    `Snapshot.room_since`) since when each node they could come home to has
    had room: a node of a cheaper class that the replica's request prefers
    for tier and cost (`Placer.preferred_to`; with tier first, never a worse
    tier). Once one has had room for [flap] window_s, one replica per
    service moves: its new placement (`Placement.replaces` = the paid node)
    is added beside the old one, holding a slot on the new node; the edge
    routes to both. When the new node's heartbeat shows the service's unit
    active, the old placement leaves the plan (make-before-break); a new unit
    that failed gives the move up. The window is the hysteresis: a node
    whose room comes and goes never attracts a move, and nothing moves onto
    a paid host except as new work while the cheaper hosts are full. Lane
    jobs are not placements: they finish where they run.

Order
    Services with the highest `min_tier` (then the highest floor) are placed
    first, then in declaration order, so a CUDA-only service is not crowded
    off the CUDA box by work that could have run anywhere.

Trust
    Only nodes that are declared hosts of the desired state are used; any
    other node in the snapshot is listed in `FleetPlan.ignored_nodes`. A
    registry writer can move declared work around but not add a target.

Speed
    Per (arch, labels) constraint and per (tier, cost class), a heap keyed by
    (utilization, node id) holds the eligible nodes (the id as its rank in
    sorted order); a placement replaces the chosen node's entry in place and
    re-pushes it into its other heaps (stale entries are skipped on pop). A
    decision costs
    O(log N) heap work per pool tried (at most 11 tiers x 3 classes), against O(N) for a
    scan of every node; bench/scheduler measures both.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from reconciler.core.desired.model import COST_ORDER, COST_RANK, TIER_ORDER, TIER_SCORE, Cost, CostOrder, DesiredState, Service, Tier
from reconciler.core.live.host_load import RUNNING_STATES
from reconciler.core.live.models import Deferred, FleetPlan, Placement, Snapshot, SnapshotNode
from reconciler.core.scheduling.lanes import account_load, agent_unit, lane_jobs_by_host, lane_views
from reconciler.core.scheduling.suspicion import hedged_nodes, may_hedge
from reconciler.core.timestamps import utc, utc_stamp

Strategy = Literal["highest_tier", "best_fit"]

# A reason lists node names for a tier while it has at most this many nodes in
# one state; beyond it, counts (a 10,000-node fleet must not yield a novel).
_NAMES_PER_REASON = 4

# A request's static constraints: (allowed architectures, required labels).
Constraint = tuple[frozenset[str], tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Request:
    """One unit of work to place: a service replica or a one-off task."""

    min_tier: Tier
    floor: Tier
    # Allowed architectures; empty = any.
    arch: frozenset[str] = frozenset()
    # Labels the node must carry, sorted (key, value) pairs.
    labels: tuple[tuple[str, str], ...] = ()
    # Cost before tier (CostOrder "before_tier"): the cheapest class with
    # room first, then the tier order down to the floor.
    cost_first: bool = False

    def __post_init__(self) -> None:
        for name in ("min_tier", "floor"):
            if getattr(self, name) not in TIER_SCORE:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not a tier ({', '.join(TIER_ORDER)})")
        if TIER_SCORE[self.floor] > TIER_SCORE[self.min_tier]:
            raise ValueError(f"floor {self.floor!r} is above min_tier {self.min_tier!r}")

    @classmethod
    def for_service(cls, service: Service, cost_order: CostOrder = "within_tier") -> Request:
        """`cost_order`: the fleet's ([scheduler] cost_order), unless the service says its own."""
        return cls(
            min_tier=service.min_tier,
            floor=service.floor,
            arch=frozenset(service.arch),
            labels=tuple(sorted(service.labels.items())),
            cost_first=(service.cost_order or cost_order) == "before_tier",
        )

    @property
    def constraint(self) -> Constraint:
        return (self.arch, self.labels)

    def matches(self, node: SnapshotNode) -> bool:
        """The static constraints: architecture and labels (not tier, not load)."""
        if self.arch and node.arch not in self.arch:
            return False
        return all(node.labels.get(k) == v for k, v in self.labels)


@dataclass(frozen=True)
class Choice:
    node: str
    tier: Tier
    fallback: bool


# One step of a decision: the (tier, cost rank) heaps to try in order, each
# with whether its tier is a fallback (below min_tier).
Step = list[tuple[Tier, int, bool]]


@dataclass(frozen=True)
class NoChoice:
    reason: str
    inadmissible: bool


def tier_sequence(min_tier: Tier, floor: Tier, strategy: Strategy) -> tuple[list[Tier], list[Tier]]:
    """(satisfying tiers in preference order, fallback tiers from just below min_tier down to floor)."""
    top = TIER_ORDER.index(min_tier)
    bottom = TIER_ORDER.index(floor)
    satisfying = list(TIER_ORDER[: top + 1])  # gpu_cuda .. min_tier, best first
    if strategy == "best_fit":
        satisfying.reverse()
    fallback = list(TIER_ORDER[top + 1 : bottom + 1])
    return satisfying, fallback


def preference_steps(min_tier: Tier, floor: Tier, strategy: Strategy, cost_first: bool) -> list[Step]:
    """The order a request tries (tier, cost) pools in, as groups (a group's
    avoided nodes are passed over only while another of the group will do).

    Tier first (the default): the satisfying tiers as one group, each tier's
    cost classes cheapest first, then each fallback tier with its classes.
    Cost first: one group per cost class, cheapest first, each with every
    tier from the strategy's satisfying order down to the floor."""
    satisfying, fallback = tier_sequence(min_tier, floor, strategy)
    tiers = [(t, False) for t in satisfying] + [(t, True) for t in fallback]
    costs = range(len(COST_ORDER))
    if cost_first:
        return [[(t, c, fb) for t, fb in tiers] for c in costs]
    return [[(t, c, False) for t in satisfying for c in costs]] + [[(t, c, True) for c in costs] for t in fallback]


def accepts_new_work(node: SnapshotNode, now: datetime) -> bool:
    """Status and lifecycle part of eligibility (load, tier, arch, labels aside)."""
    if node.status != "active" or node.drained or node.max_concurrent_tasks <= 0 or node.suspected:
        return False
    return node.held_off_until is None or utc(node.held_off_until) <= now


def can_keep_work(node: SnapshotNode) -> bool:
    """Whether a node may keep what it runs.

    Held-off nodes keep their work, and so does a draining node until its
    drain grace is over (the registry then sets `drained`): `fabric drain HOST
    --grace S` gives running work S seconds before it moves.
    """
    return node.status in ("active", "draining") and not node.drained


@dataclass
class _Slot:
    """One node's running state during a pass."""

    node: SnapshotNode
    load: int
    limit: int
    # Position of the node id in sorted order: the tie-break, as an int
    # because comparing ints is cheaper than comparing ids.
    rank: int = 0
    # Bumped at every load change: heap entries with an older stamp are stale.
    stamp: int = 0
    heaps: list[list[tuple[float, int, int]]] = field(default_factory=list)

    def entry(self) -> tuple[float, int, int]:
        return (self.load / self.limit, self.rank, self.stamp)


class Placer:
    """The nodes of one scheduling pass, indexed for O(log N) decisions.

    Build once per pass, call `keep` for placements already in force, then
    `place` for each piece of new work; loads carry over between calls, so a
    sequence of `place` calls is a burst dispatched against one snapshot.
    """

    def __init__(
        self,
        nodes: Iterable[SnapshotNode],
        now: datetime,
        strategy: Strategy = "highest_tier",
        lane_jobs: Mapping[str, int] | None = None,
    ) -> None:
        """`lane_jobs`: lane jobs running per host (`lanes.lane_jobs_by_host`),
        drawn from the same capacity as the services (module docstring)."""
        self.now = utc(now)
        self.strategy: Strategy = strategy
        self.nodes: dict[str, SnapshotNode] = {}
        for node in nodes:
            self.nodes.setdefault(node.node_id, node)  # the first record of a node wins
        self.lane_jobs: dict[str, int] = {n: jobs for n, jobs in (lane_jobs or {}).items() if jobs}
        accepting = sorted(n.node_id for n in self.nodes.values() if accepts_new_work(n, self.now))
        self._ranked: list[_Slot] = [
            _Slot(self.nodes[node_id], self._account(node_id, 0), self.nodes[node_id].max_concurrent_tasks, rank)
            for rank, node_id in enumerate(accepting)
        ]
        self.slots: dict[str, _Slot] = {slot.node.node_id: slot for slot in self._ranked}
        self._kept: Counter[str] = Counter()
        # constraint -> (tier, cost rank) -> heap of (utilization, node rank, stamp)
        self._pools: dict[Constraint, dict[tuple[str, int], list[tuple[float, int, int]]]] = {}
        # (min_tier, floor, cost_first) -> the (tier, cost) groups to try, in order
        self._steps: dict[tuple[str, str, bool], list[Step]] = {}
        self._deferral_cache: dict[tuple[Constraint, str, str, frozenset[str]], NoChoice] = {}
        # (constraint, min_tier, floor) -> what its deferrals' reasons need of the nodes (`deferral_scan`)
        self._scans: dict[tuple[Constraint, str, str], DeferralScan] = {}
        # Bumped at every load change; each shape's deferral problems at the
        # loads of that count (`DeferralGroups`: one pass over the nodes per
        # shape while no load moves, whatever the exclusions).
        self._loads_moved = 0
        self._groups: dict[tuple[Constraint, str, str], tuple[int, DeferralGroups]] = {}
        # (min_tier, floor, cost_first) -> (tier, cost rank) -> its place in the preference order
        self._orders: dict[tuple[str, str, bool], dict[tuple[str, int], int]] = {}

    # ------------------------------------------------------------------
    # Loads

    def _account(self, node_id: str, kept: int) -> int:
        """The node's load with `kept` placements kept on it (module docstring):
        its reported in_flight already counts its lane jobs, so they are added
        to the registry's side only."""
        return account_load(self.nodes[node_id], kept, self.lane_jobs.get(node_id, 0))

    def load(self, node_id: str) -> int:
        slot = self.slots.get(node_id)
        if slot is not None:
            return slot.load
        return self._account(node_id, self._kept[node_id])

    def keep(self, node_id: str, request: Request) -> bool:
        """Keep a placement already in force on `node_id` if still feasible."""
        node = self.nodes.get(node_id)
        if node is None or not can_keep_work(node):
            return False
        if TIER_SCORE[node.tier] < TIER_SCORE[request.floor] or not request.matches(node):
            return False
        # The lane jobs running there hold their slots: a kept service must fit beside them.
        if self._kept[node_id] + self.lane_jobs.get(node_id, 0) >= node.max_concurrent_tasks:
            return False
        self._kept[node_id] += 1
        self._loads_moved += 1
        slot = self.slots.get(node_id)
        if slot is not None:
            # In flight already counts work the node applied; the kept
            # placement holds its slot whether applied yet or not.
            self._set_load(slot, self._account(node_id, self._kept[node_id]))
        return True

    def _set_load(self, slot: _Slot, load: int) -> None:
        if load == slot.load:
            return
        self._loads_moved += 1
        slot.load = load
        slot.stamp += 1
        if slot.load < slot.limit:
            entry = slot.entry()
            for heap in slot.heaps:
                heapq.heappush(heap, entry)
        # A full node simply has no current entry left: its old ones are stale.
        self._deferral_cache.clear()

    # ------------------------------------------------------------------
    # Index

    def prepare(self, requests: Iterable[Request]) -> None:
        """Build the index for these request shapes now (else on first use)."""
        for request in requests:
            self._pool(request)

    def _pool(self, request: Request) -> dict[tuple[str, int], list[tuple[float, int, int]]]:
        key = request.constraint
        pool = self._pools.get(key)
        if pool is None:
            pool = defaultdict(list)
            for slot in self.slots.values():
                if request.matches(slot.node):
                    heap = pool[(slot.node.tier, COST_RANK[slot.node.cost])]
                    slot.heaps.append(heap)
                    if slot.load < slot.limit:
                        heap.append(slot.entry())
            for heap in pool.values():
                heapq.heapify(heap)
            self._pools[key] = pool
        return pool

    def _best(self, heap: list[tuple[float, int, int]], avoid: frozenset[str]) -> _Slot | None:
        """The least-utilized current node of a tier heap, skipping `avoid`."""
        skipped = []
        found = None
        while heap:
            _, rank, stamp = heap[0]
            slot = self._ranked[rank]
            if stamp != slot.stamp or slot.load >= slot.limit:
                heapq.heappop(heap)  # stale entry, or full
                continue
            if avoid and slot.node.node_id in avoid:
                skipped.append(heapq.heappop(heap))
                continue
            found = slot
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _take(self, slot: _Slot, heap: list[tuple[float, int, int]]) -> None:
        """One more unit of work on `slot`, chosen from `heap`.

        When the slot's entry is the top of `heap` (no avoided sibling was
        pushed back above it) it is replaced in place: one sift instead of a
        push now and a stale pop later. Its other heaps get a new entry.
        """
        top_is_slot = bool(heap) and heap[0][1] == slot.rank and heap[0][2] == slot.stamp
        self._loads_moved += 1
        slot.load += 1
        slot.stamp += 1
        entry = slot.entry() if slot.load < slot.limit else None
        for other in slot.heaps:
            if other is heap and top_is_slot:
                if entry is None:
                    heapq.heappop(other)
                else:
                    heapq.heapreplace(other, entry)
            elif entry is not None:
                heapq.heappush(other, entry)
        # The deferral cache stays valid: a deferral's reason depends on loads
        # only through the nodes it calls full, and a full node is never
        # taken (a node of the request's range and constraint that was not
        # full would have been chosen instead of deferring). Clearing it here
        # made every deferral after a placement a scan of the whole fleet.

    def _tier_steps(self, request: Request) -> list[Step]:
        """`preference_steps` of the request, computed once per shape."""
        key = (request.min_tier, request.floor, request.cost_first)
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = preference_steps(request.min_tier, request.floor, self.strategy, request.cost_first)
        return steps

    # ------------------------------------------------------------------
    # Decisions

    def place(self, request: Request, avoid: Iterable[str] = (), exclude: Iterable[str] = ()) -> Choice | NoChoice:
        """Place one unit of work. `avoid`: nodes to pass over while another
        will do (a preference); `exclude`: nodes that must not take it (a
        service's nodes already running one of its replicas)."""
        exclude = frozenset(exclude)
        avoid = frozenset(avoid) | exclude
        pool = self._pool(request)
        # Within the satisfying group, nodes not avoided first; then the same
        # for each fallback tier, best first.
        passes = (avoid, exclude) if avoid != exclude else (avoid,)
        for group in self._tier_steps(request):
            for avoiding in passes:
                for tier, cost, is_fallback in group:
                    heap = pool.get((tier, cost))
                    if not heap:
                        continue
                    slot = self._best(heap, avoiding)
                    if slot is not None:
                        self._take(slot, heap)
                        return Choice(slot.node.node_id, slot.node.tier, is_fallback)
        return self._explain(request, exclude)

    # ------------------------------------------------------------------
    # Work comes home (the come-home rule, `bring_home`)

    def _order(self, request: Request) -> dict[tuple[str, int], int]:
        key = (request.min_tier, request.floor, request.cost_first)
        order = self._orders.get(key)
        if order is None:
            flat = [(tier, cost) for group in self._tier_steps(request) for tier, cost, _ in group]
            order = self._orders[key] = {pool: i for i, pool in enumerate(flat)}
        return order

    def preferred_to(self, request: Request, than: SnapshotNode, node: SnapshotNode) -> bool:
        """Whether `request` would rather run on `node` than on `than` for
        their tier and cost alone (not load), and `node` is of a cheaper cost
        class: where a replica on `than` may come home to."""
        if COST_RANK[node.cost] >= COST_RANK[than.cost]:
            return False
        order = self._order(request)
        mine = order.get((node.tier, COST_RANK[node.cost]))
        theirs = order.get((than.tier, COST_RANK[than.cost]))
        return mine is not None and theirs is not None and mine < theirs

    def place_cheaper(self, request: Request, than: SnapshotNode, exclude: Iterable[str] = ()) -> Choice | None:
        """Place one unit of work on the node `place` would choose among
        those `preferred_to` `than` (None when none has room)."""
        exclude = frozenset(exclude)
        pool = self._pool(request)
        for group in self._tier_steps(request):
            for tier, cost, is_fallback in group:
                heap = pool.get((tier, cost))
                if not heap or cost >= COST_RANK[than.cost]:
                    continue
                slot = self._best(heap, exclude)
                if slot is not None and self.preferred_to(request, than, slot.node):
                    self._take(slot, heap)
                    return Choice(slot.node.node_id, slot.node.tier, is_fallback)
        return None

    def _explain(self, request: Request, exclude: frozenset[str]) -> NoChoice:
        key = (request.constraint, request.min_tier, request.floor, exclude)
        cached = self._deferral_cache.get(key)
        if cached is None:
            shape = (request.constraint, request.min_tier, request.floor)
            scan = self._scans.get(shape)
            if scan is None:
                scan = self._scans[shape] = deferral_scan(request, list(self.nodes.values()), self.now)
            held = self._groups.get(shape)
            if held is None or held[0] != self._loads_moved:
                held = self._groups[shape] = (self._loads_moved, deferral_groups(scan, self.load))
            cached = self._deferral_cache[key] = explain_grouped(request, scan, held[1], exclude)
        return cached


def _static_problem(node: SnapshotNode, request: Request, now: datetime) -> str | None:
    """Why this node, of a tier in range, cannot take the request whatever
    the loads and exclusions (None: only if it is full, or runs a replica)."""
    if node.status != "active":
        return node.status
    if node.drained:
        return "drained"
    if node.held_off_until is not None and utc(node.held_off_until) > now:
        return f"held off until {utc_stamp(node.held_off_until)}"
    if request.arch and node.arch not in request.arch:
        return f"arch {node.arch or 'unknown'} not in [{', '.join(sorted(request.arch))}]"
    missing = [f"{k}={v}" for k, v in request.labels if node.labels.get(k) != v]
    if missing:
        return f"lacks label {', '.join(missing)}"
    return None


def _node_problem(node: SnapshotNode, request: Request, load: int, now: datetime, exclude: Collection[str] = ()) -> str:
    """Why this node, of a tier in range, cannot take the request right now."""
    if node.node_id in exclude:
        return "runs a replica already"
    return _static_problem(node, request, now) or f"full {load}/{node.max_concurrent_tasks}"


@dataclass(frozen=True)
class DeferralScan:
    """What a deferral's reason needs of the nodes that depends neither on
    the loads nor on the exclusions, for one request shape (its constraint,
    min_tier and floor) at one moment: the answer when no node could ever
    take it, else each node in range, by node id, with its tier and why it
    cannot take the request whatever its load (None: only if full). A placer
    scans once per shape; each deferral then only looks up loads and
    exclusions (`explain_scanned`)."""

    inadmissible: NoChoice | None
    # Per tier in range, best first: (node id, static problem, max_concurrent_tasks) by node id.
    tiers: tuple[tuple[str, tuple[tuple[str, str | None, int], ...]], ...] = ()


def deferral_scan(request: Request, nodes: Sequence[SnapshotNode], now: datetime) -> DeferralScan:
    bottom = TIER_ORDER.index(request.floor)
    in_range = set(TIER_ORDER[: bottom + 1])
    if not any(n.tier in in_range and request.matches(n) for n in nodes):
        present = sorted({n.tier for n in nodes}, key=TIER_ORDER.index)
        what = f"tier {request.floor} or better" + (f" with{_constraint_text(request)}" if request.arch or request.labels else "")
        return DeferralScan(
            NoChoice(
                f"inadmissible: no node in the fleet has {what} (min_tier {request.min_tier}, floor {request.floor}); "
                f"tiers present: {', '.join(present) or 'none'}",
                inadmissible=True,
            )
        )
    by_tier: dict[str, list[tuple[str, str | None, int]]] = {}
    for n in sorted((n for n in nodes if n.tier in in_range), key=lambda n: n.node_id):
        by_tier.setdefault(n.tier, []).append((n.node_id, _static_problem(n, request, now), n.max_concurrent_tasks))
    return DeferralScan(None, tuple((tier, tuple(by_tier[tier])) for tier in TIER_ORDER[: bottom + 1] if tier in by_tier))


def _constraint_text(request: Request) -> str:
    constraint = ""
    if request.arch:
        constraint += f" arch [{', '.join(sorted(request.arch))}]"
    if request.labels:
        constraint += " labels {" + ", ".join(f"{k}={v}" for k, v in request.labels) + "}"
    return constraint


@dataclass(frozen=True)
class DeferralGroups:
    """A shape's `DeferralScan` at some loads, no node excluded: per tier in
    range, the node ids by id (and each one's position), and each problem
    with the positions of its nodes, in order of first occurrence."""

    tiers: dict[str, tuple[dict[str, int], list[str], dict[str, list[int]]]]


def deferral_groups(scan: DeferralScan, load_of: Callable[[str], int]) -> DeferralGroups:
    tiers: dict[str, tuple[dict[str, int], list[str], dict[str, list[int]]]] = {}
    full: dict[tuple[int, int], str] = {}
    for tier, in_tier in scan.tiers:
        positions: dict[str, int] = {}
        problem_at: list[str] = []
        groups: dict[str, list[int]] = {}
        for position, (node_id, static, limit) in enumerate(in_tier):
            if static is None:
                load = load_of(node_id)
                static = full.get((load, limit)) or full.setdefault((load, limit), f"full {load}/{limit}")
            positions[node_id] = position
            problem_at.append(static)
            groups.setdefault(static, []).append(position)
        tiers[tier] = (positions, problem_at, groups)
    return DeferralGroups(tiers)


def explain_grouped(request: Request, scan: DeferralScan, grouped: DeferralGroups, exclude: Collection[str]) -> NoChoice:
    """`explain_scanned` at the loads `grouped` was made at: the same reason,
    from the groups with the excluded nodes taken out of theirs and put in
    "runs a replica already" (each problem where its first node now is)."""
    if scan.inadmissible is not None:
        return scan.inadmissible
    by_tier: dict[str, dict[str, list[str]]] = {}
    for tier, in_tier in scan.tiers:
        positions, problem_at, groups = grouped.tiers[tier]
        out = sorted(p for p in (positions.get(node) for node in exclude) if p is not None)
        taken = set(out)
        found: list[tuple[int, str, list[str], int]] = []
        if out:
            found.append((out[0], "runs a replica already", [in_tier[p][0] for p in out[: _NAMES_PER_REASON + 1]], len(out)))
        for problem, members in groups.items():
            count = len(members) - sum(1 for p in out if problem_at[p] == problem) if out else len(members)
            if count == 0:
                continue
            kept = (p for p in members if p not in taken)
            first = next(kept)
            names = [in_tier[first][0]]
            if count <= _NAMES_PER_REASON:
                names += [in_tier[p][0] for p in kept]
            found.append((first, problem, names, count))
        by_tier[tier] = {problem: names if count <= _NAMES_PER_REASON else [""] * count for _, problem, names, count in sorted(found)}
    return _deferral_reason(request, by_tier)


def explain_deferral(
    request: Request,
    nodes: Sequence[SnapshotNode],
    load_of: Callable[[str], int],
    now: datetime,
    exclude: Collection[str] = (),
) -> NoChoice:
    """The reason no node could take `request` (a scan: only on deferral)."""
    return explain_scanned(request, deferral_scan(request, nodes, now), load_of, exclude)


def explain_scanned(request: Request, scan: DeferralScan, load_of: Callable[[str], int], exclude: Collection[str] = ()) -> NoChoice:
    """`explain_deferral` from the request shape's `deferral_scan`: the same reason."""
    if scan.inadmissible is not None:
        return scan.inadmissible
    by_tier: dict[str, dict[str, list[str]]] = {}
    full: dict[tuple[int, int], str] = {}
    for tier, in_tier in scan.tiers:
        problems: dict[str, list[str]] = {}
        by_tier[tier] = problems
        for node_id, static, limit in in_tier:
            if node_id in exclude:
                problem = "runs a replica already"
            elif static is not None:
                problem = static
            else:
                load = load_of(node_id)
                problem = full.get((load, limit)) or full.setdefault((load, limit), f"full {load}/{limit}")
            names = problems.get(problem)
            if names is None:
                problems[problem] = [node_id]
            else:
                names.append(node_id)
    return _deferral_reason(request, by_tier)


def _deferral_reason(request: Request, by_tier: dict[str, dict[str, list[str]]]) -> NoChoice:
    """The reason's text from each tier's problems (in order of first
    occurrence) and their nodes (only their number counts past _NAMES_PER_REASON)."""
    bottom = TIER_ORDER.index(request.floor)
    # Every tier from the best down to the floor was tried (the satisfying
    # ones in strategy order, then the fallback ones).
    tried = TIER_ORDER[0] if bottom == 0 else f"{TIER_ORDER[0]}..{request.floor}"
    constraint = _constraint_text(request)
    parts = []
    empty = []
    for tier in TIER_ORDER[: bottom + 1]:
        found = by_tier.get(tier)
        if not found:
            empty.append(tier)
            continue
        described = []
        for problem, names in found.items():
            if len(names) <= _NAMES_PER_REASON:
                described += [f"{name} {problem}" for name in names]
            else:
                described.append(f"{len(names)} nodes {problem.split(' ')[0]}")
        parts.append(f"{tier}: {', '.join(described)}")
    if empty:
        parts.append(f"no node at {', '.join(empty)}")
    return NoChoice(
        f"no eligible node from {tried} (min_tier {request.min_tier}, floor {request.floor}"
        f"{';' + constraint if constraint else ''}): " + "; ".join(parts),
        inadmissible=False,
    )


def split_moves(snapshot: Snapshot) -> tuple[list[Placement], list[Placement], set[str]]:
    """The placements in force, the moves still under way (`Placement.replaces`)
    and the nodes of the moves given up.

    Make-before-break: a move whose new placement runs (its node's heartbeat
    says the service's unit is active) is done, and the new placement stands
    alone: the old one leaves the plan, so its host stops the unit and the
    edge routes to the new one only. A move whose new unit failed is given
    up (the old placement stays; its node's room counts from now, so the
    come-home rule tries again only after another stable window). Otherwise
    both stay."""
    units = {n.node_id: n.units for n in snapshot.nodes}
    in_force: list[Placement] = []
    pending: list[Placement] = []
    done: set[tuple[str, int, str]] = set()
    given_up: set[str] = set()
    for p in snapshot.placements:
        if p.replaces is None:
            continue
        state = units.get(p.node, {}).get(agent_unit(p.service))
        if state in RUNNING_STATES:
            done.add((p.service, p.replica, p.replaces))
            in_force.append(p.model_copy(update={"replaces": None}))
        elif state == "failed":
            given_up.add(p.node)
        else:
            pending.append(p)
    in_force += [p for p in snapshot.placements if p.replaces is None and (p.service, p.replica, p.node) not in done]
    return in_force, pending, given_up


def keep_moves(
    placer: Placer,
    pending: Iterable[Placement],
    services: Mapping[str, Service],
    kept: dict[tuple[str, int], Placement],
    kept_on: set[tuple[str, str]],
) -> dict[tuple[str, int], Placement]:
    """The moves under way that go on: the old placement is still kept and the
    new one still fits its node (it holds its slot from the start). A move
    whose old placement is gone (its host lost) leaves the new one as the
    replica's placement, when it can stay. Updates `kept` and `kept_on`."""
    moving: dict[tuple[str, int], Placement] = {}
    for new in sorted(pending, key=lambda p: (p.service, p.replica)):
        key = (new.service, new.replica)
        service = services.get(new.service)
        if service is None or new.replica >= service.replicas or key in moving or (new.service, new.node) in kept_on:
            continue
        old = kept.get(key)
        if old is not None and old.node != new.replaces:
            continue
        if not placer.keep(new.node, Request.for_service(service)):
            continue
        kept_on.add((new.service, new.node))
        tier = placer.nodes[new.node].tier
        placement = Placement(
            service=new.service,
            replica=new.replica,
            node=new.node,
            tier=tier,
            fallback=TIER_SCORE[tier] < TIER_SCORE[service.min_tier],
            replaces=new.replaces if old is not None else None,
        )
        if old is None:
            kept[key] = placement
        else:
            moving[key] = placement
    return moving


def bring_home(
    placer: Placer,
    desired: DesiredState,
    snapshot: Snapshot,
    kept: Mapping[tuple[str, int], Placement],
    moving: Mapping[tuple[str, int], Placement],
    placed: Iterable[Placement] = (),
) -> dict[tuple[str, int], Placement]:
    """The come-home rule: new moves of replicas off paid hosts. `placed`:
    every placement of this plan so far (a move never goes where a replica of
    its service is placed, kept or new).

    A replica kept on a paid host moves to a node that its request prefers
    for tier and cost (`Placer.preferred_to`: of a cheaper class, and not of
    a worse tier position) once such a node has had room for a stable
    window: continuously since `snapshot.room_since` (the last plan's
    memory), at least [flap] window_s ago. One move per service at a time,
    never while one of its moves is under way; the new placement takes its
    slot now (make-before-break: the old one stays until it runs,
    `split_moves`). Nothing moves back: only paid hosts are left, and only
    for cheaper ones. Lane jobs are not placements: they never move."""
    now = utc(snapshot.now)
    window = desired.fleet.flap.window_s
    stable = {n for n, since in snapshot.room_since.items() if (now - utc(since)).total_seconds() >= window}
    if not stable:
        return {}
    unstable = frozenset(placer.slots) - stable
    cost_order = desired.fleet.scheduler.cost_order
    busy = {service for service, _ in moving}
    by_service: dict[str, list[Placement]] = defaultdict(list)
    for key in sorted(kept):
        by_service[key[0]].append(kept[key])
    hosting_of: dict[str, set[str]] = defaultdict(set)
    for p in [*placed, *kept.values(), *moving.values()]:
        hosting_of[p.service].add(p.node)
    moves: dict[tuple[str, int], Placement] = {}
    for service in _placement_order(desired.fleet.services):
        if service.id in busy:
            continue
        request = Request.for_service(service, cost_order)
        hosting = hosting_of[service.id]
        for p in by_service[service.id]:
            node = placer.nodes[p.node]
            if node.cost != "paid":
                continue
            choice = placer.place_cheaper(request, node, exclude=hosting | unstable)
            if choice is not None:
                moves[(p.service, p.replica)] = Placement(
                    service=p.service, replica=p.replica, node=choice.node, tier=choice.tier, fallback=choice.fallback, replaces=p.node
                )
                break
    return moves


# The come-home rule's memory holds at most this many nodes (the plan is one
# registry key): those remembered longest first, then by node id.
_ROOM_NODES = 256


def room_memory(placer: Placer, desired: DesiredState, snapshot: Snapshot, placements: Iterable[Placement]) -> dict[str, datetime]:
    """The plan's `room_since`: while replicas run on paid hosts, each node
    they could come home to (`Placer.preferred_to`) that has room after this
    plan's placements, since when it has had it (the last plan's time, or
    now). Empty while no replica runs on a paid host."""
    services = {s.id: s for s in desired.fleet.services}
    cost_order = desired.fleet.scheduler.cost_order
    shapes: dict[tuple[Request, str], SnapshotNode] = {}
    for p in placements:
        node = placer.nodes.get(p.node)
        service = services.get(p.service)
        if node is not None and service is not None and node.cost == "paid":
            request = Request.for_service(service, cost_order)
            shapes.setdefault((request, f"{node.tier}/{node.cost}"), node)
    if not shapes:
        return {}
    now = utc(snapshot.now)
    room: dict[str, datetime] = {}
    for node_id, slot in placer.slots.items():
        if slot.load >= slot.limit:
            continue
        if any(request.matches(slot.node) and placer.preferred_to(request, than, slot.node) for (request, _), than in shapes.items()):
            since = snapshot.room_since.get(node_id)
            room[node_id] = utc(since) if since is not None and utc(since) <= now else now
    chosen = sorted(room, key=lambda n: (room[n], n))[:_ROOM_NODES]
    return {n: room[n] for n in sorted(chosen)}


def _placement_order(services: Sequence[Service]) -> list[Service]:
    """Most demanding first (min_tier, then floor), then declaration order."""
    indexed = list(enumerate(services))
    indexed.sort(key=lambda p: (-TIER_SCORE[p[1].min_tier], -TIER_SCORE[p[1].floor], p[0]))
    return [s for _, s in indexed]


def running_placements(desired: DesiredState, snapshot: Snapshot) -> list[Placement]:
    """The placements the hosts report running: each declared service's unit
    that a declared node's heartbeat (`SnapshotNode.units`) says is active or
    reloading, replicas numbered by node id, at most the service's replicas.
    What a leader keeps in force when it has no verified plan of its own (the
    newest is forged): the hosts refused the forgery and run what they ran."""
    declared = set(desired.hosts)
    nodes = sorted((n for n in snapshot.nodes if n.node_id in declared and n.units), key=lambda n: n.node_id)
    running: list[Placement] = []
    for service in desired.fleet.services:
        unit = agent_unit(service.id)
        on = [n for n in nodes if n.units.get(unit) in RUNNING_STATES][: service.replicas]
        running += [Placement(service=service.id, replica=i, node=n.node_id, tier=n.tier) for i, n in enumerate(on)]
    return running


def schedule(
    snapshot: Snapshot,
    desired: DesiredState,
    *,
    leader: str | None = None,
    epoch: int | None = None,
) -> FleetPlan:
    """Place every service replica of `desired` over `snapshot`; lanes as seen."""
    _, plan = schedule_with_placer(snapshot, desired, leader=leader, epoch=epoch)
    return plan


def _declared_cost(node: SnapshotNode, cost: Cost) -> SnapshotNode:
    return node if node.cost == cost else node.model_copy(update={"cost": cost})


WAITS_FOR_GROUP = "waits for a member of worker group "


def waits_for_group(deferred: Deferred) -> str | None:
    """The worker group a deferred replica waits for (only its members could take it), or None."""
    if deferred.inadmissible or not deferred.reason.startswith(WAITS_FOR_GROUP):
        return None
    return deferred.reason[len(WAITS_FOR_GROUP) :].split(" ", 1)[0]


def group_capacity(desired: DesiredState, request: Request) -> str | None:
    """The first declared worker group whose members could take `request`
    (its tier at or above the floor, its labels those the request needs), or None."""
    bottom = TIER_ORDER.index(request.floor)
    for name, group in sorted(desired.fleet.groups.items()):
        if TIER_ORDER.index(group.tier) <= bottom and all(group.labels.get(k) == v for k, v in request.labels):
            return name
    return None


def _deferred(desired: DesiredState, request: Request, service: str, replica: int, outcome: NoChoice) -> Deferred:
    """A replica no node takes now. Work no node of the fleet could ever take
    is inadmissible (it starts no burst), unless a declared worker group's
    members could: then it waits for them, and counts in the queue depth."""
    if outcome.inadmissible:
        group = group_capacity(desired, request)
        if group is not None:
            return Deferred(service=service, replica=replica, reason=f"{WAITS_FOR_GROUP}{group} ({outcome.reason})", inadmissible=False)
    return Deferred(service=service, replica=replica, reason=outcome.reason, inadmissible=outcome.inadmissible)


def schedule_with_placer(
    snapshot: Snapshot,
    desired: DesiredState,
    *,
    leader: str | None = None,
    epoch: int | None = None,
) -> tuple[Placer, FleetPlan]:
    """`schedule`, also returning the pass's `Placer` with the plan's loads
    applied, so more work (a task dispatch) can be placed after the services."""
    declared = set(desired.hosts)
    # A node's cost class is its host file's (git), whatever its heartbeat
    # says: a host that claimed "free" in its own record would draw work.
    nodes = [_declared_cost(n, desired.hosts[n.node_id].host.cost) for n in snapshot.nodes if n.node_id in declared]
    ignored = sorted({n.node_id for n in snapshot.nodes if n.node_id not in declared})
    lane_jobs = lane_jobs_by_host(desired, {lane.id: lane.in_flight for lane in snapshot.lanes})
    placer = Placer(nodes, snapshot.now, desired.fleet.scheduler.strategy, lane_jobs)
    services = {s.id: s for s in desired.fleet.services}

    # 1. Keep what is in force and still feasible, before anything new claims
    #    the slots. The first record of a (service, replica) wins. Moves under
    #    way (make-before-break) are done, go on or are given up.
    in_force, pending, given_up = split_moves(snapshot)
    hedges = [p for p in in_force if p.hedge is not None]
    in_force = [p for p in in_force if p.hedge is None]
    if given_up:
        snapshot = snapshot.model_copy(update={"room_since": {n: t for n, t in snapshot.room_since.items() if n not in given_up}})
    kept: dict[tuple[str, int], Placement] = {}
    kept_on: set[tuple[str, str]] = set()  # (service, node): one replica per node
    keep_in_force(placer, in_force, services, kept, kept_on)
    moving = keep_moves(placer, pending, services, kept, kept_on)
    promote_hedges(placer, hedges, services, kept, kept_on)
    hedging = place_hedges(placer, desired, snapshot, kept, hedges)

    # 2. Place the rest, most demanding services first.
    placements: list[Placement] = list(kept.values())
    deferred: list[Deferred] = []
    cost_order = desired.fleet.scheduler.cost_order
    # Each service's nodes, gathered once (not a scan of every kept placement per service).
    hosts_of: dict[str, set[str]] = defaultdict(set)
    for key, p in [*kept.items(), *moving.items()]:
        hosts_of[key[0]].add(p.node)
    for service in _placement_order(desired.fleet.services):
        request = Request.for_service(service, cost_order)
        hosting = set(hosts_of.get(service.id, ()))
        for replica in range(service.replicas):
            if (service.id, replica) in kept:
                continue
            outcome = placer.place(request, exclude=hosting)
            if isinstance(outcome, Choice):
                hosting.add(outcome.node)
                placements.append(Placement(service=service.id, replica=replica, node=outcome.node, tier=outcome.tier, fallback=outcome.fallback))
            else:
                deferred.append(_deferred(desired, request, service.id, replica, outcome))

    # 3. Work comes home: replicas off paid hosts, one per service at a time.
    moving |= bring_home(placer, desired, snapshot, kept, moving, placements)
    placements += moving.values()
    placements += hedging
    placements.sort(key=lambda p: (p.service, p.replica, p.replaces is not None, p.hedge is not None))
    plan = FleetPlan(
        epoch=snapshot.epoch if epoch is None else epoch,
        leader=leader or snapshot.leader or "what-if",
        created=utc(snapshot.now),
        placements=placements,
        deferred=sorted(deferred, key=lambda d: (d.service, d.replica)),
        # The lanes beside the services this plan places (one account per host).
        lanes=lane_views(desired, snapshot, placements),
        ignored_nodes=ignored,
        room_since=room_memory(placer, desired, snapshot, placements),
        suspects=dict(snapshot.suspects),
    )
    return placer, plan


def keep_in_force(
    placer: Placer,
    in_force: Iterable[Placement],
    services: Mapping[str, Service],
    kept: dict[tuple[str, int], Placement],
    kept_on: set[tuple[str, str]],
) -> None:
    """Keep what is in force and still feasible: the first record of a
    (service, replica) wins, one replica of a service per node. Updates
    `kept` and `kept_on`."""
    for old in sorted(in_force, key=lambda p: (p.service, p.replica)):
        service = services.get(old.service)
        if service is None or old.replica >= service.replicas or (old.service, old.replica) in kept:
            continue
        if (old.service, old.node) in kept_on:
            continue  # a sibling already runs there: this replica moves
        if placer.keep(old.node, Request.for_service(service)):
            kept_on.add((old.service, old.node))
            tier = placer.nodes[old.node].tier
            kept[(old.service, old.replica)] = Placement(
                service=old.service,
                replica=old.replica,
                node=old.node,
                tier=tier,
                fallback=TIER_SCORE[tier] < TIER_SCORE[service.min_tier],
            )


def promote_hedges(
    placer: Placer,
    hedges: Iterable[Placement],
    services: Mapping[str, Service],
    kept: dict[tuple[str, int], Placement],
    kept_on: set[tuple[str, str]],
) -> None:
    """A hedge whose replica lost its own placement (the suspected node went
    offline at the node timeout) becomes that replica's placement, when it
    can stay. Updates `kept` and `kept_on`."""
    for h in sorted(hedges, key=lambda p: (p.service, p.replica, p.node)):
        key = (h.service, h.replica)
        service = services.get(h.service)
        if service is None or key in kept or h.replica >= service.replicas or (h.service, h.node) in kept_on:
            continue
        if placer.keep(h.node, Request.for_service(service)):
            kept_on.add((h.service, h.node))
            tier = placer.nodes[h.node].tier
            kept[key] = Placement(
                service=h.service, replica=h.replica, node=h.node, tier=tier, fallback=TIER_SCORE[tier] < TIER_SCORE[service.min_tier]
            )


def place_hedges(
    placer: Placer, desired: DesiredState, snapshot: Snapshot, kept: Mapping[tuple[str, int], Placement], before: Iterable[Placement]
) -> list[Placement]:
    """The hedges of this plan (core.scheduling.suspicion): for each replica
    kept on a hedged node (suspected, recovered within a stable window, or
    held off for blinking) of a service that may be hedged (`may_hedge`), an
    extra placement on the best other node by the usual tier rules, marked
    `hedge` with the node it stands in for. The last plan's hedge stays
    where it is while it still fits."""
    hedged = hedged_nodes(snapshot, desired.fleet.flap.window_s)
    if not hedged:
        return []
    services = {s.id: s for s in desired.fleet.services}
    previous = {(h.service, h.replica): h for h in before}
    cost_order = desired.fleet.scheduler.cost_order
    out: list[Placement] = []
    for key in sorted(kept):
        p = kept[key]
        service = services[p.service]
        if p.node not in hedged or not may_hedge(service):
            continue
        request = Request.for_service(service, cost_order)
        old = previous.get(key)
        if old is not None and old.hedge == p.node and old.node not in hedged and placer.keep(old.node, request):
            tier = placer.nodes[old.node].tier
            out.append(
                p.model_copy(update={"node": old.node, "tier": tier, "fallback": TIER_SCORE[tier] < TIER_SCORE[service.min_tier], "hedge": p.node})
            )
            continue
        outcome = placer.place(request, exclude=hedged | {p.node})
        if isinstance(outcome, Choice):
            out.append(Placement(service=p.service, replica=p.replica, node=outcome.node, tier=outcome.tier, fallback=outcome.fallback, hedge=p.node))
    return out
