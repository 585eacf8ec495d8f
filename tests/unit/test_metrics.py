"""The metrics textfile: checked by a strict parser of the Prometheus text format.

tests/integration/test_status_page_metrics.py also runs the real promtool and
node_exporter over it; this parser pins the format rules without them and says
which rule broke.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import Deferred, FleetPlan, Snapshot
from reconciler.core.views.metrics import (
    Family,
    PassMetrics,
    exposition,
    format_value,
    render_metrics,
)
from tests.conftest import EXAMPLE_FLEET, REPO

FIXTURES = REPO / "tests" / "fixtures" / "status"
NOW = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)
PASS = PassMetrics(duration_s=1.25, succeeded=True, last_success=NOW, generation=12, plan_epoch=7, rollbacks_total=3)


# --------------------------------------------------------------------------
# A strict parser of the text exposition format (version 0.0.4)

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
SAMPLE_RE = re.compile(rf"^(?P<name>{NAME})(?:\{{(?P<labels>.*)\}})? (?P<value>\S+)(?P<rest>.*)$")
LABEL_PAIR_RE = re.compile(rf'({LABEL})="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


class ExpositionError(ValueError):
    pass


@dataclass
class ParsedFamily:
    name: str
    type: str | None = None
    help: str | None = None
    samples: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def value(self, **labels: str) -> float:
        return self.samples[tuple(sorted(labels.items()))]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], value)


def _parse_labels(text: str, lineno: int) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = LABEL_PAIR_RE.match(text, pos)
        if not match:
            raise ExpositionError(f"line {lineno}: bad label set at {text[pos:]!r}")
        pairs.append((match.group(1), _unescape(match.group(2))))
        pos = match.end()
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ExpositionError(f"line {lineno}: duplicate label name")
    if any(n.startswith("__") for n in names):
        raise ExpositionError(f"line {lineno}: reserved label name")
    return tuple(sorted(pairs))


def _parse_value(text: str, lineno: int) -> float:
    if text in ("NaN", "+Inf", "-Inf"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    if not re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text):
        raise ExpositionError(f"line {lineno}: bad value {text!r}")
    return float(text)


def parse_exposition(text: str) -> dict[str, ParsedFamily]:
    """Families by name; raises ExpositionError naming the line and the rule."""
    if text and not text.endswith("\n"):
        raise ExpositionError("the last line must end with a newline")
    families: dict[str, ParsedFamily] = {}
    finished: set[str] = set()
    current: str | None = None

    def enter(name: str, lineno: int) -> ParsedFamily:
        nonlocal current
        if name != current:
            if name in finished:
                raise ExpositionError(f"line {lineno}: {name}: samples and metadata of a family must be contiguous")
            if current is not None:
                finished.add(current)
            current = name
        return families.setdefault(name, ParsedFamily(name))

    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            raise ExpositionError(f"line {lineno}: blank line")
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if not re.fullmatch(NAME, parts[2]):
                    raise ExpositionError(f"line {lineno}: invalid metric name {parts[2]!r}")
                family = enter(parts[2], lineno)
                if family.samples:
                    raise ExpositionError(f"line {lineno}: {parts[1]} after samples of {parts[2]}")
                if parts[1] == "TYPE":
                    if family.type is not None or len(parts) != 4 or parts[3] not in TYPES:
                        raise ExpositionError(f"line {lineno}: bad or repeated TYPE")
                    family.type = parts[3]
                else:
                    if family.help is not None or len(parts) != 4:
                        raise ExpositionError(f"line {lineno}: bad or repeated HELP")
                    # Only \\ and \n are escapes in HELP; any other backslash is bad.
                    if "\\" in re.sub(r"\\[\\n]", "", parts[3]):
                        raise ExpositionError(f"line {lineno}: bad escape in HELP")
                    family.help = parts[3]
            continue
        match = SAMPLE_RE.match(line)
        if not match:
            raise ExpositionError(f"line {lineno}: not a sample: {line!r}")
        if match.group("rest"):
            # The textfile collector refuses client-side timestamps.
            raise ExpositionError(f"line {lineno}: trailing text (a timestamp?) {match.group('rest')!r}")
        family = enter(match.group("name"), lineno)
        if family.type is None or family.help is None:
            raise ExpositionError(f"line {lineno}: sample of {family.name} before its HELP and TYPE")
        labels = _parse_labels(match.group("labels") or "", lineno)
        if labels in family.samples:
            raise ExpositionError(f"line {lineno}: duplicate series {family.name}{dict(labels)}")
        value = _parse_value(match.group("value"), lineno)
        if family.type == "counter" and (value < 0 or math.isnan(value)):
            raise ExpositionError(f"line {lineno}: counter {family.name} is negative")
        family.samples[labels] = value
    for family in families.values():
        if family.type == "counter" and not family.name.endswith("_total"):
            raise ExpositionError(f"counter {family.name} does not end in _total")
    return families


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("x 1", "newline"),
        ("x 1\n", "before its HELP and TYPE"),
        ('# HELP x h\n# TYPE x gauge\nx{a="b} 1\n', "bad label set"),
        ('# HELP x h\n# TYPE x gauge\nx{a="\\t"} 1\n', "bad label set"),
        ('# HELP x h\n# TYPE x gauge\nx{a="1"} 1\nx{a="1"} 2\n', "duplicate series"),
        ("# HELP x h\n# TYPE x gauge\nx 1 1700000000000\n", "timestamp"),
        ("# HELP x h\n# TYPE x gauge\nx one\n", "bad value"),
        ("# HELP x h\n# TYPE x gauge\nx 1\n# HELP y h\n# TYPE y gauge\ny 1\nx 2\n", "contiguous"),
        ("# HELP x h\n# TYPE x counter\nx 1\n", "_total"),
        ("# HELP 1x h\n", "invalid metric name"),
        ("# HELP x a\\tb\n", "bad escape in HELP"),
    ],
)
def test_the_parser_is_strict(text, rule):
    with pytest.raises(ExpositionError, match=rule):
        parse_exposition(text)


# --------------------------------------------------------------------------
# The fabric's textfile


@pytest.fixture(scope="module")
def fleet_text() -> str:
    desired = load_desired(EXAMPLE_FLEET)
    snapshot = Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())
    plan = FleetPlan.model_validate_json((FIXTURES / "plan.json").read_text())
    return render_metrics(PASS, desired, snapshot, plan)


def test_the_pass_and_fleet_families_parse_with_help_and_type(fleet_text):
    families = parse_exposition(fleet_text)

    assert sorted(families) == [
        "fabric_deferred_replicas",
        "fabric_generation",
        "fabric_lane_cap",
        "fabric_lane_in_flight",
        "fabric_lane_rank",
        "fabric_lane_up",
        "fabric_leader_failing",
        "fabric_leader_info",
        "fabric_node_cost_info",
        "fabric_node_draining",
        "fabric_node_held_off",
        "fabric_node_in_flight",
        "fabric_node_info",
        "fabric_node_last_seen_timestamp_seconds",
        "fabric_node_max_concurrent_tasks",
        "fabric_node_status",
        "fabric_node_tier_score",
        "fabric_paid_slots",
        "fabric_paid_slots_in_use",
        "fabric_plan_epoch",
        "fabric_reconcile_duration_seconds",
        "fabric_reconcile_last_success_timestamp_seconds",
        "fabric_reconcile_success",
        "fabric_rollbacks_total",
    ]
    assert families["fabric_rollbacks_total"].type == "counter"
    assert all(f.type == "gauge" for name, f in families.items() if name != "fabric_rollbacks_total")


def test_pass_values(fleet_text):
    f = parse_exposition(fleet_text)

    assert f["fabric_reconcile_duration_seconds"].value() == 1.25
    assert f["fabric_reconcile_success"].value() == 1
    assert f["fabric_reconcile_last_success_timestamp_seconds"].value() == NOW.timestamp()
    assert f["fabric_generation"].value() == 12
    assert f["fabric_plan_epoch"].value() == 7
    assert f["fabric_rollbacks_total"].value() == 3


def test_node_status_is_a_state_set_and_tier_an_info_label(fleet_text):
    f = parse_exposition(fleet_text)
    status = f["fabric_node_status"]

    for node in ("a1-arm64", "lux", "qfox-1", "racknerd", "x86-spill"):
        current = [s for s in ("active", "draining", "offline", "dead", "not_reporting") if status.value(node=node, status=s) == 1]
        assert current == (["not_reporting"] if node == "qfox-1" else ["active"])
    assert f["fabric_node_info"].value(node="racknerd", tier="relay") == 1
    assert f["fabric_node_tier_score"].value(node="racknerd") == 0
    assert f["fabric_node_tier_score"].value(node="a1-arm64") == 7
    assert f["fabric_node_held_off"].value(node="x86-spill") == 1
    assert f["fabric_node_draining"].value(node="lux") == 1
    assert f["fabric_node_in_flight"].value(node="a1-arm64") == 2
    assert f["fabric_node_max_concurrent_tasks"].value(node="x86-spill") == 4
    assert f["fabric_node_last_seen_timestamp_seconds"].value(node="racknerd") == NOW.timestamp() - 3


def test_lanes_in_flight_cap_and_up(fleet_text):
    f = parse_exposition(fleet_text)

    assert f["fabric_lane_in_flight"].value(lane="a1-arm64", kind="compute") == 1
    assert f["fabric_lane_cap"].value(lane="x86-spill", kind="compute") == 4
    assert f["fabric_lane_rank"].value(lane="local", kind="local") == 99
    assert {labels: v for labels, v in f["fabric_lane_up"].samples.items()} == {
        (("kind", "compute"), ("lane", "a1-arm64")): 1,
        (("kind", "compute"), ("lane", "x86-spill")): 0,  # its host held off
        (("kind", "local"), ("lane", "local")): 0,  # its control host lux drained
    }


def test_deferred_work_by_reason_and_state(fleet_text):
    deferred = parse_exposition(fleet_text)["fabric_deferred_replicas"]

    assert sorted((dict(labels)["state"], v) for labels, v in deferred.samples.items()) == [
        ("inadmissible", 1),
        ("waiting", 1),
    ]
    assert parse_exposition(fleet_text)["fabric_leader_info"].value(node="lux") == 1


def test_reasons_with_quotes_backslashes_and_newlines_survive_escaping():
    desired = load_desired(EXAMPLE_FLEET)
    reason = 'label "gpu\\model" missing\nsecond line'
    plan = FleetPlan(
        epoch=1,
        leader="lux",
        created=NOW,
        deferred=[
            Deferred(service="lupine", replica=0, reason=reason, inadmissible=True),
            Deferred(service="braid", replica=0, reason=reason, inadmissible=True),
        ],
    )

    text = render_metrics(PassMetrics(), desired, Snapshot(now=NOW), plan)

    deferred = parse_exposition(text)["fabric_deferred_replicas"]
    assert deferred.value(state="inadmissible", reason=reason) == 2
    assert '\\"gpu\\\\model\\" missing\\nsecond line' in text


def test_a_host_without_a_registry_still_exports_its_pass():
    text = render_metrics(PassMetrics(duration_s=0.5, succeeded=False, rollbacks_total=1))

    families = parse_exposition(text)
    assert sorted(families) == ["fabric_reconcile_duration_seconds", "fabric_reconcile_success", "fabric_rollbacks_total"]
    assert families["fabric_reconcile_success"].value() == 0


def test_same_fleet_same_text_whatever_the_order_of_the_snapshot():
    desired = load_desired(EXAMPLE_FLEET)
    snapshot = Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())
    shuffled = snapshot.model_copy(update={"nodes": list(reversed(snapshot.nodes)), "lanes": list(reversed(snapshot.lanes))})

    assert render_metrics(PASS, desired, snapshot) == render_metrics(PASS, desired, shuffled)


def test_plan_epoch_falls_back_to_the_plan_when_the_pass_does_not_say():
    desired = load_desired(EXAMPLE_FLEET)
    plan = FleetPlan(epoch=9, leader="lux", created=NOW)

    families = parse_exposition(render_metrics(PassMetrics(), desired, Snapshot(now=NOW), plan))

    assert families["fabric_plan_epoch"].value() == 9


@pytest.mark.parametrize(
    ("name", "kind"),
    [("fabric-bad", "gauge"), ("2fabric", "gauge"), ("fabric_rollbacks", "counter")],
)
def test_a_family_refuses_names_the_format_or_convention_forbids(name, kind):
    with pytest.raises(ValueError):
        Family(name, kind, "help")


def test_a_family_refuses_reserved_label_names():
    with pytest.raises(ValueError, match="__name__"):
        Family("fabric_x", "gauge", "help").add(1, __name__="y")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1, "1.0"),
        (True, "1.0"),
        (False, "0.0"),
        (1.25, "1.25"),
        (3.0, "3.0"),
        (1795977000.125, "1.795977000125e+09"),  # a timestamp keeps every digit
        (float("nan"), "NaN"),
        (float("inf"), "+Inf"),
        (-float("inf"), "-Inf"),
    ],
)
def test_values_are_written_as_the_format_spells_them(value, text):
    """prometheus_client's spelling (Go's float format), which the textfile collector parses."""
    assert format_value(value) == text
    family = Family("fabric_x", "gauge", "help")
    family.add(value)
    assert exposition([family]).splitlines()[-1] == f"fabric_x {text}"


def test_help_text_escapes_backslash_and_newline():
    family = Family("fabric_x", "gauge", "a \\ b\nc")
    family.add(1)

    text = exposition([family])

    assert text.splitlines()[0] == "# HELP fabric_x a \\\\ b\\nc"
    assert parse_exposition(text)["fabric_x"].value() == 1


def test_label_escaping_matches_the_format():
    family = Family("fabric_x", "gauge", "help")
    family.add(1, node='a"b\\c\nd')

    text = exposition([family])

    assert text.splitlines()[-1] == 'fabric_x{node="a\\"b\\\\c\\nd"} 1.0'
    assert parse_exposition(text)["fabric_x"].value(node='a"b\\c\nd') == 1
