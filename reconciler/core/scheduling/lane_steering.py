"""Steering phaze through its own lever: which compute lanes phaze may choose (pure).

phaze has no "enabled" flag for a backend and counts an agent available as
long as it was ever seen; it reads /etc/phaze/backends.toml at start only. The
fabric knows within seconds when a compute lane is dead: the lane view
(`lanes.lane_views`, from the leader's live snapshot) is offline because its
host is offline, dead or suspected, its agent unit failed, or no SAQ worker
beats on its queue. So the leader decides, at each step:

- a lane whose health differs from its steering (dead but in backends.toml,
  healthy but out of it) is watched from the step that first saw it;
- once that has lasted `steering_window_s`, the lane changes: a dead one is
  left out, a healthy one put back;
- changes are applied together, at most once per `restart_interval_s` (each
  change rewrites backends.toml, which restarts phaze's control units): a
  change due earlier waits, still watched;
- phaze refuses a backends.toml without backends, so the last lane in it is
  never left out;
- a lane whose queue the broker did not show (unreachable) is neither
  changed nor watched anew: nothing is known about its agent's worker.

The decision rides in the fleet plan (`FleetPlan.steering`), so a new leader
goes on from it; the control host renders backends.toml without the lanes
left out (`render.artifacts.phaze_backends`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from reconciler.core.live.models import LaneSteering, LaneView, LaneWatch, SteeredLane, SteeringChange
from reconciler.core.timestamps import utc

# Changes the plan remembers for the timeline.
RECENT_CHANGES = 10


def _watched(view: LaneView, dead: bool, previous: LaneWatch | None, now: datetime) -> LaneWatch:
    """The lane's watch: kept while its condition holds, else started now."""
    if previous is not None and previous.dead == dead:
        return previous
    return LaneWatch(id=view.id, dead=dead, since=now, reason=view.reason if dead else None)


def _lasted(since: datetime, now: datetime, seconds: int) -> bool:
    return (utc(now) - utc(since)).total_seconds() >= seconds


def decide_steering(previous: LaneSteering, views: Sequence[LaneView], now: datetime, *, window_s: int, interval_s: int) -> LaneSteering:
    """The steering after this step (module docstring). `views`: every
    declared lane's view; only compute lanes are steered."""
    declared = {v.id for v in views}
    out = {s.id: s for s in previous.out if s.id in declared}
    watch = {w.id: w for w in previous.watching}
    watching: list[LaneWatch] = []
    leave: list[tuple[LaneView, LaneWatch]] = []
    back: list[tuple[LaneView, LaneWatch]] = []
    for view in sorted(views, key=lambda v: v.id):
        if view.kind != "compute":
            continue
        if view.workers is None:
            if view.id in watch:
                watching.append(watch[view.id])
            continue
        dead = not view.available
        if dead == (view.id in out):
            continue
        w = _watched(view, dead, watch.get(view.id), now)
        watching.append(w)
        if _lasted(w.since, now, window_s):
            (leave if dead else back).append((view, w))
    if len(declared) - len(out) - len(leave) < 1:
        leave = []  # phaze refuses a backends.toml without backends
    may_change = previous.changed_at is None or _lasted(previous.changed_at, now, interval_s)
    if not (leave or back) or not may_change:
        return LaneSteering(out=list(out.values()), watching=watching, changed_at=previous.changed_at, recent=list(previous.recent))
    changes = []
    for view, w in leave:
        reason = f"dead since {utc(w.since).strftime('%H:%M:%S')}: {w.reason}"
        out[view.id] = SteeredLane(id=view.id, since=now, reason=w.reason or "dead")
        changes.append(SteeringChange(at=now, lane=view.id, out=True, reason=reason))
    for view, w in back:
        del out[view.id]
        changes.append(SteeringChange(at=now, lane=view.id, out=False, reason=f"healthy since {utc(w.since).strftime('%H:%M:%S')}"))
    changed = {c.lane for c in changes}
    return LaneSteering(
        out=sorted(out.values(), key=lambda s: s.id),
        watching=[w for w in watching if w.id not in changed],
        changed_at=now,
        recent=[*previous.recent, *changes][-RECENT_CHANGES:],
    )
