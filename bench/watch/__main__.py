"""How soon `fabric watch` starts a pass after a plan is published, on both backends.

Run: .venv/bin/python bench/watch [--plans N] [--window S] [--poll S]

Backends: a sqlite file (tmpfs /tmp) and one etcd member on loopback (started
here and stopped by PID at the end). For each, the watcher loop
(reconciler.engine.watch) runs in a thread with a start port that only notes
the time; the bench publishes --plans plans one after another (each moves a
service onto or off lux, so each changes lux's part: the watcher reads the
plan and the example fleet's files before it counts it), each once the
previous one's start was noted, and prints publish -> start: median, 95th
percentile and worst, beside the configured window (the start waits for it
on purpose) and poll, the median less the window (what the watcher itself
adds), and the median's share of a second (issue 14: a new plan acted on
within 1 s). Publishing right after a start lines each plan up with the
start of a sqlite poll: there the figures are the worst case, window + poll.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.adapters.registry_etcd import EtcdRegistry  # noqa: E402
from reconciler.adapters.registry_sqlite import SqliteRegistry  # noqa: E402
from reconciler.core.desired.model import FlapSettings, TimingSettings  # noqa: E402
from reconciler.core.live.models import FleetPlan, Placement  # noqa: E402
from reconciler.core.live.watching import WatchTimings  # noqa: E402
from reconciler.engine.desired_load import load_for_part  # noqa: E402
from reconciler.engine.watch import Watcher  # noqa: E402
from tests.support.harness.etcd import etcd_cluster  # noqa: E402

EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "hosts"


class NotingStarter:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.at = 0.0

    def pass_running(self) -> bool:
        return False

    def start_pass(self) -> None:
        self.at = time.perf_counter()
        self.started.set()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def bench(name: str, open_registry, plans: int, timings: WatchTimings) -> None:
    writer, followed = open_registry(), open_registry()
    starter = NotingStarter()
    # As fabric watch does: the example fleet's files read again at each new plan.
    desired_for = functools.partial(load_for_part, EXAMPLE_FLEET, "lux")
    watcher = Watcher(followed, starter, SystemClock(), "lux", desired_for, timings=timings, log=lambda _: None)
    thread = threading.Thread(target=watcher.run, daemon=True)
    thread.start()
    try:
        while not watcher.state.seen:
            time.sleep(0.01)
        term = writer.campaign("qfox-1", 600)
        assert term is not None
        latencies = []
        for i in range(plans):
            starter.started.clear()
            t = time.perf_counter()
            # Each plan moves lupine onto or off lux: a change of lux's part (one that is not starts no pass).
            node = "lux" if i % 2 == 0 else "qfox-1"
            placements = [Placement(service="lupine", replica=0, node=node, tier="cpu_ffmpeg")]
            writer.publish_plan(term, FleetPlan(epoch=0, leader="qfox-1", created=datetime.now(UTC), placements=placements))
            if not starter.started.wait(30):
                raise SystemExit(f"{name}: no start within 30 s of a published plan")
            latencies.append(starter.at - t)
        latencies.sort()
        median = statistics.median(latencies)
        p95 = latencies[int(0.95 * (len(latencies) - 1))]
        print(
            f"{name:>8}: publish -> start median {ms(median)}, p95 {ms(p95)}, worst {ms(latencies[-1])} over {plans} plans; "
            f"window {ms(timings.window_s)}, poll {ms(timings.poll_s)}; median - window {ms(median - timings.window_s)}; "
            f"median / 1 s = {median:.3f}"
        )
    finally:
        watcher.stop()
        thread.join(timeout=10)
        writer.close()
        followed.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", type=int, default=20)
    parser.add_argument("--window", type=float, default=WatchTimings().window_s)
    parser.add_argument("--poll", type=float, default=WatchTimings().poll_s)
    args = parser.parse_args()
    timings = WatchTimings(window_s=args.window, poll_s=args.poll)
    timing, flap = TimingSettings(), FlapSettings()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "registry.sqlite"
        bench("sqlite", lambda: SqliteRegistry(path, timing=timing, flap=flap, clock=SystemClock()), args.plans, timings)
    with etcd_cluster(members=1) as cluster:
        prefix = f"/bench{uuid.uuid4().hex[:8]}"
        bench("etcd", lambda: EtcdRegistry(cluster.endpoints, prefix=prefix, timing=timing, flap=flap, clock=SystemClock()), args.plans, timings)


if __name__ == "__main__":
    main()
