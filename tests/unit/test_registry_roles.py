"""The Registry port split by role: small Protocols, their union for the
adapters, and the engine holding the narrowest role it uses."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from reconciler import ports
from reconciler.adapters.registry_etcd import EtcdRegistry
from reconciler.adapters.registry_sqlite import SqliteRegistry
from reconciler.engine import (
    admit,
    dispatch,
    fleet_view,
    heartbeat,
    leader,
    leader_step,
    pending,
    plan_source,
    reconcile,
    scaling_step,
    status,
    watch,
)

ENGINE = Path(__file__).resolve().parents[2] / "reconciler" / "engine"

# The method groups: each method of the port is in exactly one.
GROUPS = (
    ports.Heartbeats,
    ports.EpochReads,
    ports.PlanReads,
    ports.FleetReads,
    ports.Candidacy,
    ports.LeaderWrites,
    ports.Drains,
    ports.HostWatch,
    ports.Liveness,
    ports.PendingReports,
    ports.PendingReads,
    ports.MemberReports,
    ports.MemberReads,
    ports.RegistryConnection,
)


def own_methods(protocol: type) -> set[str]:
    return {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}


def methods(protocol: type) -> set[str]:
    """The methods of a role: its own and those of the roles it is made of."""
    return set().union(*(own_methods(c) for c in protocol.__mro__ if c.__module__ == ports.__name__))


def test_registry_is_the_union_of_the_groups_and_each_method_is_in_one_group() -> None:
    seen: dict[str, str] = {}
    for group in GROUPS:
        for name in own_methods(group):
            assert name not in seen, f"{name} is in both {seen[name]} and {group.__name__}"
            seen[name] = group.__name__
    assert methods(ports.Registry) == set(seen), "Registry defines nothing of its own: a new method goes into a group"
    assert {"heartbeat", "newest_plan", "watch_host", "close"} <= set(seen)


def test_the_adapters_implement_every_role_with_the_ports_signatures() -> None:
    for adapter in (SqliteRegistry, EtcdRegistry):
        for name in sorted(methods(ports.Registry)):
            port = list(inspect.signature(getattr(ports.Registry, name)).parameters)
            assert hasattr(adapter, name), f"{adapter.__name__} lacks {name}"
            assert list(inspect.signature(getattr(adapter, name)).parameters) == port, f"{adapter.__name__}.{name}"


def test_each_user_holds_the_role_made_for_it() -> None:
    """What each part of the engine is given (the annotations as written)."""
    held = {
        "the pass": inspect.signature(plan_source.read_registry).parameters["connect"].annotation,
        "the pass's epoch re-check": inspect.signature(plan_source.epoch_moved_past).parameters["connect"].annotation,
        "the pass's ports": reconcile.PassPorts.__annotations__["open_registry"],
        "a pending machine's pass": reconcile.PassPorts.__annotations__["open_pending"],
        "a pending machine's report": inspect.signature(pending.pending_pass).parameters["connect"].annotation,
        "fabric admit": inspect.signature(admit.admit).parameters["pending"].annotation,
        "the beat after activation": inspect.signature(heartbeat.beat_after_activation).parameters["connect"].annotation,
        "the edge's fleet view": inspect.signature(fleet_view.read_fleet_view).parameters["connect"].annotation,
        "the watcher": watch.Watcher.__annotations__["registry"],
        "the leader loop": leader.LeaderLoop.__annotations__["registry"],
        "a candidate's one-shot step": inspect.signature(leader_step.lead_once).parameters["registry"].annotation,
        "the scaling step": scaling_step.ScalingStep.__annotations__["registry"],
        "the dispatcher": inspect.signature(dispatch.dispatch_pass).parameters["registry"].annotation,
        "fabric status": inspect.signature(status.live_status).parameters["registry"].annotation,
        "the history": inspect.signature(status.fleet_history).parameters["registry"].annotation,
    }
    assert held == {
        "the pass": "Callable[[], PassRegistry]",
        "the pass's epoch re-check": "Callable[[], EpochConnection]",
        "the pass's ports": "Callable[[FleetConfig], PassRegistry]",
        "a pending machine's pass": "Callable[[FleetConfig], PendingConnection]",
        "a pending machine's report": "Callable[[], PendingConnection]",
        "fabric admit": "PendingReads",
        "the beat after activation": "Callable[[], BeatConnection]",
        "the edge's fleet view": "Callable[[], FleetViewConnection]",
        "the watcher": "WatchRegistry",
        "the leader loop": "LeaderRegistry",
        "a candidate's one-shot step": "LeaderRegistry",
        "the scaling step": "LeaderRegistry",
        "the dispatcher": "RegistryReads",
        "fabric status": "RegistryReads",
        "the history": "FleetReads",
    }


def test_the_roles_are_narrower_than_the_port() -> None:
    whole = methods(ports.Registry)
    assert methods(ports.WatchRegistry) == {"watch_host", "newest_plan", "plan_read", "plan_glance"}
    assert methods(ports.EpochConnection) == {"epoch", "close"}
    assert methods(ports.BeatConnection) == {"heartbeat", "close"}
    # fabric-watch's own connection: its liveness record and, on an edge, its Caddy's upstreams (issue 30).
    assert methods(ports.LivenessConnection) == {"keep_alive", "report_edge_upstreams", "close"}
    # A pending machine reports itself and does nothing else (etcd: the joining identity).
    assert methods(ports.PendingConnection) == {"report_pending", "close"}
    assert "report_pending" not in methods(ports.LeaderRegistry) | methods(ports.RegistryReads) | methods(ports.PassRegistry)
    assert "set_drain" not in methods(ports.PassRegistry) and "watch_host" not in methods(ports.PassRegistry)
    writes = (
        methods(ports.LeaderWrites)
        | methods(ports.Candidacy)
        | methods(ports.Heartbeats)
        | methods(ports.Drains)
        | methods(ports.Liveness)
        | methods(ports.PendingReports)
    )
    for role in (ports.RegistryReads, ports.FleetViewConnection, ports.WatchRegistry, ports.EpochConnection):
        assert not methods(role) & writes, f"{role.__name__} only reads"
    for role in (ports.LeaderRegistry, ports.PassRegistry):
        assert methods(role) < whole


def test_the_engine_never_takes_the_whole_registry() -> None:
    """The union is for the adapters and the wiring; an engine module names a role."""
    offenders = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name) and node.id == "Registry" or isinstance(node, ast.alias) and node.name == "Registry":
                offenders.append(f"{path.name}:{getattr(node, 'lineno', '?')}")
    assert not offenders, f"the engine takes a role of the Registry port, not the whole port: {offenders}"
