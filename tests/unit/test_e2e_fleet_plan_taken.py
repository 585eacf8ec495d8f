"""When the e2e fleet takes a host to have begun acting on a plan
(tests/e2e/fleet.py: first_taking), from the lines its passes really print:
the fence's verdict on the plan read (core.live.fencing.accept_plan) and the
note of another round (engine.reconcile.another_round_note)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from reconciler.core.live.fencing import accept_plan
from reconciler.core.live.models import FleetPlan
from reconciler.engine.reconcile import another_round_note
from tests.e2e.fleet import first_taking

PUBLISHED = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return PUBLISHED + timedelta(seconds=seconds)


def read(epoch: int, applied: int | None) -> str:
    """The note a pass prints for the plan it read."""
    return f"note: {accept_plan(applied, FleetPlan(epoch=epoch, leader='lux', created=PUBLISHED)).reason}"


def test_a_pass_started_after_the_publication_takes_the_plan() -> None:
    assert first_taking([at(-30), at(0.05)], [(at(0.6), read(12, 11))], 12, PUBLISHED) == at(0.05)


def test_a_pass_under_way_at_the_publication_that_read_the_plan_was_on_its_way_to_it_from_then() -> None:
    # Its timer's pass began before the publication and read the plan after
    # it: as on its way as a pass the watcher would have started then.
    lines = [(at(-0.1), "note: heartbeat: racknerd tier relay"), (at(0.8), read(12, 11))]
    assert first_taking([at(-0.4)], lines, 12, PUBLISHED) == PUBLISHED


def test_a_read_by_a_pass_that_started_after_the_publication_counts_from_its_start() -> None:
    assert first_taking([at(-30), at(0.3)], [(at(0.9), read(12, 11))], 12, PUBLISHED) == at(0.3)


def test_a_running_pass_that_read_the_plan_before_takes_it_in_another_round() -> None:
    lines = [(at(-0.3), read(11, 11)), (at(0.4), f"note: {another_round_note(12, 11)}"), (at(0.5), read(12, 11))]
    assert first_taking([at(-0.5)], lines, 12, PUBLISHED) == at(0.4)


def test_a_round_under_way_at_the_publication_that_read_the_plan_was_on_its_way_to_it_from_then() -> None:
    # A round for the plan before began just before this one's publication, and read this one.
    lines = [(at(-0.6), read(11, 10)), (at(-0.2), f"note: {another_round_note(11, 10)}"), (at(0.3), read(12, 10))]
    assert first_taking([at(-1.0)], lines, 12, PUBLISHED) == PUBLISHED


def test_an_older_plan_read_or_a_round_for_an_older_epoch_is_not_taking_it() -> None:
    lines = [(at(0.1), read(11, 10)), (at(0.2), f"note: {another_round_note(11, 10)}"), (at(0.3), read(11, 11))]
    assert first_taking([at(-0.5)], lines, 12, PUBLISHED) is None
    # A later plan read counts: it supersedes the one published (its pass
    # started after it here).
    assert first_taking([at(0.2)], [(at(0.7), read(13, 11))], 12, PUBLISHED) == at(0.2)
