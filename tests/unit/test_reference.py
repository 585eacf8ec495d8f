"""The desired state's generated reference and JSON Schema stay current, and
the schema `fabric schema` prints validates the example fleet's files with a
standard JSON Schema validator (what an editor such as taplo does with it)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest

from reconciler.cli import main
from reconciler.core.desired.reference import REGENERATE_REFERENCE, REGENERATE_SCHEMA, SCHEMA_FILE, reference_markdown, schema_json
from tests.conftest import EXAMPLE_FLEET, REPO

FLEET_FILE = EXAMPLE_FLEET / "fabric.toml"


def fabric_schema(*args: str) -> str:
    """`fabric schema ...` in-process: its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema", *args]) == 0
    return out.getvalue()


def test_docs_reference_is_generated_from_the_models() -> None:
    checked_in = (REPO / "docs" / "reference.md").read_text()
    assert checked_in == reference_markdown(), f"docs/reference.md is stale: regenerate it with `{REGENERATE_REFERENCE}`"


def test_the_reference_names_every_table_and_the_toml_name_of_the_lanes() -> None:
    text = fabric_schema("--reference")
    assert text == reference_markdown()
    for header in (
        "`[fleet]`",
        "`[timing]`",
        "`[[backends]]`",
        "`[[services]]`",
        "`[services.route]`",
        "`[agent.arch.<x86_64|aarch64>]`",
        "`[host]`",
    ):
        assert f"### {header}" in text, header
    assert "`lanes`" not in text  # the model's name for [[backends]] is not a TOML key
    assert "| `heartbeat_s` | integer | `30` | >= 1; <= 86400 |" in text


def test_the_checked_in_schema_is_current_and_the_example_fleet_names_it() -> None:
    checked_in = (EXAMPLE_FLEET / SCHEMA_FILE).read_text()
    assert checked_in == fabric_schema(), f"hosts/{SCHEMA_FILE} is stale: regenerate it with `{REGENERATE_SCHEMA}`"
    assert checked_in == schema_json(json.loads(checked_in))
    assert FLEET_FILE.read_text().splitlines()[0] == f"#:schema ./{SCHEMA_FILE}"


def test_fabric_schema_validates_the_example_fleet() -> None:
    schema = json.loads(fabric_schema())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(tomllib.loads(FLEET_FILE.read_text()), schema, cls=jsonschema.Draft202012Validator)


def test_fabric_schema_host_file_validates_every_example_host() -> None:
    schema = json.loads(fabric_schema("--host-file"))
    jsonschema.Draft202012Validator.check_schema(schema)
    hosts = sorted(p for p in EXAMPLE_FLEET.glob("*.toml") if p.name != "fabric.toml")
    assert len(hosts) >= 5
    for path in hosts:
        jsonschema.validate(tomllib.loads(path.read_text()), schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d["timing"].update(heartbeat_s="30"), ["timing", "heartbeat_s"]),  # no conversion between types
        (lambda d: d["timing"].update(heartbeat_sec=30), ["timing"]),  # an unknown key (a typo)
        (lambda d: d["backends"][0].update(rank=-1), ["backends", 0, "rank"]),
        (lambda d: d["fleet"].update(name="Not A Name"), ["fleet", "name"]),
        (lambda d: d["registry"].update(backend="consul"), ["registry", "backend"]),
    ],
)
def test_the_schema_refuses_what_fabric_validate_refuses(edit, path: list[object]) -> None:
    schema = json.loads(fabric_schema())
    data = tomllib.loads(FLEET_FILE.read_text())
    edit(data)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(data))
    assert [list(e.absolute_path) for e in errors] == [path]


def test_the_reference_page_is_linked_from_the_desired_state_page() -> None:
    assert "(reference.md)" in (REPO / "docs" / "desired-state.md").read_text()


def test_no_reference_cell_is_an_html_tag() -> None:
    for line in reference_markdown().splitlines():
        if line.startswith("| `"):
            cells = line.split(" | ")
            assert not re.search(r"<[A-Za-z/!?]", cells[-1]), line
    assert Path(REPO / "docs" / "reference.md").is_file()
