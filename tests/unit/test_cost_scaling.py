"""Bursts and vertical scaling respect cost (issue 32): idle free capacity is
activated before paid groups, and a free host's concurrency is raised before
paid capacity grows. Passes at chosen instants, the state carried between them
(tests.unit.test_scaling's Leader)."""

from __future__ import annotations

from tests.support.scaling import Leader, kinds, node


def test_a_burst_activates_idle_free_capacity_before_idle_paid_groups():
    leader = Leader()
    fleet = [node("paid-a", in_flight=0, cost="paid"), node("free-z", in_flight=0, cost="free"), node("owned-m", in_flight=0)]
    assert leader.at(0, fleet, queue_depth=11) == []
    assert kinds(leader.at(30, fleet, queue_depth=11)) == [("activate_idle", "free-z")]
    # The free group just activated is still idle: the paid one waits for it, no cloud hook either.
    assert leader.at(40, fleet, queue_depth=11) == []
    # Work reached the free host: the owned one is next, then the paid one.
    fleet[1] = node("free-z", in_flight=2, cost="free")
    assert kinds(leader.at(50, fleet, queue_depth=11)) == [("activate_idle", "owned-m")]
    fleet[2] = node("owned-m", in_flight=1)
    assert kinds(leader.at(60, fleet, queue_depth=11)) == [("activate_idle", "paid-a")]


def test_scaling_up_raises_a_free_hosts_concurrency_before_a_paid_ones():
    leader = Leader()
    hot = dict(in_flight=4, limit=4, max_concurrent_ceiling=6)
    fleet = [node("paid-a", cost="paid", **hot), node("free-z", cost="free", **hot)]
    assert leader.at(0, fleet) == []
    actions = leader.at(300, fleet)
    assert kinds(actions) == [("raise_concurrency", "free-z"), ("hold", "paid-a")]
    assert actions[0].max_concurrent_tasks == 5
    assert "paid: free-z raised first" in actions[1].reason
    # The free host at its ceiling and still busy: now the paid one grows (its window kept).
    fleet = [node("paid-a", cost="paid", **hot), node("free-z", cost="free", in_flight=6, limit=6, max_concurrent_ceiling=6)]
    assert kinds(leader.at(301, fleet)) == [("raise_concurrency", "paid-a")]


def test_a_paid_node_alone_is_raised_as_before():
    leader = Leader()
    fleet = [node("paid-a", cost="paid", in_flight=4, limit=4, max_concurrent_ceiling=6), node("free-z", cost="free", in_flight=0)]
    leader.at(0, fleet)
    assert kinds(leader.at(300, fleet)) == [("raise_concurrency", "paid-a")]
