"""What the fabric's placement costs a Ray driver per task, against a plain `ray.remote` call in the same run.

Run: .venv/bin/python bench/ray_dispatch [--tasks N]   (needs the `ray` extra)

On a real Ray cluster built as the fabric renders it (tests/support/harness/ray_fleet.py:
qfox-1, a1-arm64 and lux from their replayed probes, a sqlite registry):
  - select_worker: one decision (registry snapshot read, Ray node table
    cached, the driver's running tasks pruned, the scheduler's rules)
  - fabric submit: `Dispatcher.adaptive_compute` (select_worker + a task
    pinned with NodeAffinitySchedulingStrategy) timed around the call only
  - plain submit: `where.remote(payload)` timed around the call only
  - round trip: submit + ray.get, each way
Each task is waited for (untimed) before the next submit, so every call
finds a free slot and no call is deferred. Prints the figures and the
ratios fabric/plain; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402

from reconciler.ray import Dispatcher, FallbackCount, Requirement  # noqa: E402
from tests.support.harness.ray_fleet import ray_fleet  # noqa: E402


@ray.remote(num_cpus=0)
def where(payload: bytes) -> str:
    return ray.get_runtime_context().get_node_id()


def per_task_us(total_s: float, tasks: int) -> float:
    return total_s / tasks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/ray_dispatch")
    parser.add_argument("--tasks", type=int, default=300)
    tasks = parser.parse_args().tasks
    payload = b"x" * 1024
    with tempfile.TemporaryDirectory() as tmp, ray_fleet(Path(tmp)) as fleet:
        fabric = Dispatcher.connect(fleet.registry_path)
        # Warm both paths (worker processes started, functions exported).
        ray.get([where.remote(payload) for _ in range(5)])
        ray.get([fabric.adaptive_compute(where, payload, min_tier="gpu_apu") for _ in range(5)])
        fabric.fallbacks = FallbackCount()  # the warm-up's five at once overflowed qfox-1's four slots

        requirement = Requirement(min_tier="gpu_apu", payload_size=len(payload))
        started = time.perf_counter()
        for _ in range(tasks):
            fabric.select_worker(requirement)
        select_s = time.perf_counter() - started

        plain_submit = plain_trip = fabric_submit = fabric_trip = 0.0
        for _ in range(tasks):
            t0 = time.perf_counter()
            ref = where.remote(payload)
            t1 = time.perf_counter()
            ray.get(ref)
            plain_submit += t1 - t0
            plain_trip += time.perf_counter() - t0

            t0 = time.perf_counter()
            ref = fabric.adaptive_compute(where, payload, min_tier="gpu_apu")
            t1 = time.perf_counter()
            ray.get(ref)
            fabric_submit += t1 - t0
            fabric_trip += time.perf_counter() - t0

        print(f"ray_dispatch: {tasks} tasks each way, 3 Ray nodes + head on this machine, sqlite registry")
        print(f"  select_worker alone       {per_task_us(select_s, tasks):9.0f} us/task")
        print(f"  plain ray.remote submit   {per_task_us(plain_submit, tasks):9.0f} us/task")
        print(f"  fabric select+submit      {per_task_us(fabric_submit, tasks):9.0f} us/task   ratio {fabric_submit / plain_submit:.1f}x")
        print(f"  plain round trip          {per_task_us(plain_trip, tasks):9.0f} us/task")
        print(f"  fabric round trip         {per_task_us(fabric_trip, tasks):9.0f} us/task   ratio {fabric_trip / plain_trip:.2f}x")
        print(f"  {fabric.fallbacks.line()} (select_worker alone and the fabric's submits)")


if __name__ == "__main__":
    main()
