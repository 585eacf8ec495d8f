"""One word per concept (docs/architecture.md, "Words"): names retired for
saying two things, or little, stay retired in the code, the tests, the
benches, the scripts and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEARCHED = ("reconciler", "tests", "bench", "scripts", "docs", "README.md")

# retired name -> what says it now
RETIRED = {
    r"\bLaneQueue\w*": "LaneBroker (phaze's broker, as the fabric sees it)",
    r"\blane_queue(?!s|_name)\w*": "lane_broker (a lane's SAQ queue is its queue: lane_queue_name)",
    r"\bNodeFacts\b": "HostFacts (the probe's result)",
    r"\bplan_actions\b": "host_actions (a host's list of changes; 'plan' is the fleet plan)",
    r"\bPlanChoice\b": "PlanSource (a file, this host alone, or the registry)",
    r"\bBootstrapPlan\b": "BootstrapSteps",
    r"\bPassResult\b": "ApplyResult (the applier's) or PassReport (the pass's)",
    r"\bMemoHit\b": "PassReport(memoized=True)",
    r"\bConverged\b": "MemoSeed",
    r"\bPassWorld\b": "MemoReader",
    r"\b_Prepared\b": "_PreparedPass",
    r"\bOffer\b": "PlanOffer",
    r"\bregistry_reach\b": "registry_settings",
    r"\bfleet\.backends\b": "fleet.lanes (the TOML key stays [[backends]], as phaze names it)",
    r"\breconciler\.cli\.wiring\b": "reconciler.wiring",
    r"\bplan_source\.(?:node_record|measure|lead_once|admit|read_fleet_view|FleetView|PassPlan)\b": "engine.heartbeat, leader_step, plan_fence, fleet_view",
}


def _files() -> list[Path]:
    found: list[Path] = []
    for name in SEARCHED:
        path = REPO / name
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += [
                p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".j2", ".toml", ".sh", "") and "__pycache__" not in p.parts
            ]
    return [p for p in found if p != Path(__file__).resolve() and not p.is_symlink()]


@pytest.mark.parametrize("pattern", sorted(RETIRED))
def test_a_retired_name_does_not_come_back(pattern: str) -> None:
    regex = re.compile(pattern)
    hits = []
    for path in _files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(REPO)}:{n}" for n, line in enumerate(text.splitlines(), 1) if regex.search(line)]
    assert not hits, f"{pattern} is retired: say {RETIRED[pattern]} ({', '.join(hits[:10])})"
