"""Prometheus metrics of one reconcile pass, for node_exporter's textfile collector.

Pure: `render_metrics(...)` returns the text exposition format (version 0.0.4);
this module decides the series (`Family`), prometheus_client's
`generate_latest` spells them (escaping, value format, HELP and TYPE lines;
its global registry is not used, and nothing is served). The apply step
writes the text atomically (temp file + rename, which the collector
requires so it never reads half a file) as
`<root>/var/lib/node_exporter/textfile/fabric.prom` (`core.pass_files.TEXTFILE_PATH`).

Two kinds of series:
- this host's pass: duration, last success time, success, live generation,
  the plan epoch it applied, rollbacks (a counter the apply step keeps);
- the fleet as this host saw it (only when a snapshot is given): node status,
  tier and cost class, node load, the paid capacity in use, lane in-flight/cap/up, deferred work by reason, leader.
  Every host exports the same fleet series, told apart by node_exporter's
  `instance` label: aggregate with max by (node) / max by (lane).

No sample carries a timestamp: the textfile collector rejects those.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from reconciler.core.desired.model import DesiredState, tier_score
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.timestamps import epoch_seconds
from reconciler.core.views.cards import FleetStatus, fleet_status

METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

# The states of fabric_node_status (a state set: one series per state, 1 for
# the current one), so `fabric_node_status{status="offline"} == 1` alerts.
NODE_STATES = ("active", "draining", "offline", "dead", "not_reporting")

MetricType = Literal["gauge", "counter"]


@dataclass(frozen=True)
class PassMetrics:
    """What the apply step knows about this host's passes.

    `rollbacks_total` is a counter: the apply step keeps it across passes (in
    its state directory) and only ever increases it.
    """

    # The pass just finished: how long it took and whether it succeeded.
    duration_s: float | None = None
    succeeded: bool | None = None
    # End of the most recent successful pass (this one or an earlier one).
    last_success: datetime | None = None
    # The generation now live on this host.
    generation: int | None = None
    # The epoch of the newest plan this host applied.
    plan_epoch: int | None = None
    rollbacks_total: int = 0


@dataclass
class Family:
    """One metric family: HELP, TYPE and its samples (label set -> value)."""

    name: str
    type: MetricType
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not METRIC_NAME_RE.match(self.name):
            raise ValueError(f"invalid metric name {self.name!r}")
        if self.type == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in _total")

    def add(self, value: float, **labels: str) -> None:
        for label in labels:
            if not LABEL_NAME_RE.match(label) or label.startswith("__"):
                raise ValueError(f"invalid label name {label!r} on {self.name}")
        self.samples.append((labels, value))


# --------------------------------------------------------------------------
# Exposition


def format_value(value: float) -> str:
    """A sample's value as the exposition spells it (prometheus_client: Go's float format)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # untyped in prometheus_client
    return text


class _Collected:
    """The families as a collector: what `generate_latest` reads (instead of a registry)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)

    def describe(self) -> Iterator[Metric]:
        return iter(())


def exposition(families: Iterable[Family]) -> str:
    """Families in the text format; samples sorted so equal input is equal text."""
    metrics = []
    for family in families:
        # prometheus_client names a counter without its _total (it adds it back).
        base = family.name.removesuffix("_total") if family.type == "counter" else family.name
        metric = Metric(base, family.help, family.type)
        for labels, value in sorted(family.samples, key=lambda s: sorted(s[0].items())):
            metric.add_sample(family.name, dict(sorted(labels.items())), float(value))
        metrics.append(metric)
    return generate_latest(_Collected(metrics)).decode()


# --------------------------------------------------------------------------
# The fabric's families


def pass_families(stats: PassMetrics) -> list[Family]:
    families = []
    if stats.duration_s is not None:
        f = Family("fabric_reconcile_duration_seconds", "gauge", "Wall time of the last reconcile pass.")
        f.add(stats.duration_s)
        families.append(f)
    if stats.succeeded is not None:
        f = Family("fabric_reconcile_success", "gauge", "1 if the last reconcile pass succeeded, 0 if it failed or rolled back.")
        f.add(1 if stats.succeeded else 0)
        families.append(f)
    if stats.last_success is not None:
        f = Family(
            "fabric_reconcile_last_success_timestamp_seconds",
            "gauge",
            "Unix time the last successful reconcile pass ended.",
        )
        f.add(epoch_seconds(stats.last_success))
        families.append(f)
    if stats.generation is not None:
        f = Family("fabric_generation", "gauge", "Generation of artifacts live on this host.")
        f.add(stats.generation)
        families.append(f)
    if stats.plan_epoch is not None:
        f = Family("fabric_plan_epoch", "gauge", "Epoch of the newest fleet plan this host applied.")
        f.add(stats.plan_epoch)
        families.append(f)
    f = Family("fabric_rollbacks_total", "counter", "Passes rolled back to the last good generation.")
    f.add(stats.rollbacks_total)
    families.append(f)
    return families


def fleet_families(status: FleetStatus) -> list[Family]:
    node_info = Family("fabric_node_info", "gauge", "A node of the fleet and its tier (always 1).")
    node_status = Family("fabric_node_status", "gauge", "Lifecycle status of a node: 1 for its current status, 0 for the others.")
    tier = Family("fabric_node_tier_score", "gauge", "A node's tier as a score, 10 for gpu_cuda down to 0 for relay.")
    in_flight = Family("fabric_node_in_flight", "gauge", "Tasks running on a node.")
    max_tasks = Family("fabric_node_max_concurrent_tasks", "gauge", "Most tasks a node may run at once.")
    held_off = Family("fabric_node_held_off", "gauge", "1 while a flapping node is held off new placements.")
    draining = Family("fabric_node_draining", "gauge", "1 while a node is drained or draining.")
    last_seen = Family("fabric_node_last_seen_timestamp_seconds", "gauge", "Unix time of a node's last heartbeat.")
    cost = Family("fabric_node_cost_info", "gauge", "A node's cost class: free, owned or paid (always 1).")
    for node in status.nodes:
        cost.add(1, node=node.node_id, cost=node.cost)
        current = node.status_id
        for state in NODE_STATES:
            node_status.add(1 if state == current else 0, node=node.node_id, status=state)
        draining.add(1 if node.draining else 0, node=node.node_id)
        if node.tier is None:
            continue
        node_info.add(1, node=node.node_id, tier=node.tier)
        tier.add(tier_score(node.tier), node=node.node_id)
        in_flight.add(node.in_flight, node=node.node_id)
        max_tasks.add(node.max_concurrent_tasks, node=node.node_id)
        held_off.add(1 if node.held_off_for_s is not None else 0, node=node.node_id)
        if node.last_seen is not None:
            last_seen.add(epoch_seconds(node.last_seen), node=node.node_id)

    lane_in_flight = Family("fabric_lane_in_flight", "gauge", "Jobs in flight on a lane.")
    lane_cap = Family("fabric_lane_cap", "gauge", "Most jobs a lane takes at once.")
    lane_rank = Family("fabric_lane_rank", "gauge", "A lane's rank: lowest is dispatched first.")
    lane_up = Family("fabric_lane_up", "gauge", "1 if the lane is online (its agent host active, its agent unit not down), 0 if it is offline.")
    for card in status.lanes:
        labels = {"lane": card.id, "kind": card.kind}
        lane_in_flight.add(card.in_flight, **labels)
        lane_cap.add(card.cap, **labels)
        lane_rank.add(card.rank, **labels)
        lane_up.add(1 if card.available else 0, **labels)

    paid_in_use = Family(
        "fabric_paid_slots_in_use",
        "gauge",
        "Slots of paid capacity in use: the load of the paid nodes that are up (alert on min_over_time(...[1h]) > 0).",
    )
    paid_in_use.add(status.paid_slots_in_use)
    paid_slots = Family("fabric_paid_slots", "gauge", "Capacity of the paid nodes that are up, in slots.")
    paid_slots.add(status.paid_slots)

    families = [node_info, node_status, tier, in_flight, max_tasks, held_off, draining, last_seen, cost, paid_in_use, paid_slots]
    families += [lane_in_flight, lane_cap, lane_rank, lane_up]

    if status.plan_known:
        deferred = Family(
            "fabric_deferred_replicas",
            "gauge",
            "Service replicas the plan could not place, by reason; state is waiting (for capacity) or inadmissible.",
        )
        counts = Counter(("waiting", r.reason) for r in status.waiting)
        counts.update(("inadmissible", r.reason) for r in status.inadmissible)
        for (state, reason), count in counts.items():
            deferred.add(count, state=state, reason=reason)
        families.append(deferred)

    if status.leader:
        leader = Family("fabric_leader_info", "gauge", "The fleet's leader as this host saw it (always 1).")
        leader.add(1, node=status.leader)
        failing = Family(
            "fabric_leader_failing",
            "gauge",
            "1 while the leader's steps keep failing (a registry error, a plan it could not publish): its plan does not move; 0 otherwise.",
        )
        problem = status.leader_problem
        failing.add(1 if problem is not None else 0, node=status.leader)
        families += [leader, failing]
        if problem is not None:
            since = Family("fabric_leader_failing_since_seconds", "gauge", "When the leader's failing steps began (Unix time), by the error's kind.")
            since.add(epoch_seconds(problem.since), node=status.leader, kind=problem.kind)
            families.append(since)
    return families


def render_metrics(
    stats: PassMetrics,
    desired: DesiredState | None = None,
    snapshot: Snapshot | None = None,
    plan: FleetPlan | None = None,
) -> str:
    """The whole textfile: this pass, plus the fleet when a snapshot is given."""
    families = pass_families(stats)
    if desired is not None and snapshot is not None:
        families += fleet_families(fleet_status(desired, snapshot, plan, snapshot.now))
        if stats.plan_epoch is None and plan is not None:
            f = Family("fabric_plan_epoch", "gauge", "Epoch of the newest fleet plan this host applied.")
            f.add(plan.epoch)
            families.append(f)
    return exposition(families)
