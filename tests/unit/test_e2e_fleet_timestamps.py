"""The e2e fleet's reading of systemd's timestamps (tests/e2e/fleet.py):
to the microsecond, in UTC. `systemctl show --timestamp=unix` gives whole
seconds, which put a unit's start up to a second before the plan that
started it (bench/convergence printed "started" before "pass")."""

from __future__ import annotations

from datetime import UTC, datetime

from tests.e2e.fleet import parse_us_utc


def test_a_us_utc_timestamp_keeps_its_microseconds() -> None:
    assert parse_us_utc("Tue 2026-12-01 08:53:51.479920 UTC") == datetime(2026, 12, 1, 8, 53, 51, 479920, tzinfo=UTC)


def test_an_empty_timestamp_is_none() -> None:
    assert parse_us_utc("") is None
