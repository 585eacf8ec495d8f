"""Lane job queue figures on both registry backends: enqueue, start+finish, and a dispatch pass.

Run: /tmp/venv/bin/python bench/lanes [--jobs N]

For a sqlite file and a real one-member etcd on loopback (tests/harness/etcd.py):
  - enqueue: N jobs in batches of 50 (jobs/s)
  - start+finish: one job started in a slot and finished, repeated (cycles/s):
    what one dispatcher and one worker cost per job
  - dispatch pass: `dispatch_pass` over N waiting jobs with the example fleet's
    lanes: the 6 cloud slots fill, the rest are held with a reason (local is
    gated by the spill wait) (decisions/s)
Prints the figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.cli.wiring import open_registry  # noqa: E402
from reconciler.core.desired.load import load_desired  # noqa: E402
from reconciler.core.desired.model import FleetConfig  # noqa: E402
from reconciler.engine.dispatch import dispatch_pass  # noqa: E402
from tests.conftest import EXAMPLE_FLEET  # noqa: E402
from tests.harness.etcd import etcd_cluster  # noqa: E402


def measure(name: str, settings: dict, sqlite_path: str | None, jobs: int) -> None:
    fleet = FleetConfig.model_validate({"fleet": {"domain": "t.example", "leader_candidates": ["lux"]}, "registry": settings})
    registry = open_registry(fleet, clock=SystemClock(), sqlite_path=sqlite_path)
    desired = load_desired(EXAMPLE_FLEET)
    try:
        ids = [f"bench-{i:05d}" for i in range(jobs)]
        started = time.perf_counter()
        for i in range(0, jobs, 50):
            registry.enqueue_jobs(ids[i : i + 50])
        enqueue_s = time.perf_counter() - started

        registry.enqueue_jobs(["cycle"])
        cycles = 100
        started = time.perf_counter()
        for _ in range(cycles):
            assert registry.start_job("cycle", "a1-arm64", 2) is not None
            registry.finish_job("cycle", requeue=True)
        cycle_s = time.perf_counter() - started
        registry.start_job("cycle", "a1-arm64", 2)
        registry.finish_job("cycle")

        started = time.perf_counter()
        events = dispatch_pass(registry, desired)
        pass_s = time.perf_counter() - started
        held = sum(1 for e in events if e.hold)
        print(
            f"{name:<7} enqueue {jobs / enqueue_s:8.0f} jobs/s | start+finish {cycles / cycle_s:6.0f} cycles/s "
            f"({cycle_s / cycles * 1000:.1f} ms) | dispatch pass over {len(events)} jobs: {pass_s * 1000:.0f} ms "
            f"({len(events) / pass_s:.0f} decisions/s; {len(events) - held} started, {held} held)"
        )
    finally:
        registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/lanes")
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "registry.sqlite")
        measure("sqlite", {"backend": "sqlite", "path": path}, path, args.jobs)
    with etcd_cluster(members=1) as cluster:
        measure("etcd", {"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/b{uuid.uuid4().hex[:8]}"}, None, args.jobs)


if __name__ == "__main__":
    main()
