"""A phaze fleet's second lane health signal: each lane's agent as phaze itself sees it.

phaze a3fd169 classifies an agent from its agents.last_seen_at
(services/agent_liveness.py `classify`: revoked, never, then alive under
AGENT_LIVENESS_ALIVE_SECONDS = 90, stale under AGENT_LIVENESS_STALE_SECONDS =
300, dead; constants.py). The fabric reads the row on phaze's broker
(tests/integration/test_phaze_agents_pg.py) and joins it to each lane
(engine.lane_states.with_lane_states): a compute lane's agent_ref, the local
lane's [phaze] fileserver_agent. The cards and `fabric lane status` show it
beside phaze's cap; a read that fails leaves the agent `unknown`, never the pass.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import PHAZE_AGENT_ALIVE_S, PHAZE_AGENT_STALE_S, Snapshot, phaze_agent_status
from reconciler.core.views.cards import fleet_status, status_document
from reconciler.engine.lane_states import lane_agents, with_lane_states
from reconciler.ports import LaneBrokerUnavailable
from tests.conftest import EXAMPLE_FLEET
from tests.support.fakes import FakeLaneBroker

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("ago", "revoked", "status"),
    [
        (0.0, False, "alive"),
        (PHAZE_AGENT_ALIVE_S - 0.1, False, "alive"),
        (PHAZE_AGENT_ALIVE_S, False, "stale"),
        (PHAZE_AGENT_STALE_S - 0.1, False, "stale"),
        (PHAZE_AGENT_STALE_S, False, "dead"),
        (None, False, "never"),
        (5.0, True, "revoked"),
        (None, True, "revoked"),
        (-0.5, False, "alive"),  # clocks a little apart: not nonsense
        (-60.0, False, "unknown"),
    ],
)
def test_phaze_classifies_its_agents_so(ago: float | None, revoked: bool, status: str) -> None:
    assert phaze_agent_status("a1-arm64", seen_ago_s=ago, revoked=revoked).status == status
    assert (PHAZE_AGENT_ALIVE_S, PHAZE_AGENT_STALE_S) == (90, 300), "phaze a3fd169 constants.py"


def test_each_lane_is_joined_to_its_agent_in_phaze() -> None:
    desired = load_desired(EXAMPLE_FLEET)
    assert lane_agents(desired) == {"a1-arm64": "a1-arm64", "x86-spill": "x86-spill", "local": "lux"}


def snapshot_with(broker: FakeLaneBroker) -> tuple[object, Snapshot]:
    desired = load_desired(EXAMPLE_FLEET)
    return desired, with_lane_states(Snapshot(now=NOW), broker, desired)


def test_the_cards_show_phazes_word_beside_its_cap() -> None:
    broker = FakeLaneBroker()
    broker.agents = {"a1-arm64": (12.0, False), "x86-spill": (400.0, False)}
    desired, snapshot = snapshot_with(broker)
    lanes = {lane["id"]: lane for lane in status_document(fleet_status(desired, snapshot, None, NOW))["lanes"]}  # type: ignore[arg-type]
    assert "· phaze cap 2 · phaze sees agent a1-arm64 alive (12 s ago)" in lanes["a1-arm64"]["card"]
    assert "· phaze cap 4 · phaze sees agent x86-spill dead (400 s ago)" in lanes["x86-spill"]["card"]
    assert lanes["local"]["phaze_agent"]["reason"] == "no row in phaze's agents table (not registered with phaze)"


class AgentsUnreachable(FakeLaneBroker):
    def phaze_agents(self, agent_ids):  # type: ignore[no-untyped-def]
        raise LaneBrokerUnavailable("phaze's broker: connection refused")


def test_an_unreachable_read_is_unknown_and_the_lanes_still_read() -> None:
    broker = AgentsUnreachable()
    broker.workers = {"phaze-agent-a1-arm64-analyze": 1}
    _, snapshot = snapshot_with(broker)
    lanes = {lane.id: lane for lane in snapshot.lanes}
    assert lanes["a1-arm64"].workers == 1
    assert lanes["a1-arm64"].phaze_agent is not None and lanes["a1-arm64"].phaze_agent.status == "unknown"
    assert lanes["a1-arm64"].phaze_agent.reason == "not read: phaze's broker: connection refused"


def test_no_phaze_agents_are_read_for_the_fabrics_own_lanes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.support.harness.own_lanes import own_lanes_fleet

    desired = load_desired(own_lanes_fleet(tmp_path / "own"))
    assert lane_agents(desired) == {}
    snapshot = with_lane_states(Snapshot(now=NOW), AgentsUnreachable(), desired)
    assert all(lane.phaze_agent is None for lane in snapshot.lanes)
