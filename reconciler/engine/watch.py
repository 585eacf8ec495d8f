"""The watcher's loop (`fabric watch`, fabric-watch.service): follow the registry, start passes.

Talks to the world only through ports: `WatchRegistry.watch_host` reports the
entries that concern this host, `PassStarter` looks at and starts
fabric-reconcile.service, the `Clock` times the coalescing window. What a
change means and when to start is decided by the pure
`reconciler.core.live.watching`.

The plan is the fleet's, but a host acts only on its part of it (the
services placed on it, on the edge each routed service's nodes:
`reconciler.core.render.plan_part`, all that its render reads from a plan).
When the registry reports a new version of the plan, the watcher reads the
plan's signed index alone and follows the digest of this host's parts in it
(`plan_parts.parts_version`: no part is read, no desired state loaded, so
its cost does not grow with the plan); the edge (and a control host of a
phaze fleet) reads what its part is made of (the whole plan; its own parts
and the fleet part) and the desired state through `desired_for` (re-read
then, so a route or host added since the watcher started counts), and
follows the digest of its `plan_part`. Either way a plan that moves work
between two other hosts starts no pass here. A plan or desired state that
cannot be read or parsed counts as a change (the pass says why).

One `step()`:
  1. wait for the registry (at most `poll_s`, or until the window of pending
     changes ends), turn a new plan version into this host's part's digest,
     and note what changed (`observe`);
  2. with changes pending: ask systemd whether a pass runs; when none does,
     drop the parts of the plan the last pass took (`taken`, its record read
     through `epoch_taken`), then start one when `decide` says so, its
     ask recorded first (`record_ask`: a pass that reacts to the registry
     does not wait for a git fetch).
A registry or systemd that cannot be reached is said once per outage and
retried after `retry_delay` (doubling up to `retry_max_s`); pending changes
stay pending through an outage of systemd. The timer remains the backstop.

Beside it, on a thread and a registry connection of its own,
`LivenessKeeper` keeps the host's fast liveness record alive every couple
of seconds (issue 30): cheap, no pass, no desired state.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.core.desired.load import DesiredStateError
from reconciler.core.desired.model import DesiredState
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.plan_parts import host_part_names, parts_version
from reconciler.core.live.watching import PLAN, EntryVersion, WatchState, WatchTimings, decide, observe, retry_delay, started, taken
from reconciler.core.render.plan_part import plan_part, reads_fleet_part, reads_whole_plan
from reconciler.core.scheduling.edge_upstreams import EdgeUpstreams, caddy_upstreams
from reconciler.core.timestamps import from_epoch_seconds
from reconciler.ports import ActivationError, Clock, LivenessConnection, PassStarter, RegistryError, RegistryUnavailable, WatchRegistry


@dataclass
class Watcher:
    registry: WatchRegistry
    starter: PassStarter
    clock: Clock
    host: str
    # The desired state this host's part of a plan is computed under, read
    # again for each new plan (cli.watch: fabric.toml, this host's file and,
    # on the edge, the files of its routed services' nodes). Raises
    # DesiredStateError (or OSError) when it cannot be read.
    desired_for: Callable[[FleetPlan], DesiredState]
    # fabric.toml and this host's file (cli.watch: read again for each new
    # plan), which say what this host's part is read from (`_part_version`);
    # None: the whole plan, always.
    own_desired: Callable[[], DesiredState] | None = None
    timings: WatchTimings = field(default_factory=WatchTimings)
    # The epoch of the plan the last pass took (its PLAN_TAKEN record; None:
    # none). Read only when changes wait and no pass runs.
    epoch_taken: Callable[[], int | None] = lambda: None
    # Records the watcher's ask just before it starts a pass (cli.watch: the
    # PASS_ASKED record in the state directory), so that the pass does not
    # fetch git first (`fabric pull`, reconciler.core.install.fetching).
    # Raises OSError when it cannot: the pass then fetches, and starts all
    # the same.
    record_ask: Callable[[], None] = lambda: None
    log: Callable[[str], None] = print
    # Wait between steps (a threading.Event's wait in production; tests may
    # pass a fake that only records the delays asked for).
    pause: Callable[[float], None] | None = None
    state: WatchState = field(default_factory=WatchState)
    # Failures in a row (0: the last try worked) and the outage last said.
    failures: int = 0
    _outage: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake_in: float | None = None
    # The registry's last plan version, the part version it was turned into and the plan's epoch.
    _plan_seen: tuple[str, str, int | None] | None = None

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        while not self._stop.is_set():
            delay = self.step()
            if delay > 0:
                (self.pause or self._stop.wait)(delay)

    def step(self) -> float:
        """One round; returns how long to wait before the next (0: at once)."""
        timeout = self.timings.poll_s if self._wake_in is None else min(self._wake_in, self.timings.poll_s)
        try:
            entries = self.registry.watch_host(self.host, timeout)
        except RegistryUnavailable as exc:
            return self._failed(f"registry unreachable: {exc}")
        entries = [self._part_of(entry) if entry.entry == PLAN else entry for entry in entries]
        if entries and not self.state.seen:
            self.log(f"following {', '.join(entry.describe() for entry in entries)}")
        self.state = observe(self.state, entries, self.host, self.clock.now())
        if self.state.pending_since is None:
            return self._nothing_pending()
        try:
            running = self.starter.pass_running()
            if not running and not self._taken_by_the_last_pass():
                return self._nothing_pending()
            decision = decide(self.state, self.clock.now(), running, self.timings)
            if decision.start:
                self._record_ask()
                self.starter.start_pass()
        except ActivationError as exc:
            return self._failed(f"cannot start a pass: {exc}")
        self._recovered()
        if decision.start:
            self.log(f"started a pass of {self.host}: {', '.join(change.describe() for change in self.state.pending)} changed")
            self.state = started(self.state)
        self._wake_in = decision.wake_in_s
        return 0.0

    def _nothing_pending(self) -> float:
        self._recovered()
        self._wake_in = None
        return 0.0

    def _record_ask(self) -> None:
        try:
            self.record_ask()
        except OSError as exc:
            self.log(f"cannot record the ask for a pass ({exc}): with a git source it fetches first")

    def _taken_by_the_last_pass(self) -> bool:
        """Drop the pending parts of the plan the last pass took (`taken`);
        False when nothing is left pending."""
        epoch = self.epoch_taken()
        left = taken(self.state, epoch)
        if left.pending_since is None:
            self.log(f"the last pass took plan epoch {epoch}: {', '.join(change.describe() for change in self.state.pending)} needs no pass")
        self.state = left
        return left.pending_since is not None

    def _part_of(self, entry: EntryVersion) -> EntryVersion:
        """The plan entry with, as its version, this host's part of the newest
        plan ("" while there is no plan). Read once per registry version: a
        backend that reports it again after reconnecting costs no read.

        What is read (`_part_version`): a host whose part is its placements
        alone, the index only (`plan_glance`: its own parts' digests found
        in the index's bytes): its version is their digest (`parts_version`),
        so no part is read, no desired state loaded and the index not parsed
        whole, whatever the size of the plan; a control host
        of a phaze fleet, its parts and the fleet part (the steering); the
        edge, the whole plan (its routed services' nodes); those two then
        follow `plan_part`'s digest under `desired_for`.

        No signature check here: the pass verifies the plan it renders. A
        forged plan can at most start a pass that then refuses it (fail
        static), or start none when its part here is the one already
        followed (that pass would have refused it anyway). The one cost: a
        genuine plan published after a forgery, whose part here equals the
        forgery's, starts no pass (its part is no change from the forgery's);
        the next timer pass applies it."""
        if entry.version == "":
            self._plan_seen = None
            return entry
        if self._plan_seen is not None and self._plan_seen[0] == entry.version:
            return dataclasses.replace(entry, version=self._plan_seen[1], epoch=self._plan_seen[2])
        before = self._plan_seen[1] if self._plan_seen is not None else None
        epoch = None
        try:
            version, epoch = self._part_version()
            if version == before and epoch is not None:
                self.log(f"plan epoch {epoch} leaves {self.host}'s part as it was: no pass")
        except (RegistryError, DesiredStateError, ValueError, OSError) as exc:
            # Counted as a change (a version no part digest can equal): the pass reads it again and says why.
            self.log(f"cannot tell {self.host}'s part of the plan ({entry.version}): {exc}")
            version = f"unread {entry.version}"
        self._plan_seen = (entry.version, version, epoch)
        return dataclasses.replace(entry, version=version, epoch=epoch)

    def _part_version(self) -> tuple[str, int | None]:
        """This host's part's version and the plan's epoch ("", None: no plan)."""
        own = self.own_desired() if self.own_desired is not None else None
        if own is not None and not reads_whole_plan(own, self.host):
            fleet = reads_fleet_part(own, self.host)
            if not fleet:
                glance = self.registry.plan_glance(self.host)
                if glance is None:
                    return "", None
                return f"parts {parts_version(glance[1])}", glance[0]
            read = self.registry.plan_read(lambda index: host_part_names(index, self.host, fleet=True))
            plan = read.plan if read is not None else None
        else:
            plan = self.registry.newest_plan()
        if plan is None:
            return "", None
        return plan_part(self.desired_for(plan), plan, self.host).digest, plan.epoch

    def _failed(self, reason: str) -> float:
        self.failures += 1
        delay = retry_delay(self.failures, self.timings)
        if reason != self._outage:
            self.log(f"{reason}; retrying (every {self.timings.retry_max_s:g} s at most; the timer's passes go on)")
            self._outage = reason
        return delay

    def _recovered(self) -> None:
        if self._outage is not None:
            self.log(f"working again after {self.failures} failed tries")
        self.failures = 0
        self._outage = None


@dataclass
class LivenessKeeper:
    """fabric-watch's fast liveness record (issue 30): `keep_alive` every
    `interval_s` on a connection of its own, for `ttl_s` each time. It
    never runs a pass and never reads the desired state: a host whose
    watcher (or machine) stops lets the record lapse within `ttl_s`, and the
    leader suspects it then. A registry that cannot be reached is said once
    per outage and tried again at the next interval."""

    registry: LivenessConnection
    host: str
    interval_s: float
    ttl_s: float
    log: Callable[[str], None] = print
    pause: Callable[[float], None] | None = None
    # On an edge host: its Caddy's upstreams (the admin API's answer) and the
    # clock, to store them beside the keep-alive when they change, and at
    # least every `edge_refresh_s` (the leader trusts a record a heartbeat long).
    edge_upstreams: Callable[[], object] | None = None
    clock: Clock | None = None
    edge_refresh_s: float = 10.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _outage: str | None = None
    _edge_problem: str | None = None
    _edge_stored: tuple[float, tuple[tuple[str, int], ...]] | None = None

    def stop(self) -> None:
        self._stop.set()

    def step(self) -> bool:
        """One keep-alive; False when it failed."""
        try:
            self.registry.keep_alive(self.host, self.ttl_s)
        except RegistryError as exc:
            reason = f"cannot keep {self.host}'s liveness record alive: {exc}"
            if reason != self._outage:
                self.log(f"{reason}; trying again every {self.interval_s:g} s")
                self._outage = reason
            return False
        if self._outage is not None:
            self.log(f"{self.host}'s liveness record kept alive again")
            self._outage = None
        self.report_edge()
        return True

    def report_edge(self) -> None:
        """Store this edge's Caddy upstreams (P/edge-upstreams/<host>) when
        which of them fail changed, or the stored record grows old; a Caddy
        or registry that cannot be read is said once."""
        if self.edge_upstreams is None or self.clock is None:
            return
        now = self.clock.now()
        try:
            upstreams = caddy_upstreams(self.edge_upstreams())
            failing = tuple(sorted((u.address, min(u.fails, 1)) for u in upstreams))
            if self._edge_stored is not None and self._edge_stored[1] == failing and now - self._edge_stored[0] < self.edge_refresh_s:
                return
            record = EdgeUpstreams(edge=self.host, at=from_epoch_seconds(now), upstreams=upstreams)
            self.registry.report_edge_upstreams(self.host, record.model_dump_json().encode())
        except (ActivationError, RegistryError, ValueError) as exc:
            if str(exc) != self._edge_problem:
                self.log(f"cannot report {self.host}'s Caddy upstreams: {exc}")
                self._edge_problem = str(exc)
            return
        self._edge_stored = (now, failing)
        self._edge_problem = None

    def run(self) -> None:
        while not self._stop.is_set():
            self.step()
            (self.pause or self._stop.wait)(self.interval_s)
