"""The naive reference placer: every decision scans every node.

This is the seed's pseudo-code (`select_worker`: query the registry for the
candidates at or above min_tier, score them, pick one; `_fallback`: one tier
lower, query again) written as plainly as possible, with the same rules as
`reconciler.core.scheduling.placement.Placer`. It is not part of the product: the benchmark
times it against the indexed placer, and the property tests check that both
make the same decision every time.
"""

from __future__ import annotations

from datetime import datetime
from fractions import Fraction

from reconciler.core.timestamps import utc

TIERS = (
    "gpu_cuda",
    "gpu_vaapi",
    "gpu_apu",
    "cpu_ffmpeg",
    "batch",
    "ethernet",
    "framebuffer",
    "wasm",
    "dsp",
    "esp32",
    "relay",
)  # best first
COSTS = ("free", "owned", "paid")  # cheapest first


class ScanningPlacer:
    def __init__(self, nodes, now: datetime, strategy: str = "highest_tier") -> None:
        self.now = utc(now)
        self.strategy = strategy
        self.nodes = []
        seen = set()
        for node in nodes:
            if node.node_id not in seen:
                seen.add(node.node_id)
                self.nodes.append(node)
        self.load = {n.node_id: n.in_flight for n in self.nodes}

    def _eligible(self, node, request) -> bool:
        if node.status != "active" or node.drained:
            return False
        if node.held_off_until is not None and utc(node.held_off_until) > self.now:
            return False
        if self.load[node.node_id] >= node.max_concurrent_tasks:
            return False
        if request.arch and node.arch not in request.arch:
            return False
        return all(node.labels.get(k) == v for k, v in request.labels)

    def place(self, request, avoid=(), exclude=()):
        """(node id, tier, fallback) or None when the request is deferred.

        Tier first: the satisfying tiers as one group (strategy order, then
        the cheaper cost class), then each fallback tier. Cost first
        (`request.cost_first`): one group per cost class, cheapest first,
        each over every tier down to the floor (satisfying ones in strategy
        order, then the fallback ones)."""
        top = TIERS.index(request.min_tier)
        bottom = TIERS.index(request.floor)
        exclude = set(exclude)
        avoid = set(avoid) | exclude

        def tier_key(node):
            rank = TIERS.index(node.tier)
            if rank > top:  # a fallback tier: after every satisfying one, best first
                return (1, rank)
            return (0, rank if self.strategy == "highest_tier" else -rank)

        def load(node):
            return Fraction(self.load[node.node_id], node.max_concurrent_tasks)

        if getattr(request, "cost_first", False):
            steps = [(set(TIERS[: bottom + 1]), cost) for cost in COSTS]

            def preference(node):
                return (tier_key(node), load(node), node.node_id)
        else:
            steps = [(set(TIERS[: top + 1]), None)] + [({t}, None) for t in TIERS[top + 1 : bottom + 1]]

            def preference(node):
                return (tier_key(node), COSTS.index(getattr(node, "cost", "owned")), load(node), node.node_id)

        for tiers, cost in steps:
            for avoiding in [avoid, exclude] if avoid != exclude else [avoid]:
                candidates = [
                    n
                    for n in self.nodes
                    if n.tier in tiers
                    and (cost is None or getattr(n, "cost", "owned") == cost)
                    and n.node_id not in avoiding
                    and self._eligible(n, request)
                ]
                if candidates:
                    best = min(candidates, key=preference)
                    self.load[best.node_id] += 1
                    return (best.node_id, best.tier, TIERS.index(best.tier) > top)
        return None


NAMES_PER_REASON = 4


def node_problem(node, request, load: int, now: datetime, exclude=()) -> str:
    """Why this node, of a tier in range, cannot take the request right now."""
    if node.node_id in exclude:
        return "runs a replica already"
    if node.status != "active":
        return node.status
    if node.drained:
        return "drained"
    if node.held_off_until is not None and utc(node.held_off_until) > now:
        return f"held off until {utc(node.held_off_until).strftime('%Y-%m-%dT%H:%M:%SZ')}"
    if request.arch and node.arch not in request.arch:
        return f"arch {node.arch or 'unknown'} not in [{', '.join(sorted(request.arch))}]"
    missing = [f"{k}={v}" for k, v in request.labels if node.labels.get(k) != v]
    if missing:
        return f"lacks label {', '.join(missing)}"
    return f"full {load}/{node.max_concurrent_tasks}"


def explain_deferral(request, nodes, load_of, now: datetime, exclude=()) -> tuple[str, bool]:
    """A deferral's (reason, inadmissible) by a scan of every node at every
    deferral: what the placer's `deferral_scan` + `explain_scanned` must say."""
    bottom = TIERS.index(request.floor)
    in_range = set(TIERS[: bottom + 1])
    tried = TIERS[0] if bottom == 0 else f"{TIERS[0]}..{request.floor}"
    constraint = ""
    if request.arch:
        constraint += f" arch [{', '.join(sorted(request.arch))}]"
    if request.labels:
        constraint += " labels {" + ", ".join(f"{k}={v}" for k, v in request.labels) + "}"
    if not [n for n in nodes if n.tier in in_range and request.matches(n)]:
        present = sorted({n.tier for n in nodes}, key=TIERS.index)
        what = f"tier {request.floor} or better" + (f" with{constraint}" if constraint else "")
        reason = (
            f"inadmissible: no node in the fleet has {what} (min_tier {request.min_tier}, floor {request.floor}); "
            f"tiers present: {', '.join(present) or 'none'}"
        )
        return reason, True
    by_tier: dict = {}
    for node in sorted(nodes, key=lambda n: n.node_id):
        if node.tier in in_range:
            problem = node_problem(node, request, load_of(node.node_id), now, exclude)
            by_tier.setdefault(node.tier, {}).setdefault(problem, []).append(node.node_id)
    parts, empty = [], []
    for tier in TIERS[: bottom + 1]:
        problems = by_tier.get(tier)
        if not problems:
            empty.append(tier)
            continue
        described = []
        for problem, names in problems.items():
            if len(names) <= NAMES_PER_REASON:
                described += [f"{name} {problem}" for name in names]
            else:
                described.append(f"{len(names)} nodes {problem.split(' ')[0]}")
        parts.append(f"{tier}: {', '.join(described)}")
    if empty:
        parts.append(f"no node at {', '.join(empty)}")
    reason = (
        f"no eligible node from {tried} (min_tier {request.min_tier}, floor {request.floor}{';' + constraint if constraint else ''}): "
        + "; ".join(parts)
    )
    return reason, False
