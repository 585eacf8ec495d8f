"""The one fake of the `Clock` port. A test that needs the wall clock uses the
product's own (`reconciler.adapters.clock.SystemClock`)."""

from __future__ import annotations

from datetime import UTC, datetime

# A fixed instant the fake clock starts at (the seed's registry example time).
T0 = datetime(2026, 6, 1, 4, 0, tzinfo=UTC).timestamp()
# The instant of every pass through tests/support/fleet.py's sandbox (2026-11-18T11:06:40Z:
# the generations' CREATED column in tests/unit/test_apply.py).
T_PASS = 1_795_000_000.0


class FakeClock:
    """The `Clock` port, moved by hand (`advance`, or set `t`): lifecycle, TTL
    and scaling tests never sleep. A clock that never moves is one nobody advances."""

    def __init__(self, start: float = T0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
