"""Time as the fabric keeps it: aware UTC datetimes, and one text form for them.

The registry writes UTC; hand-written snapshots and plans may leave the zone
out, and a naive datetime is then read as UTC (`utc`). Every comparison in the
core goes through `utc`, so naive and aware values never meet.

Text forms:
    utc_stamp(t)       2026-11-29T18:26:48Z                 logs, reasons, the CLI
    stamp(t, now)      2026-11-29T18:26:48Z (12 s ago)      the CLI's tables, or "-"
    display_time(t)    2026-11-29 18:26:48 UTC              the status page and cards

The bottom layer of the core: it imports nothing of the project, and every
other part of the core may import it.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utc(moment: datetime) -> datetime:
    """`moment` as an aware UTC datetime (a naive value is taken as UTC)."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def utc_now() -> datetime:
    """The current time, aware, in UTC. The core takes `now` as an argument;
    this is for the edges (and the one default that means "now")."""
    return datetime.now(UTC)


def from_epoch_seconds(seconds: float) -> datetime:
    """A clock's seconds since the epoch (the `Clock` port) as an aware UTC datetime."""
    return datetime.fromtimestamp(seconds, tz=UTC)


def epoch_seconds(moment: datetime) -> float:
    """Seconds since the epoch (a naive value is taken as UTC)."""
    return utc(moment).timestamp()


def utc_stamp(moment: datetime) -> str:
    """`2026-11-29T18:26:48Z`, whatever zone the datetime carries."""
    return utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def stamp(moment: datetime | None, now: datetime | None = None, *, absent: str = "-") -> str:
    """`2026-11-29T18:26:48Z`, with `(12 s ago)` / `(5 s from now)` when `now`
    is given; `absent` for no time at all."""
    if moment is None:
        return absent
    text = utc_stamp(moment)
    if now is not None:
        delta = (utc(now) - utc(moment)).total_seconds()
        text += f" ({abs(delta):.0f} s {'ago' if delta >= 0 else 'from now'})"
    return text


def display_time(moment: datetime) -> str:
    """`2026-11-29 18:26:48 UTC`: for people (the status page, the cards)."""
    return utc(moment).strftime("%Y-%m-%d %H:%M:%S UTC")
