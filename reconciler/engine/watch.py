"""The watcher's loop (`fabric watch`, fabric-watch.service): follow the registry, start passes.

Talks to the world only through ports: `Registry.watch_host` reports the
entries that concern this host, `PassStarter` looks at and starts
fabric-reconcile.service, the `Clock` times the coalescing window. What a
change means and when to start is decided by the pure
`reconciler.core.live.watching`.

One `step()`:
  1. wait for the registry (at most `poll_s`, or until the window of pending
     changes ends) and note what changed (`observe`);
  2. with changes pending: ask systemd whether a pass runs, and start one
     when `decide` says so.
A registry or systemd that cannot be reached is said once per outage and
retried after `retry_delay` (doubling up to `retry_max_s`); pending changes
stay pending through an outage of systemd. The timer remains the backstop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from reconciler.core.live.watching import WatchState, WatchTimings, decide, observe, retry_delay, started
from reconciler.ports import ActivationError, Clock, PassStarter, Registry, RegistryUnavailable


@dataclass
class Watcher:
    registry: Registry
    starter: PassStarter
    clock: Clock
    host: str
    timings: WatchTimings = field(default_factory=WatchTimings)
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
        if entries and not self.state.seen:
            self.log(f"following {', '.join(entry.describe() for entry in entries)}")
        self.state = observe(self.state, entries, self.host, self.clock.now())
        if self.state.pending_since is None:
            self._recovered()
            self._wake_in = None
            return 0.0
        try:
            decision = decide(self.state, self.clock.now(), self.starter.pass_running(), self.timings)
            if decision.start:
                self.starter.start_pass()
        except ActivationError as exc:
            return self._failed(f"cannot start a pass: {exc}")
        self._recovered()
        if decision.start:
            self.log(f"started a pass of {self.host}: {', '.join(change.describe() for change in self.state.pending)} changed")
            self.state = started(self.state)
        self._wake_in = decision.wake_in_s
        return 0.0

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
