"""Probe flap damping (pure): a device missed once does not demote a node at once.

A GPU can vanish from one probe for reasons that are not a lost GPU: nvidia-smi
times out while the card wakes up, vainfo races a driver reload, a render node
is recreated. Demoting the node on every such blip would evacuate its work and
bring it back 30 s later. So:

- A better or equal tier is taken at once (new capacity is absorbed at once).
- A lower tier is only taken once it has been observed on
  `DEMOTE_AFTER_PASSES` consecutive passes. Until then the node keeps its
  previous tier and the capabilities behind it (GPUs, hardware encoders,
  limitations, the tier and gpu labels); everything else (memory, storage,
  Tailscale, the missing reasons) is the fresh observation.

3 passes of 30 s is 90 s, the same span after which the health monitor calls a
node offline (3 missed beats): a device is judged lost on the same evidence as
a node. The reconcile pass can pass `fleet.timing.missed_beats` instead.

The history is a pydantic model so the reconcile pass can keep it as JSON.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from reconciler.core.desired.model import TIER_SCORE, HostFacts, Tier
from reconciler.core.probe.tiering import LABEL_PREFIX

DEMOTE_AFTER_PASSES = 3

# Labels that follow the damped capabilities rather than the fresh probe.
_CAPABILITY_LABELS = (f"{LABEL_PREFIX}tier", f"{LABEL_PREFIX}gpu")


class ProbeHistory(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # The facts last reported as effective (None before the first pass).
    effective: HostFacts | None = None
    # A lower tier seen on consecutive passes but not yet taken.
    lower_tier: Tier | None = None
    lower_passes: int = 0
    lower_since: datetime | None = None
    updated: datetime | None = None


def _keep_capabilities(kept: HostFacts, observed: HostFacts, note: str) -> HostFacts:
    labels = {k: v for k, v in observed.labels.items() if k not in _CAPABILITY_LABELS}
    labels.update({k: v for k, v in kept.labels.items() if k in _CAPABILITY_LABELS})
    return observed.model_copy(
        update={
            "tier": kept.tier,
            "hardware": observed.hardware.model_copy(update={"gpus": kept.hardware.gpus, "ffmpeg": kept.hardware.ffmpeg}),
            "labels": dict(sorted(labels.items())),
            "limitations": kept.limitations.model_copy(update={"notes": [*kept.limitations.notes, note]}),
        }
    )


def damp(history: ProbeHistory, observed: HostFacts, now: datetime, passes: int = DEMOTE_AFTER_PASSES) -> tuple[HostFacts, ProbeHistory]:
    """(effective facts for this pass, history to keep for the next)."""
    previous = history.effective
    if previous is None or TIER_SCORE[observed.tier] >= TIER_SCORE[previous.tier]:
        return observed, ProbeHistory(effective=observed, updated=now)

    seen = history.lower_passes + 1
    since = history.lower_since if history.lower_tier is not None and history.lower_since else now
    if seen >= max(1, passes):
        return observed, ProbeHistory(effective=observed, updated=now)

    note = f"damped: probe found {observed.tier} on {seen} of {passes} consecutive passes; keeping {previous.tier} until then"
    effective = _keep_capabilities(previous, observed, note)
    # The kept capabilities stay the reference, not the damped copy, so notes
    # do not pile up pass after pass.
    return effective, ProbeHistory(
        effective=previous,
        lower_tier=observed.tier,
        lower_passes=seen,
        lower_since=since,
        updated=now,
    )
