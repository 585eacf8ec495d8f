"""Whether `fabric pull` fetches the desired state before a pass (pure).

With a git [source], fabric-reconcile.service's ExecStartPre `fabric pull`
fetches the remote before each pass: the timer's passes are how a push
reaches the host. A pass fabric-watch starts reacts to the registry (a new
plan, a drain request, a node state) and should act within a second; a fetch
first (ssh to the remote and back, and up to its timeout while the remote is
unreachable) would spend that second for nothing that changed. So the
watcher records its ask (`reconciler.core.live.watching.PASS_ASKED`) just
before it starts the pass, and the pull of an asked pass skips the fetch
while the last fetch it tried (`FETCHED`, reachable or not) is recent: the
pass renders from the checkout the host has. The timer's pass and an
operator's `systemctl start` leave no ask and fetch as before. Each pass
restarts the timer's interval (OnUnitActiveSec), so passes the watcher
starts often enough would keep the timer from firing: past
`FETCH_EVERY_INTERVALS` intervals an asked pass fetches too.
"""

from __future__ import annotations

from dataclasses import dataclass

# The last fetch `fabric pull` tried, in the state directory (a
# `reconciler.core.live.watching.moment_record`), written after each try,
# whether the remote answered or not.
FETCHED = "desired-fetched.json"

# How stale, in timer intervals, the last fetch may be before even an asked
# pass fetches first (the most a push waits while the watcher keeps starting
# passes).
FETCH_EVERY_INTERVALS = 2


@dataclass(frozen=True)
class FetchChoice:
    fetch: bool
    reason: str


def fetch_choice(*, asked_at: float | None, fetched_at: float | None, now: float, interval_s: float) -> FetchChoice:
    """Fetch or not before this pass. `asked_at`: when fabric-watch asked for
    a pass (None: no ask); an ask older than one interval is left over from
    a start that did not run. `fetched_at`: the last fetch tried (None: none
    recorded). A moment in the future (the clock stepped back) counts as
    stale."""
    if asked_at is None:
        return FetchChoice(True, "no ask from fabric-watch")
    if not 0 <= now - asked_at <= interval_s:
        return FetchChoice(True, f"fabric-watch's ask is from {now - asked_at:.0f} s ago, not for this pass")
    if fetched_at is None:
        return FetchChoice(True, "no fetch tried yet")
    age = now - fetched_at
    if not 0 <= age < FETCH_EVERY_INTERVALS * interval_s:
        return FetchChoice(True, f"the last fetch was tried {age:.0f} s ago")
    return FetchChoice(
        False,
        f"fabric-watch asked for this pass (the registry changed, not git) and the last fetch was tried {age:.1f} s ago; "
        "the timer's next pass fetches",
    )
