"""A host's read of a plan (`PlanReads.plan_read`) for fakes: the parts a
chooser names, cut and joined as the registry adapters do."""

from __future__ import annotations

from collections.abc import Callable, Collection

from reconciler.core.live.models import FleetPlan
from reconciler.core.live.plan_parts import PlanIndex, PlanRead, join_plan, plan_index, plan_parts

# The last plans cut, by identity (each kept, so its id is not reused):
# a fake reads the same large plan for several hosts.
_CUT: dict[int, tuple[FleetPlan, PlanIndex, dict[str, bytes]]] = {}


def _cut(plan: FleetPlan) -> tuple[PlanIndex, dict[str, bytes]]:
    kept = _CUT.get(id(plan))
    if kept is None or kept[0] is not plan:
        if len(_CUT) >= 8:
            _CUT.clear()
        parts = plan_parts(plan)
        kept = _CUT[id(plan)] = (plan, plan_index(plan, parts), parts)
    return kept[1], kept[2]


def read_of(plan: FleetPlan | None, choose: Callable[[PlanIndex], Collection[str]]) -> PlanRead | None:
    if plan is None:
        return None
    index, parts = _cut(plan)
    names = sorted(set(choose(index)))
    return PlanRead(index=index, plan=join_plan(index, parts, only=names), parts=tuple(names))
