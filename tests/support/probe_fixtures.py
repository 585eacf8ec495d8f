"""The recorded probes under tests/fixtures/probe/: one directory a machine, its
raw files under the fixed capture names, optionally errors.json (why an absent
file is absent) and expected.json (the whole HostFacts the probe must derive;
tests/unit/test_probe_fixtures.py says how to add one)."""

from __future__ import annotations

import json

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.probe.facts import ERRORS_FILE, RAW_NAMES
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "probe"
MACHINES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
EXPECTED = "expected.json"


def load_capture(machine: str) -> RawCapture:
    directory = FIXTURES / machine
    outputs = {name: (directory / name).read_text() for name in RAW_NAMES if (directory / name).is_file()}
    errors_path = directory / ERRORS_FILE
    errors = json.loads(errors_path.read_text()) if errors_path.is_file() else {}
    return RawCapture(outputs, errors)


def expected_facts(machine: str) -> dict:
    path = FIXTURES / machine / EXPECTED
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `fabric probe --replay {path.parent} --json > {path}` and review it line by line")
    return json.loads(path.read_text())


def fixture_facts(host: str) -> HostFacts:
    """The facts of `host`'s fixture, read as `fabric probe --replay` reads a capture."""
    outputs, errors = CaptureDirectory().load(str(FIXTURES / host))
    return facts_from_capture(RawCapture(outputs, errors), host=host)
