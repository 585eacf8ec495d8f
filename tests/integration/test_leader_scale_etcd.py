"""The leader's step at fleet scale on a real etcd with its default limits.

etcd refuses a transaction of more than 128 operations (--max-txn-ops) and a
request over 1.5 MiB (--max-request-bytes); the module's etcd (tests/support/harness/etcd.py)
is started without either option, so these are the limits in force.

  1 1,000 nodes heartbeat through the registry adapter (the 5 example hosts and
    995 others); one real LeaderLoop step of lux (signing with its test key)
    advances all 1,000 through the lifecycle, schedules and publishes a plan;
    no transaction carried more than 128 operations nor any request 1.5 MiB
  2 300 of the others beat once more with a short TTL; once etcd expired their leases,
    the next step takes all 300 offline (and the rest stay active)
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.scheduling.placement import schedule
from reconciler.engine.leader import LeaderLoop
from tests.support.harness.etcd import EtcdCluster
from tests.support.harness.etcd_requests import recording_requests
from tests.support.harness.waiting import wait_until
from tests.support.registry_store import EXAMPLE_HOSTS, Store, scale_fleet_records

pytestmark = pytest.mark.integration

NODES = 1000
LAPSING = 300
SHORT_TTL_S = 2  # etcd grants at least its minimum TTL (1.5 s with the harness's election timeout)
LONG_TTL_S = 600
ETCD_MAX_TXN_OPS = 128
ETCD_MAX_REQUEST_BYTES = 1536 * 1024


def test_etcd_runs_with_default_limits(etcd: EtcdCluster) -> None:
    argv = etcd._argv(etcd.members[0], "new")
    assert not any(a.startswith(("--max-txn-ops", "--max-request-bytes")) for a in argv), argv


def test_one_step_leads_a_thousand_nodes_within_etcd_limits(etcd: EtcdCluster, tmp_path: Path) -> None:
    store = Store("etcd", {"backend": "etcd", "endpoints": etcd.endpoints, "prefix": f"/t{uuid.uuid4().hex[:12]}"}, None)
    desired = store.desired_dir(tmp_path)
    assert store.signed is not None
    others = [f"scale-{i:04d}" for i in range(NODES - len(EXAMPLE_HOSTS))]
    lapsing = set(others[:LAPSING])
    logs: list[str] = []
    with recording_requests() as seen:
        registry = store.open()
        loop = LeaderLoop(
            registry=registry,
            host="lux",
            load_desired=lambda: load_desired(desired),
            schedule=schedule,
            lease_ttl_s=60,
            log=logs.append,
            signer=store.signed.signer("lux"),
        )
        try:
            records = scale_fleet_records(others)
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda r: registry.heartbeat(r, ttl_s=LONG_TTL_S), records))

            # 1: one step leads all 1,000.
            loop.step()
            assert loop.leadership is not None, logs
            assert not [line for line in logs if "unreachable" in line or "not published" in line], logs
            plan = registry.newest_plan()
            assert plan is not None and plan.leader == "lux" and plan.signature is not None, logs
            assert plan.placements and {p.node for p in plan.placements} <= set(EXAMPLE_HOSTS), plan.placements
            assert sorted(plan.ignored_nodes) == others
            joined = [line for line in logs if ": active: first heartbeat" in line]
            assert len(joined) == NODES, logs[:5]
            states = {s.node_id: s.status for s in registry.node_states()}
            assert len(states) == NODES and set(states.values()) == {"active"}

            # 2: 300 beat once more with a short TTL and fall silent; the next step takes them offline at once.
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda r: registry.heartbeat(r, ttl_s=SHORT_TTL_S), [r for r in records if r.node_id in lapsing]))
            wait_until(
                lambda: sum(s.status == "offline" for s in registry.node_states()) == LAPSING,
                timeout=30,
                interval=0.2,
                what=f"etcd to expire the {LAPSING} short leases",
            )
            logs.clear()
            loop.step()
            assert loop.leadership is not None, logs
            offline = {line.split(":", 1)[0].removeprefix("node ") for line in logs if ": offline: no heartbeat" in line}
            assert offline == lapsing, logs[:5]
            stored = registry._read().states  # what the step wrote, not recomputed
            assert {n for n, s in stored.items() if s.status == "offline"} == lapsing
            assert sum(s.status == "active" for s in stored.values()) == NODES - LAPSING
        finally:
            if loop.leadership is not None:
                registry.resign(loop.leadership)
            store.close()
    # Many transactions (8 chunks for 1,000 first states), none over etcd's limits.
    assert seen.transactions > NODES // ETCD_MAX_TXN_OPS
    assert seen.largest_txn_ops <= ETCD_MAX_TXN_OPS - 2, seen
    assert seen.largest_txn_compares_plus_writes < ETCD_MAX_TXN_OPS, seen
    assert seen.largest_request_bytes < ETCD_MAX_REQUEST_BYTES, seen
