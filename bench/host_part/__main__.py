"""What a host's pass and watcher cost with a plan of 20,000 placements, against the example's 5 (issue 34).

Run: .venv/bin/python bench/host_part [--repeats N] [--host NAME] [--placements N]

Backends: a sqlite file (tmpfs /tmp) and one etcd member on loopback (started
here and stopped by PID at the end). For each, the signed example fleet
(throwaway plan keys, [registry] pointing at the backend) with lux leading
(a term of an hour), and two plans, both signed by lux, each on a store of
its own (a sqlite file, an etcd prefix), timed in turn:

  example   the example's 5 placements (tests/golden/fleet-plan.json)
  big       the same 5, and --placements more on 5,000 other nodes

so --host's part (x86-spill: flac-fft) is the same in both: what differs is
only what the rest of the fleet runs. Then, for each plan:

  pass      a full `fabric reconcile --no-activate` of --host, a process as
            the timer starts it, the pass memo dropped before each (so it
            heartbeats, reads the plan, fences, renders and compares), with
            a replayed probe; wall and CPU time (user + system) per pass
  watcher   the watcher's work for one new plan (engine.watch.Watcher.step
            with the registry reporting a new plan version: it reads
            fabric.toml and its host file, then the index, and follows this
            host's parts' digests in it), in this process over the real
            adapter; wall and CPU time per step

and prints the medians of both, their ratio big / example, against the goal
of issue 34: within 1.3x. On a busy machine the CPU figures are the steady
ones (the wall times wait for a core).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reconciler.adapters.clock import SystemClock  # noqa: E402
from reconciler.core.desired.load import load_desired  # noqa: E402
from reconciler.core.desired.model import FleetConfig  # noqa: E402
from reconciler.core.live.models import FleetPlan, Placement  # noqa: E402
from reconciler.core.live.plan_parts import PlanIndex, PlanRead, plan_index  # noqa: E402
from reconciler.core.live.records import Leadership  # noqa: E402
from reconciler.core.live.signing import canonical_plan, with_signature  # noqa: E402
from reconciler.core.live.watching import PLAN, EntryVersion, WatchTimings  # noqa: E402
from reconciler.engine.desired_load import load_for_part, load_own  # noqa: E402
from reconciler.engine.watch import Watcher  # noqa: E402
from reconciler.ports import Registry  # noqa: E402
from tests.support.harness.etcd import etcd_cluster  # noqa: E402
from tests.support.registry_store import Store  # noqa: E402

FABRIC = [sys.executable, "-m", "reconciler"]
GOLDEN_PLAN = ROOT / "tests" / "golden" / "fleet-plan.json"
CAPTURE = ROOT / "tests" / "golden" / "probe" / "x86_64"
GOAL = 1.3
# As bench/reconcile_noop: children compile to bytecode once, into a cache outside the tree.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def example_plan() -> FleetPlan:
    return FleetPlan.model_validate_json(GOLDEN_PLAN.read_bytes())


def big_plan(placements: int) -> FleetPlan:
    plan = example_plan()
    others = [Placement(service="flac-fft", replica=10 + i, node=f"node-{i % 5000:05d}", tier="cpu_ffmpeg") for i in range(placements)]
    return plan.model_copy(update={"placements": [*plan.placements, *others]})


def publish(store: Store, fleet: FleetConfig, registry: Registry, leadership: Leadership, plan: FleetPlan) -> FleetPlan:
    """As lux's leader step publishes: numbered, for this fleet and prefix, signed."""
    assert store.signed is not None
    key = store.signed.keys["lux"]
    update = {"epoch": registry.epoch() + 1, "leader": "lux", "term": leadership.term, "fleet": fleet.fleet.name, "prefix": fleet.registry.prefix}
    numbered = plan.model_copy(update=update)
    return registry.publish_plan(leadership, with_signature(numbered, key.id, key.private.sign(canonical_plan(numbered))))


def full_pass(argv: list[str], root: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one full pass, a child process (its CPU from wait4:
    user and system, steadier than wall time on a busy machine)."""
    (root / "var/lib/fabric/pass-memo.json").unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - full_pass.cpu_before  # type: ignore[attr-defined]
    full_pass.cpu_before += cpu  # type: ignore[attr-defined]
    if proc.returncode != 0 or "running static" in out:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{out}\n{err}")
    return wall, cpu


full_pass.cpu_before = 0.0  # type: ignore[attr-defined]


class NewPlanEachStep:
    """The watcher's registry: the real adapter's plan reads; watch_host
    reports a new plan version at every call (the plan itself unchanged, so
    each step does the whole work of a new plan and starts no pass)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.n = 0

    def watch_host(self, host: str, timeout_s: float) -> list[EntryVersion]:
        self.n += 1
        return [EntryVersion(PLAN, "", f"v{self.n}")]

    def newest_plan(self) -> FleetPlan | None:
        return self.registry.newest_plan()

    def plan_read(self, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
        return self.registry.plan_read(choose)

    def plan_glance(self, host: str) -> tuple[int, dict[str, str]] | None:
        return self.registry.plan_glance(host)


class NoPass:
    def pass_running(self) -> bool:
        return False

    def start_pass(self) -> None:
        raise SystemExit("the watcher started a pass for a plan that left its part as it was")


def watcher(registry: Registry, desired: Path, host: str) -> Watcher:
    return Watcher(
        NewPlanEachStep(registry),  # type: ignore[arg-type]
        NoPass(),
        SystemClock(),
        host,
        lambda plan: load_for_part(desired, host, plan),
        own_desired=lambda: load_own(desired, host),
        timings=WatchTimings(),
        log=lambda line: None,
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def verdict(ratio: float) -> str:
    return "PASS" if ratio <= GOAL else "MISS"


class Case:
    """One plan on a store of its own: the signed example fleet pointing at
    it, lux leading, the plan published, --host's root with generation 1."""

    def __init__(self, store: Store, tmp: Path, name: str, plan: FleetPlan, host: str) -> None:
        self.name = name
        self.desired = store.desired_dir(tmp / name)
        self.registry = store.open()
        self.leadership = self.registry.campaign("lux", 3600)
        assert self.leadership is not None
        stored = publish(store, load_desired(self.desired).fleet, self.registry, self.leadership, plan)
        index = plan_index(stored)
        self.size = f"{len(stored.placements)} placements, {len(index.parts)} parts, index {len(index.model_dump_json())} bytes"
        self.root = tmp / f"root-{name}"
        self.argv = [
            *FABRIC,
            "reconcile",
            "--desired",
            str(self.desired),
            "--host",
            host,
            "--root",
            str(self.root),
            "--no-activate",
            "--replay",
            str(CAPTURE),
        ]
        full_pass(self.argv, self.root)  # generation 1
        self.watcher = watcher(self.registry, self.desired, host)
        self.watcher.step()  # the baseline
        self.passes: list[tuple[float, float]] = []
        self.steps: list[tuple[float, float]] = []

    def close(self) -> None:
        self.registry.resign(self.leadership)
        self.registry.close()


def bench(backend: str, stores: dict[str, Store], tmp: Path, args: argparse.Namespace) -> None:
    plans = {"example": example_plan(), "big": big_plan(args.placements)}
    cases = [Case(stores[name], tmp, name, plan, args.host) for name, plan in plans.items()]
    try:
        # Interleaved, so a busy moment of the machine falls on both plans.
        for _ in range(args.repeats):
            for case in cases:
                case.passes.append(full_pass(case.argv, case.root))
                for _ in range(10):
                    wall, cpu = time.perf_counter(), time.process_time()
                    case.watcher.step()
                    case.steps.append((time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        for case in cases:
            case.close()
    print(f"{backend}: host {args.host}, {args.repeats} full passes and {args.repeats * 10} watcher steps per plan")
    for case in cases:
        watch_wall = statistics.median(w for w, _ in case.steps)
        watch_cpu = statistics.median(c for _, c in case.steps)
        print(f"  {case.name:<8} ({case.size})")
        pass_wall = statistics.median(w for w, _ in case.passes)
        pass_cpu = statistics.median(c for _, c in case.passes)
        print(f"           pass {ms(pass_wall)} wall, {ms(pass_cpu)} CPU   watcher per new plan {ms(watch_wall)} wall, {ms(watch_cpu)} CPU")
    small, big = cases
    ratios = {
        "pass (wall)": statistics.median(w for w, _ in big.passes) / statistics.median(w for w, _ in small.passes),
        "pass (CPU)": statistics.median(c for _, c in big.passes) / statistics.median(c for _, c in small.passes),
        "watcher (wall)": statistics.median(w for w, _ in big.steps) / statistics.median(w for w, _ in small.steps),
        "watcher (CPU)": statistics.median(c for _, c in big.steps) / statistics.median(c for _, c in small.steps),
    }
    for what, ratio in ratios.items():
        print(f"  {what:<15} {args.placements} placements / the example's 5: {ratio:5.2f}x (goal <= {GOAL:.2f}x)  {verdict(ratio)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host", default="x86-spill", help="a host that neither leads nor serves the edge")
    parser.add_argument("--placements", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp:
        CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        subprocess.run([sys.executable, "-c", "import reconciler.cli.reconcile"], env=CHILD_ENV, check=True)
        files = {name: str(Path(tmp) / f"registry-{name}.sqlite") for name in ("example", "big")}
        bench("sqlite", {name: Store("sqlite", {"backend": "sqlite", "path": f}, f) for name, f in files.items()}, Path(tmp) / "sqlite", args)
        with etcd_cluster(members=1) as cluster:
            stores = {
                name: Store("etcd", {"backend": "etcd", "endpoints": cluster.endpoints, "prefix": f"/b{uuid.uuid4().hex[:8]}"}, None)
                for name in ("example", "big")
            }
            bench("etcd", stores, Path(tmp) / "etcd", args)


if __name__ == "__main__":
    main()
