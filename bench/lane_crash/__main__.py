"""From an agent's SIGKILL to its job running again, beside the goal (the worker heartbeat's lapse plus one dispatch pass).

Run: .venv/bin/python bench/lane_crash [--rounds N] [--beat S] [--grace S] [--interval S]

A throwaway PostgreSQL (tests/support/harness/postgres.py), the example fleet on the
fabric's own queues (tests/integration/own_lanes.py) and, each round, two
agent processes on a1-arm64's queue (tests/support/harness/saq_agent.py: real SAQ
workers beating every --beat seconds). A dispatcher runs `dispatch_pass`
every --interval seconds. Each round: one long job is dispatched, the agent
that runs it is SIGKILLed, and the bench notes when the dispatcher told the
run crashed and when the other agent began the job's next run. The goal
is lapse + interval, lapse = beat + 1 (saq's stats ttl) + grace.
Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psycopg  # noqa: E402

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker  # noqa: E402
from reconciler.adapters.registry_sqlite import SqliteRegistry  # noqa: E402
from reconciler.core.scheduling.lanes import crash_timing  # noqa: E402
from reconciler.engine.dispatch import DispatchEvent, dispatch_pass  # noqa: E402
from reconciler.engine.lane_states import lane_targets  # noqa: E402
from reconciler.ports import DispatchFence  # noqa: E402
from tests.support.clock import FakeClock  # noqa: E402
from tests.support.harness.postgres import postgres_server  # noqa: E402
from tests.support.harness.saq_agent import AgentProcess, read_log  # noqa: E402
from tests.support.harness.waiting import wait_until  # noqa: E402
from tests.support.lane_crash_fleet import own_lanes_fleet  # noqa: E402
from tests.support.registry_store import beat_example_fleet  # noqa: E402


def started(agent: AgentProcess, key: str) -> dict | None:
    return next((e for e in read_log(agent.log) if e["ev"] == "start" and e["key"] == key), None)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/lane_crash")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--beat", type=int, default=1, help="the agents' worker_info interval, s (scheduler.lane_worker_beat_s)")
    parser.add_argument("--grace", type=int, default=1, help="scheduler.lane_crash_grace_s")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between dispatch passes (fabric lane dispatch --interval)")
    args = parser.parse_args()
    with postgres_server() as pg, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        desired = own_lanes_fleet(tmp / "fleet", beat_s=args.beat, grace_s=args.grace)
        lapse = crash_timing(desired.fleet.scheduler).lapse_s
        goal = lapse + args.interval
        queue = lane_targets(desired)["a1-arm64"].queue
        dsn = pg.database("bench")
        clock = FakeClock()
        registry = SqliteRegistry(str(tmp / "r.sqlite"), timing=desired.fleet.timing, flap=desired.fleet.flap, clock=clock)
        beat_example_fleet(registry)
        broker = PostgresLaneBroker(dsn, clock)
        broker.jobs()  # saq's tables and the fabric's, before any agent starts
        heard: list[tuple[float, DispatchEvent]] = []
        stop = threading.Event()

        def dispatcher() -> None:
            while not stop.is_set():
                dispatch_pass(registry, broker, desired, fence=DispatchFence.fixed(1), emit=lambda e: heard.append((time.time(), e)))
                stop.wait(args.interval)

        settled_s, again_s = [], []
        thread = threading.Thread(target=dispatcher, daemon=True)
        agents: list[AgentProcess] = []
        try:
            for n in range(args.rounds):
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("TRUNCATE fabric_lane_jobs, saq_jobs, saq_stats")
                agents = [AgentProcess(dsn, queue, tmp / f"r{n}-{name}.log", beat=args.beat) for name in ("one", "two")]
                for agent in agents:
                    agent.start()
                wait_until(lambda: all(a.ready() for a in agents), timeout=60, what="both agents beating")  # noqa: B023
                if not thread.is_alive():
                    thread.start()
                job = f"round-{n}"
                broker.enqueue([(job, 3600.0)])
                runner = wait_until(lambda: next((a for a in agents if started(a, f"{job}.1")), None), timeout=60, what=f"{job} running")  # noqa: B023
                survivor = agents[1] if runner is agents[0] else agents[0]
                killed_at = runner.kill()
                again = wait_until(lambda: started(survivor, f"{job}.2"), timeout=60 + 10 * goal, what=f"{job} running again")  # noqa: B023
                told = next(at for at, e in heard if e.job == job and e.outcome == "crashed")
                settled_s.append(told - killed_at)
                again_s.append(again["t"] - killed_at)
                print(f"round {n}: SIGKILL -> settled as crashed {settled_s[-1]:5.2f} s, -> running again {again_s[-1]:5.2f} s", flush=True)
                for agent in agents:
                    agent.stop()
        finally:
            stop.set()
            for agent in agents:
                agent.stop()
            if thread.is_alive():
                thread.join(30)
            broker.close()
            registry.close()
        print(
            f"SIGKILL -> running again: median {statistics.median(again_s):.2f} s, max {max(again_s):.2f} s"
            f" | settled as crashed: median {statistics.median(settled_s):.2f} s, max {max(settled_s):.2f} s"
            f" | goal {goal:g} s (lapse {lapse:g} s = beat {args.beat} + 1 + grace {args.grace}; one pass {args.interval:g} s)"
        )


if __name__ == "__main__":
    main()
