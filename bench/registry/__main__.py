"""Registry figures on both backends: beat and snapshot latency, how fast a
silent node and a dead leader are noticed (lane jobs: bench/lanes).

Run: /tmp/venv/bin/python bench/registry [--beats N] [--nodes N]

Backends: a sqlite file (tmpfs /tmp), one etcd member, and a three-member
etcd cluster on loopback (started here and stopped by PID at the end). Prints
for each:
  - heartbeat: median and 95th percentile of one beat (one node re-beating)
  - snapshot: median time to read the whole registry with --nodes nodes
  - silent node noticed: from a node's last beat (TTL 1 s) until a waiting
    leader is woken (wait_for_change); ideal = the TTL
  - takeover: from a leader's last renewal (lease TTL 2 s) until a waiting
    follower wins the campaign; ideal = the TTL
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.adapters.registry_etcd import EtcdRegistry  # noqa: E402
from reconciler.adapters.registry_sqlite import SqliteRegistry  # noqa: E402
from reconciler.core.desired.model import FlapSettings, TimingSettings  # noqa: E402
from reconciler.core.live.records import NodeRecord  # noqa: E402
from tests.support.harness.etcd import etcd_cluster  # noqa: E402


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def bench(name: str, open_registry, beats: int, nodes: int) -> None:
    opened = []

    def new():
        r = open_registry()
        opened.append(r)
        return r

    try:
        r = new()
        times = []
        for _ in range(beats):
            t = time.perf_counter()
            r.heartbeat(NodeRecord(node_id="bench-node", tier="cpu_ffmpeg"), ttl_s=30)
            times.append(time.perf_counter() - t)
        times.sort()
        beat = f"{ms(statistics.median(times))} median, {ms(times[int(len(times) * 0.95)])} p95"

        for i in range(nodes):
            r.heartbeat(NodeRecord(node_id=f"n{i}", tier="cpu_ffmpeg", max_concurrent_tasks=4), ttl_s=30)
        snaps = []
        for _ in range(20):
            t = time.perf_counter()
            r.snapshot(lanes=["a1-arm64"])
            snaps.append(time.perf_counter() - t)

        watcher = new()
        watcher.wait_for_change(0)
        r.heartbeat(NodeRecord(node_id="silent", tier="relay"), ttl_s=1)
        last_beat = time.perf_counter()
        while not watcher.wait_for_change(5):  # the join itself
            pass
        while not watcher.wait_for_change(5):
            pass
        noticed = time.perf_counter() - last_beat

        a, b = new(), new()
        term = a.campaign("lux", 2)
        b.wait_for_change(0)
        a.renew(term)
        renewed = time.perf_counter()
        won = None
        while won is None:
            won = b.campaign("qfox-1", 2)
            if won is None:
                b.wait_for_change(0.5)
        takeover = time.perf_counter() - renewed

        print(f"{name}")
        print(f"  heartbeat            {beat}")
        print(f"  snapshot ({nodes} nodes) {ms(statistics.median(snaps))} median")
        print(f"  silent node noticed  {noticed:.2f} s after its last beat (TTL 1 s)")
        print(f"  takeover             {takeover:.2f} s after the last renewal (lease TTL 2 s)")
    finally:
        for registry in opened:
            registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beats", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=100)
    args = parser.parse_args()
    common = dict(timing=TimingSettings(), flap=FlapSettings(), clock=SystemClock())
    with tempfile.TemporaryDirectory() as d:
        bench("sqlite (one file, WAL)", lambda: SqliteRegistry(Path(d) / "r.sqlite", **common), args.beats, args.nodes)
    for members in (1, 3):
        with etcd_cluster(members=members) as cluster:
            prefix = f"/bench{uuid.uuid4().hex[:8]}"
            bench(
                f"etcd ({members} member{'s' if members > 1 else ''}, loopback)",
                lambda prefix=prefix, cluster=cluster: EtcdRegistry(cluster.endpoints, prefix=prefix, **common),
                args.beats,
                args.nodes,
            )


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
