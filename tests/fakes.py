"""Small fakes of the ports shared by several test modules."""

from __future__ import annotations

from datetime import UTC, datetime

# A fixed instant the fake clock starts at (the seed's registry example time).
T0 = datetime(2026, 6, 1, 4, 0, tzinfo=UTC).timestamp()


class FakeClock:
    """The `Clock` port, moved by hand: lifecycle, TTL and scaling tests never sleep."""

    def __init__(self, start: float = T0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
