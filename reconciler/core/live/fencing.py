"""Fleet-plan fencing on the host side (pure): apply a plan only if it is the current term's and not older than the newest applied.

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

The term: a leader's term is a number the registry assigns (etcd: the
leader key's create revision; sqlite: a counter its campaign raises), never
one a writer picks, and the leader signs each plan together with its term,
the fleet's name and the registry prefix. With plan keys, a registry plan is
applied only when it names the fleet and prefix of this desired state, and
the candidate and term the registry's leader record holds now
(`RegistryTrust`): a listed candidate that does not lead cannot make a plan
hosts take, whatever epoch it writes, and a plan of a term that is not the
current one (a replay after a rollback, a new host reading an old plan) is
refused whatever its number.

The fence a host keeps is (term, step) (`AppliedFence`, from its manifest):
within one term the epoch may not go back; a newer term replaces an older one
whatever the epochs; an older term is refused. A fence set by a plan whose
key fabric.toml no longer lists (a retired key) is lifted.

This is the one fence: the pass (`reconciler.engine.plan_fence.admit`)
calls it exactly once, whatever the plan came from (the registry, a
--plan-file, or --no-registry's plan of this host alone)::

    verdict = accept_plan(AppliedFence(manifest.epoch, manifest.term, manifest.key_id), plan,
                          leader_candidates=desired.fleet.fleet.leader_candidates,  # registry plans only
                          plan_keys=desired.fleet.plan_keys or None,                # registry plans only
                          registry=RegistryTrust(fleet, prefix, leader, term))      # registry plans only
    if not verdict.accepted:
        ...                             # keep the current generation (fail static)
    else:
        ... render and apply; the new manifest records plan.epoch, term and key id ...
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from reconciler.core.desired.model import PlanKey
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.plan_parts import PlanRead, partial_problem
from reconciler.core.live.signing import verify_index, verify_plan


@dataclass(frozen=True)
class PlanVerdict:
    accepted: bool
    reason: str
    # Refused because it cannot be from the leader it names (not merely stale).
    untrusted: bool = False

    def __bool__(self) -> bool:
        return self.accepted


@dataclass(frozen=True)
class AppliedFence:
    """What this host applied last (its generation's manifest): the plan's
    epoch, its term (None: a generation from before terms) and the id of the
    key that signed it (None: unsigned)."""

    epoch: int | None
    term: int | None = None
    key_id: str | None = None


@dataclass(frozen=True)
class RegistryTrust:
    """What a registry plan must name: this fleet and registry prefix, and
    the registry's leader record now (`candidate` and the registry-assigned
    `term`; both None: the registry holds no leader record)."""

    fleet: str
    prefix: str
    candidate: str | None
    term: int | None


def authorship_problem(
    plan: FleetPlan,
    *,
    leader_candidates: Collection[str] | None = None,
    plan_keys: Sequence[PlanKey] | None = None,
    read: PlanRead | None = None,
    host: str | None = None,
) -> str | None:
    """Why `plan` cannot be from the leader it names, or None: the leader is
    not a candidate, or (with `plan_keys`) the signature is missing, by a key
    not listed for that leader, or does not match. `fabric status` asks the
    same of the newest plan, so it never shows a forged one as the fleet's.
    `read`: `plan` is a host's read of some parts (`plan_parts.PlanRead`):
    the signature is checked on its index, and `plan` must be that index's
    (`partial_problem`, with every part the index names for `host`)."""
    if read is not None and read.plan is not plan:
        raise ValueError("the read given is not the plan's")
    if leader_candidates is not None and plan.leader not in leader_candidates:
        return f"plan epoch {plan.epoch} is from {plan.leader!r}, not a leader candidate ({', '.join(sorted(leader_candidates))})"
    if read is not None:
        broken = partial_problem(plan, read.index, host)
        if broken is not None:
            return f"refused: {broken}"
    if plan_keys:
        forged = verify_plan(plan, plan_keys) if read is None else verify_index(read.index, plan_keys)
        if forged is not None:
            return f"refused: {forged}"
    return None


def term_problem(plan: FleetPlan, trust: RegistryTrust) -> tuple[str, bool] | None:
    """Why `plan` is not the plan of the registry's current leader and term
    in this fleet and registry, or None; with whether it is untrusted (made
    by someone who does not lead, or for another fleet or registry) rather
    than merely of a term that has passed."""
    if plan.fleet != trust.fleet:
        return f"refused: plan epoch {plan.epoch} is signed for fleet {plan.fleet!r}, not {trust.fleet!r}", True
    if plan.prefix != trust.prefix:
        return f"refused: plan epoch {plan.epoch} is signed for registry prefix {plan.prefix!r}, not {trust.prefix!r}", True
    if trust.candidate is None or trust.term is None:
        return f"plan epoch {plan.epoch} of term {plan.term}: the registry names no leader term now", False
    if plan.leader != trust.candidate:
        return (
            f"refused: plan epoch {plan.epoch} is signed by {plan.leader!r}, but the registry names {trust.candidate!r} "
            f"as leader (term {trust.term})",
            True,
        )
    if plan.term != trust.term:
        return f"plan epoch {plan.epoch} is of {plan.leader}'s term {plan.term}, not the registry's current term {trust.term}", False
    return None


def lifted(applied: AppliedFence | None, plan_keys: Sequence[PlanKey] | None) -> AppliedFence | None:
    """`applied`, or None when the key that set it is retired (fabric.toml
    lists plan keys and not that one): a retired key's fence is lifted."""
    if applied is None or applied.key_id is None or not plan_keys:
        return applied
    return applied if any(k.id == applied.key_id for k in plan_keys) else None


def _fence(applied: AppliedFence | None, plan: FleetPlan, stale_cause: str) -> PlanVerdict:
    """The (term, step) fence: a newer term replaces any step of an older one."""
    last = applied.epoch if applied is not None else None
    term = applied.term if applied is not None else None
    if term is not None and plan.term < term:
        return PlanVerdict(False, f"plan epoch {plan.epoch} is of term {plan.term}, older than the term applied ({term}): {stale_cause}")
    if term is not None and plan.term > term and last is not None and plan.epoch <= last:
        # Newer by (term, step), whatever the epochs: said as every newer plan is.
        return PlanVerdict(True, f"plan epoch {plan.epoch} is newer than {last} applied: its term {plan.term} replaces term {term}")
    if last is not None and plan.epoch < last:
        return PlanVerdict(False, f"plan epoch {plan.epoch} is older than the newest applied ({last}): {stale_cause}")
    if last is not None and plan.epoch == last:
        return PlanVerdict(True, f"plan epoch {plan.epoch} is the one applied")
    return PlanVerdict(True, f"plan epoch {plan.epoch} is newer than {last if last is not None else 'none applied'}")


def accept_plan(
    last_applied: int | AppliedFence | None,
    plan: FleetPlan | None,
    *,
    leader_candidates: Collection[str] | None = None,
    plan_keys: Sequence[PlanKey] | None = None,
    stale_cause: str = "stale leader or lagging registry",
    registry: RegistryTrust | None = None,
    read: PlanRead | None = None,
    host: str | None = None,
) -> PlanVerdict:
    """Whether this host may apply `plan`, with the reason either way.

    `last_applied`: the fence this host keeps (an `AppliedFence`, or a bare
    epoch). The same epoch is accepted again (a pass that re-applies the plan
    it already runs is a no-op, and a crash between apply and recording the
    epoch must be able to converge). With `leader_candidates`, a plan signed
    by a host that is not a declared candidate is refused: a registry writer
    cannot make itself leader. With `plan_keys` (fabric.toml lists some), a
    plan that is unsigned, signed by a key not listed for the leader it names,
    or whose signature does not match its content is refused; and with
    `registry` too, one that is not of this fleet and prefix, or not of the
    registry's current leader and term (`term_problem`), all before the
    (term, step) fence is even looked at.
    `stale_cause` says why an older plan reaches a host from where this one
    came from. `read` and `host`: `plan` is what `host` read of the newest
    plan (its index and only the parts it needs): `authorship_problem`.
    """
    if plan is None:
        return PlanVerdict(False, "no plan published yet")
    forged = authorship_problem(plan, leader_candidates=leader_candidates, plan_keys=plan_keys, read=read, host=host)
    if forged is not None:
        return PlanVerdict(False, forged, untrusted=True)
    if registry is not None and plan_keys:
        problem = term_problem(plan, registry)
        if problem is not None:
            return PlanVerdict(False, problem[0], untrusted=problem[1])
    applied = last_applied if isinstance(last_applied, AppliedFence) or last_applied is None else AppliedFence(last_applied)
    return _fence(lifted(applied, plan_keys), plan, stale_cause)
