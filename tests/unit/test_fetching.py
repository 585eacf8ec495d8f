"""Whether `fabric pull` fetches before a pass (reconciler.core.install.fetching),
the records it reads (reconciler.core.live.watching) and the timer's interval
in seconds (reconciler.core.install.nodeconfig.timespan_seconds)."""

from __future__ import annotations

import pytest

from reconciler.core.install.fetching import FETCH_EVERY_INTERVALS, fetch_choice
from reconciler.core.install.nodeconfig import TimerSection, timespan_seconds
from reconciler.core.live.watching import moment_record, recorded_moment

NOW = 1_800_000_000.0
INTERVAL = 30.0


@pytest.mark.parametrize(
    ("asked_ago", "fetched_ago", "fetch"),
    [
        (None, 5.0, True),
        (0.2, 5.0, False),
        (0.2, FETCH_EVERY_INTERVALS * INTERVAL - 0.1, False),
        (0.2, FETCH_EVERY_INTERVALS * INTERVAL, True),
        (0.2, None, True),
        (INTERVAL + 1, 5.0, True),
        (-5.0, 5.0, True),
        (0.2, -5.0, True),
    ],
    ids=[
        "the timer's or an operator's start fetches",
        "the watcher's ask with a recent fetch does not",
        "nor just inside the bound",
        "at the bound it fetches",
        "nor any fetch tried yet",
        "an ask left from a start that did not run",
        "an ask from the future",
        "a fetch from the future",
    ],
)
def test_only_a_pass_the_watcher_asked_for_skips_a_recent_fetch(asked_ago: float | None, fetched_ago: float | None, fetch: bool) -> None:
    choice = fetch_choice(
        asked_at=None if asked_ago is None else NOW - asked_ago,
        fetched_at=None if fetched_ago is None else NOW - fetched_ago,
        now=NOW,
        interval_s=INTERVAL,
    )
    assert choice.fetch is fetch


def test_a_skipped_fetch_says_why_and_who_fetches() -> None:
    choice = fetch_choice(asked_at=NOW - 0.1, fetched_at=NOW - 12.0, now=NOW, interval_s=INTERVAL)
    assert choice.reason == (
        "fabric-watch asked for this pass (the registry changed, not git) and the last fetch was tried 12.0 s ago; the timer's next pass fetches"
    )


@pytest.mark.parametrize(
    ("span", "seconds"),
    [
        ("30s", 30.0),
        ("30", 30.0),
        ("2min", 120.0),
        ("2m", 120.0),
        ("1h 30s", 3630.0),
        ("500ms", 0.5),
        ("1.5sec", 1.5),
        ("1d", 86400.0),
        ("2hr", 7200.0),
    ],
)
def test_a_timer_span_in_seconds_as_systemd_reads_it(span: str, seconds: float) -> None:
    assert TimerSection(interval=span).interval == span
    assert timespan_seconds(span) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("record", "moment"),
    [
        (moment_record(NOW), NOW),
        (b'{"at": 12}', 12.0),
        (None, None),
        (b"", None),
        (b"{not json", None),
        (b'{"at": "12"}', None),
        (b'{"at": true}', None),
        (b"[12]", None),
    ],
    ids=["written", "an int", "none", "empty", "not json", "a string", "a bool", "not an object"],
)
def test_a_moment_record_reads_back_and_anything_else_reads_as_none(record: bytes | None, moment: float | None) -> None:
    assert recorded_moment(record) == moment
