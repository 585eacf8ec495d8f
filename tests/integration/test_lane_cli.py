"""`fabric lane` end to end in one process: a real sqlite registry file, phaze's broker on a real PostgreSQL, real SAQ workers.

The DSN is written to a file (mode 0600) and named by `--queue-url-file`,
as [phaze] queue_url_file names it on a real fleet.
"""

from __future__ import annotations

import json

import psycopg
import pytest

from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET
from tests.support.cli import fabric
from tests.support.harness.own_lanes import OWN_A1, OWN_LOCAL, OWN_X86, own_lanes_fleet
from tests.support.harness.postgres import broker_url_file
from tests.support.harness.saq_workers import LaneWorkers, enqueue_as_phaze, phaze_payload
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.registry_store import beat_example_fleet

pytestmark = pytest.mark.integration

A1, X86, LOCAL = OWN_A1, OWN_X86, OWN_LOCAL


@pytest.fixture
def lane(tmp_path, capsys, broker_dsn):
    dsn = broker_dsn
    url_file = broker_url_file(tmp_path, dsn + "\n")  # the line's end is stripped
    registry = tmp_path / "registry.sqlite"
    fleet = own_lanes_fleet(tmp_path / "fleet")  # the example fleet is phaze's: phaze dispatches there
    # Every example host beats (a lane is as healthy as its agent host).
    store = open_registry(load_desired(fleet).fleet, sqlite_path=registry)
    try:
        beat_example_fleet(store)
    finally:
        store.close()
    workers = LaneWorkers(dsn)

    def run(*argv: str) -> tuple[int, str, str]:
        return fabric(capsys, "lane", *argv, "--desired", str(fleet), "--registry-path", str(registry), "--queue-url-file", str(url_file))

    run.dsn = dsn
    run.workers = workers
    try:
        yield run
    finally:
        workers.close()


def test_enqueue_dispatch_status_and_the_workers_finish_jobs(lane):
    for queue in (A1, X86, LOCAL):
        lane.workers.start(queue)
    assert lane("enqueue", *[f"job-{i}" for i in range(8)])[0] == 0
    assert lane("enqueue", "short", "--duration", "30")[0] == 0
    status, out, _ = lane("dispatch", "--once", "--json")
    assert status == 0
    events = {e["job"]: e["lane"] or e["hold"] for e in map(json.loads, out.splitlines())}
    assert events == {
        "job-0": "a1-arm64",
        "job-1": "a1-arm64",
        **{f"job-{i}": "x86-spill" for i in range(2, 6)},
        "job-6": "local_spill_not_reached",
        "job-7": "local_spill_not_reached",
        "short": "local",
    }

    status, out, _ = lane("status", "--json")
    document = json.loads(out)
    assert [(v["id"], v["kind"], v["rank"], v["cap"], v["in_flight"], v["queue"], v["online"]) for v in document["lanes"]] == [
        ("a1-arm64", "compute", 10, 2, 2, A1, True),
        ("x86-spill", "compute", 20, 4, 4, X86, True),
        ("local", "local", 99, 1, 1, LOCAL, True),
    ]
    assert [v["hold"] for v in document["lanes"]] == [f"full: 2/2 jobs in {A1}", f"full: 4/4 jobs in {X86}", "full: 1/1 jobs in phaze-local"]
    assert document["new_job"] == {"lane": None, "hold": "no_free_slots"}
    assert document["queue_depth"] == 2
    _, text, _ = lane("status")
    assert "waiting job-6" in text and "held: no_free_slots: every lane it may use is full or offline" in text  # local is full too (short)

    wait_until(lambda: "job-0" in lane.workers.running(), timeout=deadline_for(1), what="a1's worker runs job-0")
    lane.workers.finish("job-0", ok=False)
    lane.workers.finish("job-1")
    wait_until(lambda: _unfinished(lane.dsn).get(A1, 0) == 0, timeout=deadline_for(1), what="SAQ ended both a1 jobs")
    _, out, _ = lane("dispatch", "--once")
    lines = out.splitlines()
    assert "job-0 failed in a1-arm64: waiting again (attempts 1)" in lines
    assert "job-1 done in a1-arm64" in lines
    assert any(line.startswith("job-0 -> a1-arm64") for line in lines), lines


def _unfinished(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT queue, count(*) FROM saq_jobs WHERE status IN ('queued', 'active') GROUP BY queue").fetchall())


def test_bad_input_exits_2_and_writes_nothing_and_an_unreadable_url_file_exits_1(lane, tmp_path):
    status, _, err = lane("enqueue", "ok-job", "Not/A/Job")
    assert status == 2 and "'Not/A/Job' is not a job id" in err
    with psycopg.connect(lane.dsn) as conn:
        assert conn.execute("SELECT to_regclass('fabric_lane_jobs')").fetchone()[0] is None, "nothing was even opened"
    with pytest.raises(SystemExit) as exit_info:
        lane("enqueue", "j1", "--duration", "-5")
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        lane("status", "--duration", "5")
    assert exit_info.value.code == 2
    missing = tmp_path / "nowhere"
    status = main(
        ["lane", "status", "--desired", str(EXAMPLE_FLEET), "--registry-path", str(tmp_path / "r.sqlite"), "--queue-url-file", str(missing)]
    )
    assert status == 1


def test_in_a_phaze_fleet_enqueue_and_dispatch_refuse_and_write_nothing(lane, tmp_path, capsys):
    """The example fleet names phaze's agent API ([phaze] api_url): phaze's
    control plane dispatches into its phaze-agent-* queues, so the fabric
    enqueues and dispatches nothing there (exit 2, the broker not even opened)."""
    url_file = broker_url_file(tmp_path, lane.dsn)
    for argv in (["enqueue", "job-1"], ["dispatch", "--once"], ["dispatch"]):
        status = main(
            ["lane", *argv, "--desired", str(EXAMPLE_FLEET), "--registry-path", str(tmp_path / "r.sqlite"), "--queue-url-file", str(url_file)]
        )
        err = capsys.readouterr().err
        assert status == 2, argv
        assert err.startswith(f"fabric lane {argv[0]}: {EXAMPLE_FLEET}/fabric.toml: phaze.api_url: this is a phaze fleet"), err
        assert "phaze-agent-* queues" in err, err
    with psycopg.connect(lane.dsn) as conn:
        assert conn.execute("SELECT to_regclass('fabric_lane_jobs')").fetchone()[0] is None
        assert conn.execute("SELECT to_regclass('saq_jobs')").fetchone()[0] is None, "no SAQ queue written"


def test_in_a_phaze_fleet_lane_status_reads_each_lanes_real_queue(lane, tmp_path, capsys):
    """The example fleet is phaze's: a compute lane's queue is phaze's
    phaze-agent-<agent_ref>-analyze. Its in_flight is the jobs phaze put there
    (queued or active), its workers the SAQ workers beating there; a lane
    whose agent beats on no such queue is offline and says where it looked.
    The fabric itself writes nothing to the broker's queues."""
    a1 = "phaze-agent-a1-arm64-analyze"
    lane.workers.start(a1, concurrency=1)
    enqueue_as_phaze(lane.dsn, a1, [phaze_payload(f"0000000{i}-0000-4000-8000-000000000000", "a1-arm64") for i in (1, 2)])
    wait_until(lambda: len(lane.workers.running()) == 1, timeout=deadline_for(1), what="a1's agent runs one of phaze's jobs")
    url_file = broker_url_file(tmp_path, lane.dsn)
    argv = [
        "lane",
        "status",
        "--desired",
        str(EXAMPLE_FLEET),
        "--registry-path",
        str(tmp_path / "registry.sqlite"),
        "--queue-url-file",
        str(url_file),
    ]
    assert main([*argv, "--json"]) == 0
    lanes = {v["id"]: v for v in json.loads(capsys.readouterr().out)["lanes"]}
    assert (lanes["a1-arm64"]["queue"], lanes["a1-arm64"]["in_flight"], lanes["a1-arm64"]["cap"], lanes["a1-arm64"]["workers"]) == (a1, 2, 2, 1)
    assert lanes["a1-arm64"]["online"] and lanes["a1-arm64"]["full"] == "cap"
    x86 = lanes["x86-spill"]
    assert (x86["queue"], x86["in_flight"], x86["workers"], x86["online"]) == ("phaze-agent-x86-spill-analyze", 0, 0, False)
    assert x86["reason"].startswith("no SAQ worker on phaze-agent-x86-spill-analyze"), x86["reason"]
    assert main(argv) == 0
    assert f"2/2  {a1} (1 worker)  FULL: lane cap" in capsys.readouterr().out
    with psycopg.connect(lane.dsn) as conn:
        keys = sorted(key for (key,) in conn.execute("SELECT key FROM saq_jobs").fetchall())
    assert all(key.startswith("process_file:") for key in keys) and len(keys) == 2, keys
