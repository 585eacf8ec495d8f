"""Fleet-plan fencing on the host side (pure): apply a plan only if it is not older than the newest applied.

A deposed leader may still publish for a moment, or a lagging registry member
may still serve an old plan. Each host remembers the newest epoch it applied
and refuses anything older, so a stale plan can never undo its successor's.
The host-side record is the epoch kept in each generation's manifest
(`reconciler.engine.apply`, generations/<n>/manifest.json): it is written in the same
atomic step as the generation, so a crash cannot separate the two.

The fence also decides who may have made a plan. The epoch alone proves
nothing: a registry client chooses the epoch and the `leader` field it writes.
So, for the registry's plans, the leader must be a declared candidate and,
when fabric.toml lists plan keys, the plan must carry a valid signature by a
key listed for that candidate (`reconciler.core.live.signing.verify_plan`);
both are checked before the epoch, so a forged plan is refused whatever
epoch it claims, and it never becomes the epoch this host has applied.

This is the one fence: the pass (`reconciler.engine.plan_fence.admit`)
calls it exactly once, whatever the plan came from (the registry, a
--plan-file, or --no-registry's plan of this host alone)::

    verdict = accept_plan(current_manifest.epoch, plan,
                          leader_candidates=desired.fleet.fleet.leader_candidates,  # registry plans only
                          plan_keys=desired.fleet.plan_keys or None)                # registry plans only
    if not verdict.accepted:
        ...                             # keep the current generation (fail static)
    else:
        ... render and apply; the new manifest records plan.epoch ...
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.signing import verify_plan


@dataclass(frozen=True)
class PlanVerdict:
    accepted: bool
    reason: str
    # Refused because it cannot be from the leader it names (not merely stale).
    untrusted: bool = False

    def __bool__(self) -> bool:
        return self.accepted


def authorship_problem(
    plan: FleetPlan,
    *,
    leader_candidates: Collection[str] | None = None,
    plan_keys: Sequence[PlanKey] | None = None,
) -> str | None:
    """Why `plan` cannot be from the leader it names, or None: the leader is
    not a candidate, or (with `plan_keys`) the signature is missing, by a key
    not listed for that leader, or does not match. `fabric status` asks the
    same of the newest plan, so it never shows a forged one as the fleet's."""
    if leader_candidates is not None and plan.leader not in leader_candidates:
        return f"plan epoch {plan.epoch} is from {plan.leader!r}, not a leader candidate ({', '.join(sorted(leader_candidates))})"
    if plan_keys:
        forged = verify_plan(plan, plan_keys)
        if forged is not None:
            return f"refused: {forged}"
    return None


def accept_plan(
    last_applied_epoch: int | None,
    plan: FleetPlan | None,
    *,
    leader_candidates: Collection[str] | None = None,
    plan_keys: Sequence[PlanKey] | None = None,
    stale_cause: str = "stale leader or lagging registry",
) -> PlanVerdict:
    """Whether this host may apply `plan`, with the reason either way.

    The same epoch is accepted again (a pass that re-applies the plan it
    already runs is a no-op, and a crash between apply and recording the epoch
    must be able to converge). With `leader_candidates`, a plan signed by a
    host that is not a declared candidate is refused: a registry writer cannot
    make itself leader. With `plan_keys` (fabric.toml lists some), a plan
    that is unsigned, signed by a key not listed for the leader it names, or
    whose signature does not match its content is refused, before the epoch
    is even looked at.
    `stale_cause` says why an older plan reaches a host from where this one
    came from.
    """
    if plan is None:
        return PlanVerdict(False, "no plan published yet")
    forged = authorship_problem(plan, leader_candidates=leader_candidates, plan_keys=plan_keys)
    if forged is not None:
        return PlanVerdict(False, forged, untrusted=True)
    if last_applied_epoch is not None and plan.epoch < last_applied_epoch:
        return PlanVerdict(False, f"plan epoch {plan.epoch} is older than the newest applied ({last_applied_epoch}): {stale_cause}")
    if last_applied_epoch is not None and plan.epoch == last_applied_epoch:
        return PlanVerdict(True, f"plan epoch {plan.epoch} is the one applied")
    return PlanVerdict(True, f"plan epoch {plan.epoch} is newer than {last_applied_epoch if last_applied_epoch is not None else 'none applied'}")
