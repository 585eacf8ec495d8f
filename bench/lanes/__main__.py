"""Lane queue figures on phaze's broker (SAQ on a real PostgreSQL): enqueue, dispatch+settle, a dispatch pass, racing dispatchers.

Run: .venv/bin/python bench/lanes [--jobs N]

A throwaway PostgreSQL (tests/support/harness/postgres.py) and a sqlite registry with
the example fleet's heartbeats; no SAQ worker runs, so lanes are taken
offline or online by writing worker stats rows as saq's workers do.
  - enqueue: N jobs in batches of 50 (jobs/s)
  - dispatch+settle: one job dispatched into a1-arm64's queue, its SAQ job
    marked failed (as a worker would), settled back to waiting, repeated
    (cycles/s): what the fabric's side costs per job
  - dispatch pass: `dispatch_pass` over N waiting jobs with the example
    fleet's lanes online: the free slots fill, the rest are held (decisions/s)
  - racing: 8 threads dispatch the same 200 jobs into a1-arm64 (cap 2):
    attempts/s, and the baseline of one thread in the same run (ratio)
Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.adapters.lane_broker_pg import PostgresLaneBroker  # noqa: E402
from reconciler.adapters.registry_sqlite import SqliteRegistry  # noqa: E402
from reconciler.core.desired.load import load_desired  # noqa: E402
from reconciler.engine.dispatch import dispatch_pass  # noqa: E402
from reconciler.engine.lane_states import lane_targets  # noqa: E402
from reconciler.ports import DispatchFence  # noqa: E402
from tests.support.harness.own_lanes import own_lanes_fleet  # noqa: E402
from tests.support.harness.postgres import postgres_server  # noqa: E402
from tests.support.registry_store import beat_example_fleet  # noqa: E402


def workers_beat(dsn: str, queues: list[str]) -> None:
    """A fresh stats row per queue, as a saq worker writes it (alive for an hour)."""
    with psycopg.connect(dsn) as conn:
        for queue in queues:
            conn.execute(
                "INSERT INTO saq_stats (worker_id, stats, queue_key, metadata, expire_at) VALUES (%s, '{}', %s, NULL, EXTRACT(EPOCH FROM NOW()) + 3600)"
                " ON CONFLICT (worker_id) DO UPDATE SET expire_at = EXCLUDED.expire_at",
                (f"bench-{queue}", queue),
            )


def race(dsn: str, target, threads: int, jobs: list[str]) -> float:
    queues = [PostgresLaneBroker(dsn, SystemClock()) for _ in range(threads)]
    attempts = [0] * threads
    start = threading.Barrier(threads)

    def run(n: int) -> None:
        start.wait()
        for job in jobs:
            queues[n].dispatch(job, target, DispatchFence.fixed(1))
            attempts[n] += 1

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    began = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - began
    for q in queues:
        q.close()
    return sum(attempts) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/lanes")
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    # The fabric's own lanes: the example fleet is phaze's, where phaze dispatches.
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as fleet_dir:
        desired = load_desired(own_lanes_fleet(Path(fleet_dir) / "fleet"))
    targets = lane_targets(desired)
    with postgres_server() as pg, tempfile.TemporaryDirectory() as tmp:
        dsn = pg.database("bench")
        clock = SystemClock()
        registry = SqliteRegistry(str(Path(tmp) / "r.sqlite"), timing=desired.fleet.timing, flap=desired.fleet.flap, clock=clock)
        beat_example_fleet(registry)
        lanes = PostgresLaneBroker(dsn, clock)
        lanes.jobs()  # the first use that needs them makes saq's tables and the fabric's
        workers_beat(dsn, [t.queue for t in targets.values()])
        ids = [f"bench-{i:05d}" for i in range(args.jobs)]
        started = time.perf_counter()
        for i in range(0, args.jobs, 50):
            lanes.enqueue([(job, None) for job in ids[i : i + 50]])
        enqueue_s = time.perf_counter() - started

        lanes.enqueue([("cycle", None)])
        cycles = 100
        started = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(cycles):
                assert lanes.dispatch("cycle", targets["a1-arm64"], DispatchFence.fixed(1)) is not None
                conn.execute("UPDATE saq_jobs SET status = 'failed' WHERE key LIKE 'cycle.%'")
                assert [s.job_id for s in lanes.settle()] == ["cycle"]
        cycle_s = time.perf_counter() - started

        started = time.perf_counter()
        events = dispatch_pass(registry, lanes, desired, fence=DispatchFence.fixed(1))
        pass_s = time.perf_counter() - started
        held = sum(1 for e in events if e.hold)

        race_dsn = pg.database("race")
        made = PostgresLaneBroker(race_dsn, clock)
        made.jobs()  # the first use that needs them makes saq's tables and the fabric's
        made.close()
        for label, name in (("one", "r1"), ("eight", "r8")):
            with psycopg.connect(race_dsn, autocommit=True) as conn:
                conn.execute("DELETE FROM fabric_lane_jobs")
                conn.execute("DELETE FROM saq_jobs")
            jobs = [f"{name}-{i:03d}" for i in range(200)]
            setup = PostgresLaneBroker(race_dsn, clock)
            setup.enqueue([(j, None) for j in jobs])
            setup.close()
            rate = race(race_dsn, targets["a1-arm64"], 1 if label == "one" else 8, jobs)
            if label == "one":
                baseline = rate
            else:
                racing = rate
        print(
            f"postgres enqueue {args.jobs / enqueue_s:8.0f} jobs/s | dispatch+settle {cycles / cycle_s:6.0f} cycles/s "
            f"({cycle_s / cycles * 1000:.1f} ms) | dispatch pass over {len(events)} jobs: {pass_s * 1000:.0f} ms "
            f"({len(events) / pass_s:.0f} decisions/s; {len(events) - held} started, {held} held)"
        )
        print(
            f"racing dispatch attempts (a1-arm64, cap 2, 200 jobs): 1 thread {baseline:.0f}/s, 8 threads {racing:.0f}/s (ratio {racing / baseline:.2f})"
        )
        lanes.close()
        registry.close()


if __name__ == "__main__":
    main()
