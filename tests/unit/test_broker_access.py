"""phaze's broker by role (reconciler.core.desired.broker_access): the roles
the example fleet's lanes need, and the steps init-roles makes: none when the
broker holds them, only what is missing or not wanted otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.core.desired.broker_access import (
    DISPATCHER,
    LANE_FENCE,
    MAX_IDENTIFIER,
    READER,
    SAQ_JOBS,
    SAQ_STATS,
    SUPERSEDED_QUEUE,
    BrokerState,
    agent_role,
    broker_roles,
    role_steps,
    search_path_of,
    wanted_policies,
)
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from tests.support.harness.own_lanes import OWN_A1, OWN_LOCAL, own_lanes_fleet


@pytest.fixture(scope="module")
def desired(tmp_path_factory: pytest.TempPathFactory) -> DesiredState:
    return load_desired(own_lanes_fleet(tmp_path_factory.mktemp("own") / "fleet"))


def held(desired: DesiredState) -> BrokerState:
    """The state init-roles leaves behind for `desired`."""
    want = broker_roles(desired)
    return BrokerState(
        roles=frozenset(r.name for r in want),
        privileges=frozenset((r.name, obj, p) for r in want for obj, ps in r.privileges.items() for p in ps),
        row_security=frozenset({SAQ_JOBS, SAQ_STATS}),
        policies={(p.table, p.role): p.definition for p in wanted_policies(want)},
        schemas=frozenset(r.name for r in want if r.own_schema),
        search_paths={r.name: search_path_of(r.name) for r in want if r.own_schema},
    )


def test_the_roles_of_the_example_fleets_own_lanes(desired: DesiredState) -> None:
    roles = {r.name: r for r in broker_roles(desired)}
    assert set(roles) == {READER, DISPATCHER, "fabric-agent-a1-arm64", "fabric-agent-x86-spill", "fabric-agent-local"}
    assert all(ps == frozenset({"SELECT"}) for ps in roles[READER].privileges.values())
    assert roles[DISPATCHER].privileges[LANE_FENCE] == frozenset({"SELECT", "UPDATE"}), "the fence row: no INSERT, no DELETE"
    agent = roles["fabric-agent-a1-arm64"]
    assert agent.queues == (OWN_A1,) and roles["fabric-agent-local"].queues == (OWN_LOCAL,)
    assert set(agent.privileges) == {SAQ_JOBS, SAQ_STATS}, "an agent touches no table of the fabric's"
    assert "INSERT" not in agent.privileges[SAQ_JOBS], "an agent makes no job"
    assert roles[READER].queues is None and roles[DISPATCHER].queues is None


def test_an_agents_policies_are_its_queue_and_its_set_aside_runs(desired: DesiredState) -> None:
    policies = {(p.table, p.role): p for p in wanted_policies(broker_roles(desired))}
    assert policies[(SAQ_JOBS, "fabric-agent-a1-arm64")].queues == tuple(sorted((OWN_A1, SUPERSEDED_QUEUE)))
    assert policies[(SAQ_STATS, "fabric-agent-a1-arm64")].queues == (OWN_A1,), "a beat only on its own queue"
    assert policies[(SAQ_STATS, READER)].queues is None
    assert (SAQ_JOBS, READER) in policies and (SAQ_JOBS, DISPATCHER) in policies


def test_nothing_to_do_when_the_broker_holds_the_roles(desired: DesiredState) -> None:
    assert role_steps(broker_roles(desired), held(desired)) == []


def test_a_fresh_broker_gets_every_role_grant_policy_and_schema(desired: DesiredState) -> None:
    steps = role_steps(broker_roles(desired), BrokerState())
    kinds = [s.kind for s in steps]
    assert kinds[: len(broker_roles(desired))] == ["create_role"] * len(broker_roles(desired)), "roles first"
    assert kinds.count("schema") == kinds.count("search_path") == 3
    assert kinds.count("row_security") == 2 and "revoke" not in kinds and "drop_policy" not in kinds
    assert "granted UPDATE on fabric_lane_fence to fabric-dispatcher" in [s.describe() for s in steps]


def test_an_extra_privilege_is_revoked_and_a_changed_policy_made_again(desired: DesiredState) -> None:
    have = held(desired)
    extra = ("fabric-agent-a1-arm64", LANE_FENCE, "UPDATE")
    stale = {**have.policies, (SAQ_STATS, "fabric-agent-a1-arm64"): "fabric: written by hand"}
    other = ("someone-else", LANE_FENCE, "UPDATE")  # not a fabric-* role: left alone
    steps = role_steps(broker_roles(desired), BrokerState(**{**have.__dict__, "privileges": have.privileges | {extra, other}, "policies": stale}))
    assert [s.describe() for s in steps] == [
        "revoked UPDATE on fabric_lane_fence from fabric-agent-a1-arm64",
        f"made policy fabric-agent-a1-arm64 on saq_stats: queue_key in {OWN_A1}",
    ]


def test_a_lane_that_left_keeps_its_role_with_nothing_granted(desired: DesiredState, tmp_path: Path) -> None:
    have = held(desired)
    gone = desired.model_copy(
        update={"fleet": desired.fleet.model_copy(update={"lanes": [la for la in desired.fleet.lanes if la.id != "x86-spill"]})}
    )
    described = [s.describe() for s in role_steps(broker_roles(gone), have)]
    assert "revoked SELECT on saq_jobs from fabric-agent-x86-spill" in described
    assert "dropped policy fabric-agent-x86-spill on saq_stats (not wanted)" in described
    assert not any("created" in line or "x86-spill" in line and "granted" in line for line in described)


def test_a_long_lane_id_gets_a_role_postgresql_does_not_truncate() -> None:
    long_id = "a" * 63
    name = agent_role(long_id)
    assert len(name) <= MAX_IDENTIFIER and name.startswith("fabric-agent-aaa") and name != agent_role("a" * 62)
    assert agent_role("a1-arm64") == "fabric-agent-a1-arm64"


def test_the_dispatcher_reads_its_own_dsn_file_and_everyone_else_the_readers(desired: DesiredState) -> None:
    """[phaze] dispatcher_url_file for the leader, dispatch and enqueue;
    queue_url_file (the reader's) for the rest; unset, one file for both."""
    from reconciler.wiring import queue_url_file

    phaze = desired.fleet.phaze.model_copy(update={"queue_url_file": "/run/secrets/reader.url", "dispatcher_url_file": "/run/secrets/dispatcher.url"})
    fleet = desired.fleet.model_copy(update={"phaze": phaze})
    assert queue_url_file(fleet) == Path("/run/secrets/reader.url")
    assert queue_url_file(fleet, dispatcher=True) == Path("/run/secrets/dispatcher.url")
    assert queue_url_file(fleet, "/tmp/given.url", dispatcher=True) == Path("/tmp/given.url"), "--queue-url-file wins"
    single = desired.fleet.model_copy(update={"phaze": phaze.model_copy(update={"dispatcher_url_file": None})})
    assert queue_url_file(single, dispatcher=True) == Path("/run/secrets/reader.url")
