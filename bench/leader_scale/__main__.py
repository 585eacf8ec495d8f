"""The leader's step at 1,000 and 10,000 declared, heart-beating nodes on a real etcd with default limits.

Run: PYTHONPATH=. /work/main/.venv/bin/python bench/leader_scale [--sizes 1000 10000]

For each size: one etcd member started here with etcd's default limits (no
--max-txn-ops, no --max-request-bytes: 128 ops per transaction, 1.5 MiB per
request), stopped by PID at the end. The example fleet's 5 hosts and synthetic
nodes heartbeat through the registry adapter (16 threads); every synthetic
node is declared (a host file each in the desired state's hosts/, as a
fleet of that size has: no node is ignored); lux, with a throwaway plan key,
leads with a real LeaderLoop and the real scheduler, its desired state
loaded as `fabric leader run` loads it (reconciler.adapters.desired_memo:
again only when the directory changed). The desired state's first load is
timed on its own (`desired load`), before the first step. The registry is
read as the leader reads it: a full read at the first step, then from the
view a watch keeps (reconciler.adapters.registry_etcd_view); each step says
how many of each. Three steps are timed:
  - first: lux campaigns, every node is new (every state written), plan published
  - steady: every node beat again since (every state changed, as it does between
    two steps of a live fleet), the plan is the same (not republished)
  - quiet: nothing changed since (the step a renewal makes)
and their parts: read (the whole registry, once per step: the lifecycle and
the snapshot share it), lifecycle write (the fenced chunks: only the states
whose lifecycle moved), schedule, publish, and the rest (observe, the
snapshot, signing, renewal). After each step the loop's `settle` (the cyclic
garbage collection the step holds off; `run` does it while it waits) is timed
on its own line: it is not part of the step.
Also the largest transaction's operation count and the largest request's bytes
etcd received during the step, and the plan's JSON size. Ratios are against the
first size in the same run. Nothing is asserted: the goals are printed beside,
each with PASS or MISS, and the load average of this shared machine with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.adapters.desired_memo import DesiredMemo  # noqa: E402
from reconciler.adapters.registry_etcd import EtcdRegistry  # noqa: E402
from reconciler.core.desired.model import FlapSettings, TimingSettings  # noqa: E402
from reconciler.core.scheduling.placement import schedule  # noqa: E402
from reconciler.engine.leader import LeaderLoop  # noqa: E402
from tests.support.harness.etcd import etcd_cluster  # noqa: E402
from tests.support.harness.etcd_requests import recording_requests  # noqa: E402
from tests.support.plan_keys import signed_example_fleet  # noqa: E402
from tests.support.registry_store import EXAMPLE_HOSTS, scale_fleet_records  # noqa: E402

# Issue 34: the first step within 1 s, a steady step at 10,000 declared nodes in 0.1 s.
GOAL_STEP_S = {"first": 1.0, "steady": 0.1, "quiet": 0.1}
GOAL_GROWTH = 12.0
STEPS = ("first", "steady", "quiet")
GOAL_TXN_OPS = 128
GOAL_REQUEST_BYTES = 1536 * 1024
PARTS = ("read", "lifecycle write", "schedule", "publish", "rest")


class Timed:
    """Wall time spent in the wrapped callables, by part."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - t
                self.calls[part] += 1

        return timed

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def declare(desired: Path, names: list[str]) -> None:
    """A host file for each of `names` in desired/hosts (the others' hosts, as
    scale_fleet_records beats them: small x86 ffmpeg nodes, limit 2)."""
    hosts = desired / "hosts"
    shutil.rmtree(hosts, ignore_errors=True)
    hosts.mkdir()
    for n, name in enumerate(names):
        (hosts / f"{name}.toml").write_text(
            f'[host]\nname = "{name}"\nroles = ["compute"]\naddress = "100.{64 + n // 62500}.{n // 250 % 250}.{n % 250 + 1}"\n\n'
            "[limits]\nmax_concurrent_tasks = 2\n"
        )


def run(size: int, desired: Path, signer) -> dict:
    names = [f"scale-{i:05d}" for i in range(size - len(EXAMPLE_HOSTS))]
    declare(desired, names)
    records = scale_fleet_records(names)
    result: dict = {"size": size}
    memo = DesiredMemo(desired)
    t = time.perf_counter()
    memo()
    result["load_s"] = time.perf_counter() - t
    with etcd_cluster(members=1) as cluster, recording_requests() as seen:
        registry = EtcdRegistry(
            cluster.endpoints,
            prefix=f"/bench{uuid.uuid4().hex[:8]}",
            timing=TimingSettings(),
            flap=FlapSettings(),
            clock=SystemClock(),
            op_timeout_s=30,
        )
        timed = Timed()
        registry._read = timed.wrap("read", registry._read)  # type: ignore[method-assign]
        registry._store_lifecycle = timed.wrap("lifecycle write", registry._store_lifecycle)  # type: ignore[method-assign]
        registry.publish_plan = timed.wrap("publish", registry.publish_plan)  # type: ignore[method-assign]
        loop = LeaderLoop(
            registry=registry,
            host="lux",
            load_desired=memo,
            schedule=timed.wrap("schedule", schedule),
            lease_ttl_s=120,
            log=lambda line: None,
            signer=signer,
        )
        try:
            beat = lambda: list(pool.map(lambda r: registry.heartbeat(r, ttl_s=600), records))  # noqa: E731
            with ThreadPoolExecutor(16) as pool:
                t = time.perf_counter()
                beat()
                result["beats_s"] = time.perf_counter() - t
                for name in STEPS:
                    if name == "steady":
                        beat()
                    timed.reset()
                    seen.reset()
                    full, view = registry.full_reads, registry.view_reads
                    t = time.perf_counter()
                    loop.step()
                    total = time.perf_counter() - t
                    assert loop.leadership is not None, "lux did not lead"
                    t = time.perf_counter()
                    loop.settle()
                    settle = time.perf_counter() - t
                    parts = {p: timed.spent.get(p, 0.0) for p in PARTS[:-1]}
                    parts["rest"] = total - sum(parts.values())
                    result[name] = {
                        "step": total,
                        "settle": settle,
                        "load": os.getloadavg()[0],
                        "parts": parts,
                        "reads": timed.calls.get("read", 0),
                        "full": registry.full_reads - full,
                        "view": registry.view_reads - view,
                        "txns": seen.transactions,
                        "requests": seen.count,
                        "txn_ops": seen.largest_txn_ops,
                        "request_bytes": seen.largest_request_bytes,
                        "request_kind": seen.largest_request,
                    }
            plan = registry.newest_plan()
            assert plan is not None
            result["plan_bytes"] = len(plan.model_dump_json().encode())
            result["ignored"] = len(plan.ignored_nodes)
        finally:
            if loop.leadership is not None:
                registry.resign(loop.leadership)
            registry.close()
    return result


def s(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        fleet = signed_example_fleet(Path(d))
        results = [run(size, fleet.desired, fleet.signer("lux")) for size in args.sizes]
    base = results[0]
    print("leader step on etcd 1 member, loopback, default limits (128 ops/txn, 1.5 MiB/request)")
    for r in results:
        print(
            f"\n{r['size']} nodes, all declared  (desired load {r['load_s']:.1f} s, once; heartbeats of all: {r['beats_s']:.1f} s; "
            f"plan JSON {r['plan_bytes'] / 1024:.1f} KiB, {r['ignored']} ignored nodes)"
        )
        for name in STEPS:
            x = r[name]
            ratio = f"  x{x['step'] / base[name]['step']:.1f} vs {base['size']}" if r is not base else ""
            print(f"  {name:6} step {s(x['step'])}{ratio}  (load average {x['load']:.1f} on {os.cpu_count()} cores)")
            for part in PARTS:
                extra = f" ({x['full']} full, {x['view']} from the view)" if part == "read" else ""
                print(f"           {part:16} {s(x['parts'][part])}{extra}")
            print(
                f"           {x['requests']} requests, {x['txns']} transactions; largest txn {x['txn_ops']} ops; "
                f"largest request {x['request_bytes'] / 1024:.1f} KiB ({x['request_kind']})"
            )
            print(f"           then, between steps: settle {s(x['settle'])}")
    print("\ngoals")
    last = results[-1]
    verdict = lambda ok: "PASS" if ok else "MISS"  # noqa: E731
    for name in STEPS:
        step = last[name]["step"]
        goal = GOAL_STEP_S[name]
        print(f"  {name:6} step at {last['size']} declared nodes: {step:.3f} s (goal <= {goal:g} s) {verdict(step <= goal)}")
        if last is not base:
            growth = step / base[name]["step"]
            print(f"  {name:6} growth {base['size']} -> {last['size']}: x{growth:.1f} (goal <= x{GOAL_GROWTH:g}) {verdict(growth <= GOAL_GROWTH)}")
    ops = max(r[n]["txn_ops"] for r in results for n in STEPS)
    size = max(r[n]["request_bytes"] for r in results for n in STEPS)
    print(f"  largest txn: {ops} ops (goal <= {GOAL_TXN_OPS}) {verdict(ops <= GOAL_TXN_OPS)}")
    print(f"  largest request: {size / 1024:.1f} KiB (goal <= {GOAL_REQUEST_BYTES // 1024} KiB) {verdict(size <= GOAL_REQUEST_BYTES)}")


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
