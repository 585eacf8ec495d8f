"""What `fabric watch` reacts to, and when it starts a pass (pure).

The watcher (`reconciler.engine.watch`, fabric-watch.service) follows a few
registry entries through `Registry.watch_host` and starts
fabric-reconcile.service when one that concerns this host changed, so a new
plan is acted on within about a second instead of at the next timer tick. The
timer stays the backstop: anything the watcher misses (it was down, the
registry was unreachable, a change it does not follow) is seen by the next
timer pass anyway.

The entries followed (`EntryVersion`): this host's part of the newest plan
(`reconciler.core.render.plan_part`: the services placed here and, on the
edge, each routed service's nodes; the watcher reads the plan when the
registry's version of it changes and reports the part's digest as the plan's
version, so an epoch that moves work between two other hosts is no change
here), and this host's drain request and node state. A version is opaque: it
changes whenever the entry does ("" when the entry is absent). The first
version of an entry the watcher sees is the baseline, not a change: a
watcher that (re)starts does not start a pass for what the last pass may
already have applied. A backend reports every followed entry again after
(re)connecting, so a change made while it was away is still one change.

Starting (`decide`): a new part of the plan starts a pass at once: the plan
is what a pass renders, and the last thing a leader's step writes (after the
node states it changed). A drain request or node state alone waits
`window_s` for the plan the leader usually publishes in answer, so the two
start one pass; more changes within the window do not push its end back, and
a plan arriving in it starts the pass then. No pass is started while one
runs: systemd merges a StartUnit into the start job of a oneshot that is
already running (no second run is queued), and that pass may have read the
registry before the change; so the changes stay pending and the next pass
starts when it has finished (looked at every `running_poll_s`), unless that
pass took the plan (`taken`: it read the registry's epoch again after
activating and took a plan published meanwhile in another round; its record,
`PLAN_TAKEN`, names the epoch of the plan it rendered). The pass's
own lock (flock in the state directory) remains what guarantees one pass at
a time: the timer or an operator may start one at any moment.

An unreachable registry or systemd is retried after `retry_delay`, doubling
from `retry_min_s` up to `retry_max_s`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Entry = Literal["plan", "drain", "state"]

PLAN: Entry = "plan"
DRAIN: Entry = "drain"
STATE: Entry = "state"


@dataclass(frozen=True)
class EntryVersion:
    """One followed registry entry as the backend saw it."""

    entry: Entry
    # Whose drain request or node state; "" for the plan (the fleet's one).
    node_id: str
    # Changes whenever the entry does; "" when the entry is absent.
    version: str
    # The plan's epoch, when the watcher read the plan (None: a drain
    # request, a node state, or a plan it could not read).
    epoch: int | None = None

    def describe(self) -> str:
        # The plan's version is a digest (engine.watch): a prefix is enough to tell two apart in the log.
        if self.entry == PLAN:
            return f"this host's part of the plan ({self.version[:12] or 'absent'})"
        what = f"{self.node_id}'s {'drain request' if self.entry == DRAIN else 'node state'}"
        return f"{what} ({self.version or 'absent'})"


@dataclass(frozen=True)
class WatchTimings:
    """The watcher's timings, in seconds (`fabric watch` options)."""

    # A drain request or node state change waits this long for the plan
    # that usually follows it (a new part of the plan starts at once).
    window_s: float = 0.2
    # How often the sqlite registry is read.
    poll_s: float = 0.5
    # While changes wait for a running pass to end, how often it is looked
    # at: the pass after it starts within this long of its end. A pass the
    # timer started just before a new plan would otherwise hold that plan
    # back by up to a whole poll_s (one D-Bus property read each time, and
    # only while something waits).
    running_poll_s: float = 0.1
    # Retries of an unreachable registry or systemd: from this, doubling ...
    retry_min_s: float = 0.5
    # ... up to this. Once the registry is back, a watcher follows it again
    # within this long: well inside the timer's interval (30 s by default),
    # so a plan published as an outage ends is not left to the next tick (at
    # 30 s the e2e outage test saw watchers blind 24-29 s after etcd came
    # back). A try is one connection per host every 5 s: nothing to etcd.
    retry_max_s: float = 5.0


@dataclass(frozen=True)
class WatchState:
    """What the watcher has seen and not yet acted on."""

    # (entry, node_id) -> the version last seen.
    seen: Mapping[tuple[Entry, str], str] = field(default_factory=dict)
    # When the first change not yet handed to a pass was seen (None: none).
    pending_since: float | None = None
    # The changes not yet handed to a pass, for the log.
    pending: tuple[EntryVersion, ...] = ()


@dataclass(frozen=True)
class Decision:
    """Start a pass now, or look again within `wake_in_s` (None: only when something changes)."""

    start: bool
    wake_in_s: float | None = None


def concerns(change: EntryVersion, host: str) -> bool:
    """Whether a change of this entry is this host's business: a drain
    request or node state only its own node's; the plan's always, since the
    watcher reports as its version the digest of this host's part of it
    (`engine.watch`), which changes only when what this host's pass would
    take from the plan does."""
    return change.entry == PLAN or change.node_id == host


def observe(state: WatchState, entries: Iterable[EntryVersion], host: str, now: float) -> WatchState:
    """`state` after the backend reported `entries` at `now`: an entry that
    concerns this host and whose version differs from the one seen before is a
    pending change; the first version seen of an entry is only the baseline."""
    seen = dict(state.seen)
    changed: list[EntryVersion] = []
    for entry in entries:
        if not concerns(entry, host):
            continue
        key = (entry.entry, entry.node_id)
        if key in seen and seen[key] != entry.version:
            changed.append(entry)
        seen[key] = entry.version
    if not changed:
        return WatchState(seen=seen, pending_since=state.pending_since, pending=state.pending)
    since = state.pending_since if state.pending_since is not None else now
    return WatchState(seen=seen, pending_since=since, pending=(*state.pending, *changed))


def decide(state: WatchState, now: float, pass_running: bool, timings: WatchTimings) -> Decision:
    """Whether to start a pass now. Nothing pending: no. A pass running: not
    yet, look again in `running_poll_s`. A new part of the plan pending: now.
    Else once `window_s` has passed since the first pending change (or at
    once when the clock went back past it)."""
    if state.pending_since is None:
        return Decision(start=False)
    if pass_running:
        return Decision(start=False, wake_in_s=timings.running_poll_s)
    if any(change.entry == PLAN for change in state.pending):
        return Decision(start=True)
    due = state.pending_since + timings.window_s
    if now >= due or now < state.pending_since:
        return Decision(start=True)
    return Decision(start=False, wake_in_s=due - now)


def taken(state: WatchState, epoch: int | None) -> WatchState:
    """`state` without the pending parts of the plan a pass has taken: those
    of a plan of `epoch` or older (what the last pass recorded, `PLAN_TAKEN`;
    None: no record). A pass that ran when the plan came took it in another
    round, or read it anyway: no pass needs to follow for it. A drain
    request or node state stays pending (a pass reads what follows from it)."""
    if epoch is None or state.pending_since is None:
        return state
    left = tuple(change for change in state.pending if change.entry != PLAN or change.epoch is None or change.epoch > epoch)
    if not left:
        return WatchState(seen=state.seen)
    return WatchState(seen=state.seen, pending_since=state.pending_since, pending=left)


# The last pass's record of the plan it took, in its state directory:
# {"epoch": N}, the epoch of the plan it rendered and activated (or found
# nothing to do for), so any plan up to N is no news to this host
# (reconciler.engine.reconcile writes it).
PLAN_TAKEN = "plan-taken.json"


def plan_taken_record(epoch: int) -> bytes:
    return json.dumps({"epoch": epoch}).encode()


def _number_in(record: bytes | None, key: str) -> int | float | None:
    """The number under `key` in a JSON object record; None when there is no
    record, it does not parse or the value is no number (a bool is none)."""
    if record is None:
        return None
    try:
        value = json.loads(record).get(key)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def epoch_taken(record: bytes | None) -> int | None:
    """The epoch in a PLAN_TAKEN record; None when there is none or it does not parse."""
    epoch = _number_in(record, "epoch")
    return epoch if isinstance(epoch, int) else None


# The watcher's ask, in the pass's state directory, written just before it
# starts a pass: {"at": seconds since the epoch}. `fabric pull`, the pass's
# ExecStartPre with a git [source], reads and removes it: a pass that reacts
# to the registry does not wait for a fetch (reconciler.core.install.fetching).
PASS_ASKED = "pass-asked.json"


def moment_record(at: float) -> bytes:
    """A record of one moment: {"at": seconds since the epoch}."""
    return json.dumps({"at": at}).encode()


def recorded_moment(record: bytes | None) -> float | None:
    """The moment in a `moment_record`; None when there is none or it does not parse."""
    at = _number_in(record, "at")
    return None if at is None else float(at)


def started(state: WatchState) -> WatchState:
    """`state` once a pass was started for its pending changes."""
    return WatchState(seen=state.seen)


def retry_delay(failures: int, timings: WatchTimings) -> float:
    """The wait before the next try after `failures` failures in a row (>= 1)."""
    return float(min(timings.retry_max_s, timings.retry_min_s * 2 ** max(0, min(failures - 1, 60))))
