"""Placement cost per decision: the indexed scheduler against a scan of every node.

Run: PYTHONPATH=. .venv/bin/python bench/scheduler [--repeats N]

For 100, 1,000 and 10,000 nodes it builds one synthetic fleet in a realistic
steady state (all tiers, both architectures, a zone label, 5 % of nodes
offline, 2 % drained; each node 1-8 slots, already running 0 to limit-1
tasks), and one stream of requests (four shapes: gpu_apu..relay,
cpu_ffmpeg..relay, CUDA-only, x86 gpu_vaapi..cpu_ffmpeg in one zone).

One measured round is one scheduling pass from a fresh snapshot: the index is
built from the fleet (its time is inside the figure) and size/2 requests are
placed, so nodes fill up during the round as they do in a pass (a shape whose
nodes are full is deferred, as the scheduler would), and every round starts
from the same snapshot again. Per sample, rounds are repeated until it holds
at least --decisions decisions; the cost per decision is the best sample of
--repeats, for both placers, interleaved across sizes so a burst of load on
a shared machine favours no size and no side:
  - reconciler.core.scheduling.placement.Placer (per-tier heaps keyed by utilization, node id)
  - bench/scheduler/reference.py (the seed's pseudo-code: scan every node),
    on the first decisions of each round only (its cost is linear in the
    nodes; --naive-budget node visits per sample)
Both must make the same decisions (checked, deferrals included).

Prints the cost per decision of each, the speed-up, and the growth of the
indexed cost between sizes against the log N ratio it must stay within,
with PASS or MISS.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reference import ScanningPlacer  # noqa: E402

from reconciler.core.desired.model import TIER_ORDER  # noqa: E402
from reconciler.core.live.models import SnapshotNode  # noqa: E402
from reconciler.core.scheduling.placement import Choice, Placer, Request  # noqa: E402

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SIZES = (100, 1_000, 10_000)
SHAPES = (
    Request(min_tier="gpu_apu", floor="relay"),
    Request(min_tier="cpu_ffmpeg", floor="relay"),
    Request(min_tier="gpu_cuda", floor="gpu_cuda"),
    Request(min_tier="gpu_vaapi", floor="cpu_ffmpeg", arch=frozenset({"x86_64"}), labels=(("zone", "a"),)),
)
# Most machines of a fleet are modest; a few are GPU boxes.
TIER_WEIGHTS = (3, 4, 6, 30, 15, 8, 8, 10, 6, 5, 5)


def fleet(size: int, seed: int = 7) -> list[SnapshotNode]:
    rng = random.Random(seed)
    nodes = []
    for i in range(size):
        roll = rng.random()
        limit = rng.randint(1, 8)
        nodes.append(
            SnapshotNode(
                node_id=f"node-{i:05d}",
                tier=rng.choices(TIER_ORDER, weights=TIER_WEIGHTS)[0],
                status="offline" if roll < 0.05 else "active",
                drained=0.05 <= roll < 0.07,
                in_flight=rng.randrange(0, limit),
                max_concurrent_tasks=limit,
                arch=rng.choice(("x86_64", "aarch64")),
                labels={"zone": rng.choice("abcd")},
            )
        )
    return nodes


def fresh_round(nodes, requests):
    """One pass from a fresh snapshot: build the index, place `requests`."""
    placer = Placer(nodes, NOW)
    placer.prepare(SHAPES)
    return [placer.place(r) for r in requests]


def naive_round(nodes, requests):
    placer = ScanningPlacer(nodes, NOW)
    return [placer.place(r) for r in requests]


def timed_sample(round_fn, nodes, requests, rounds: int):
    """Seconds for `rounds` rounds, and the decisions of the last."""
    start = time.perf_counter()
    for _ in range(rounds):
        decisions = round_fn(nodes, requests)
    return time.perf_counter() - start, decisions


def as_tuple(decision):
    return (decision.node, decision.tier, decision.fallback) if isinstance(decision, Choice) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=20_000, help="decisions per measured sample of the indexed placer")
    parser.add_argument("--repeats", type=int, default=5, help="samples per size and placer (the best is kept)")
    parser.add_argument("--naive-budget", type=int, default=2_000_000, help="node visits allowed to the naive scan per sample")
    args = parser.parse_args()

    fleets = {size: fleet(size) for size in SIZES}
    rng = random.Random(11)
    # A pass places half a replica per node: the fleet gets busier, not full.
    rounds_of = {size: [rng.choice(SHAPES) for _ in range(size // 2)] for size in SIZES}
    per_sample = {size: max(1, math.ceil(args.decisions / len(rounds_of[size]))) for size in SIZES}
    naive_count = {size: max(20, min(len(rounds_of[size]), args.naive_budget // size)) for size in SIZES}
    naive_rounds = {size: max(1, math.ceil(args.naive_budget / (size * naive_count[size]))) for size in SIZES}

    best_fast: dict[int, float] = {}
    best_naive: dict[int, float] = {}
    decisions_of: dict[int, list] = {}
    naive_of: dict[int, list] = {}
    for _ in range(args.repeats):
        for size in SIZES:
            requests = rounds_of[size]
            seconds, decisions_of[size] = timed_sample(fresh_round, fleets[size], requests, per_sample[size])
            best_fast[size] = min(best_fast.get(size, math.inf), seconds / (per_sample[size] * len(requests)))
            head = requests[: naive_count[size]]
            seconds, naive_of[size] = timed_sample(naive_round, fleets[size], head, naive_rounds[size])
            best_naive[size] = min(best_naive.get(size, math.inf), seconds / (naive_rounds[size] * len(head)))

    print(f"best of {args.repeats} samples per size and placer; index build inside the indexed figure; fresh snapshot per round")
    print(
        f"{'nodes':>7} {'per round':>10} {'placed':>7} {'deferred':>8} | {'indexed us/decision':>19} | {'naive us/decision':>17} {'(of)':>6} | {'speed-up':>8}"
    )
    for size in SIZES:
        decisions = decisions_of[size]
        if [as_tuple(d) for d in decisions[: naive_count[size]]] != naive_of[size]:
            print(f"MISMATCH at {size} nodes: the indexed placer and the scan disagree", file=sys.stderr)
            return 1
        placed = sum(isinstance(d, Choice) for d in decisions)
        print(
            f"{size:>7} {len(decisions):>10} {placed:>7} {len(decisions) - placed:>8} | {best_fast[size] * 1e6:>19.2f} | "
            f"{best_naive[size] * 1e6:>17.1f} {naive_count[size]:>6} | {best_naive[size] / best_fast[size]:>7.0f}x"
        )
    print("decisions identical between the indexed placer and the scan (deferrals included): yes")
    print("growth of the cost per decision between sizes (goal: indexed within the log N ratio):")
    verdicts = []
    for small, big in itertools.pairwise(SIZES):
        growth = best_fast[big] / best_fast[small]
        log_ratio = math.log(big) / math.log(small)
        verdict = "PASS" if growth <= log_ratio else "MISS"
        verdicts.append(verdict)
        print(
            f"  {big:>6} vs {small:>5} nodes: indexed x{growth:.2f} (goal <= x{log_ratio:.2f}) {verdict}; "
            f"naive x{best_naive[big] / best_naive[small]:.1f} (N ratio x{big / small:.0f})"
        )
    print(f"overall: {'PASS' if all(v == 'PASS' for v in verdicts) else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
