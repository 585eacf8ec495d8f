"""`fabric lane` end to end in one process against a real sqlite registry file."""

from __future__ import annotations

import json
import sqlite3

import pytest

from reconciler.cli import main
from reconciler.cli.wiring import open_registry
from reconciler.core.desired.load import load_desired
from tests.conftest import EXAMPLE_FLEET
from tests.integration.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration


@pytest.fixture
def lane(tmp_path, capsys):
    registry = tmp_path / "registry.sqlite"
    # Every example host beats (a lane is as healthy as its agent host).
    store = open_registry(load_desired(EXAMPLE_FLEET).fleet, sqlite_path=registry)
    try:
        beat_example_fleet(store)
    finally:
        store.close()

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(["lane", *argv, "--desired", str(EXAMPLE_FLEET), "--registry-path", str(registry)])
        out, err = capsys.readouterr()
        return status, out, err

    run.registry = registry
    return run


def test_enqueue_dispatch_status_done_and_fail(lane):
    assert lane("enqueue", *[f"job-{i}" for i in range(8)])[0] == 0
    status, out, _ = lane("dispatch", "--once", "--json")
    assert status == 0
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["backend"] or e["hold"] for e in events] == ["a1-arm64"] * 2 + ["x86-spill"] * 4 + ["local_spill_not_reached"] * 2

    status, out, _ = lane("status", "--json")
    document = json.loads(out)
    assert document["queue_depth"] == 2
    assert {v["id"]: v["in_flight"] for v in document["lanes"]} == {"a1-arm64": 2, "x86-spill": 4, "local": 0}
    assert [(w["job"], w["hold"]) for w in document["waiting"]] == [("job-6", "local_spill_not_reached"), ("job-7", "local_spill_not_reached")]
    assert [r["job"] for r in document["running"]] == [f"job-{i}" for i in range(6)]

    # Text status says why each waiting job is held.
    _, text, _ = lane("status")
    assert "waiting job-6" in text and "held: local_spill_not_reached: the cloud lanes are full" in text

    assert lane("fail", "job-0", "--json")[1].strip() == json.dumps({"job": "job-0", "lane": "a1-arm64", "requeued": True, "attempts": 1})
    assert lane("done", "job-1")[0] == 0
    _, out, _ = lane("dispatch", "--once")
    # The requeued job is the oldest: it goes first, to the freed cloud slots.
    assert out.splitlines()[0].startswith("job-0 -> a1-arm64") and out.splitlines()[1].startswith("job-6 -> a1-arm64")
    assert "job-7 held: local_spill_not_reached" in out


def test_bad_job_ids_exit_2_and_write_nothing_and_a_job_not_running_exits_1(lane):
    status, _, err = lane("enqueue", "ok-job", "Not/A/Job")
    assert status == 2 and "'Not/A/Job' is not a job id" in err
    if lane.registry.exists():
        assert sqlite3.connect(lane.registry).execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0
    assert lane("enqueue", "j1")[0] == 0
    status, _, err = lane("done", "j1")
    assert status == 1 and "j1 is not running" in err
    with pytest.raises(SystemExit) as exit_info:
        lane("done")
    assert exit_info.value.code == 2
