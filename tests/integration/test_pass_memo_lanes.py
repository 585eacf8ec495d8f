"""A memoized pass reads the lane jobs of its host afresh, from phaze's broker (a real PostgreSQL, a real SAQ worker).

x86-spill of the example fleet in a sandbox (tests/support/memo_sandbox.py's
Sandbox: `fabric reconcile --no-activate` in one process); its desired
state's [phaze] queue_url_file names a file holding the broker's DSN.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from reconciler.adapters.clock import SystemClock
from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.core.desired.load import load_desired
from reconciler.engine.lane_states import lane_targets
from reconciler.ports import DispatchFence
from tests.support.cli import fabric
from tests.support.harness.postgres import broker_url_file, naming_broker
from tests.support.harness.saq_workers import LaneWorkers
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.memo_sandbox import Sandbox, audit_on_stderr, memoized, new_registry_epoch, reported_in_flight
from tests.support.pass_imports import loaded, one_pass

pytestmark = pytest.mark.integration

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here too


def test_a_memoized_pass_reports_the_lane_jobs_running_now(tmp_path: Path, capsys: pytest.CaptureFixture[str], broker_dsn: str) -> None:
    """Lane jobs start and end without any drift: each memoized heartbeat reads them afresh."""
    spill = Sandbox(tmp_path, host="x86-spill")
    url_file = broker_url_file(tmp_path, broker_dsn)
    # The golden plan places flac-fft on x86-spill (published unsigned: the copy lists no plan keys).
    fleet_file = spill.desired / "fabric.toml"
    text = fleet_file.read_text().split("[[plan_keys]]")[0]
    fleet_file.write_text(naming_broker(text, url_file))
    new_registry_epoch(spill)
    code, _, err = fabric(capsys, *spill.argv())
    assert code == 0 and not memoized(err), err
    assert reported_in_flight(spill) == 1  # --no-activate: the one placement it runs

    targets = lane_targets(load_desired(spill.desired))
    lanes = PostgresLaneBroker(broker_dsn, SystemClock())
    workers = LaneWorkers(broker_dsn)
    try:
        workers.start(targets["x86-spill"].queue)  # phaze-agent-x86-spill-analyze, where phaze puts its jobs
        lanes.enqueue([("job-1", None), ("job-2", None)])
        assert lanes.dispatch("job-1", targets["x86-spill"], DispatchFence.fixed(1)) is not None
        assert lanes.dispatch("job-2", targets["a1-arm64"], DispatchFence.fixed(1)) is not None  # another host's lane
        code, _, err = fabric(capsys, *spill.argv())
        assert code == 0 and memoized(err), err
        assert "note: heartbeat: x86-spill tier relay, in_flight 2, alive for 90 s" in err
        assert reported_in_flight(spill) == 2

        wait_until(lambda: "job-1" in workers.running(), timeout=deadline_for(1), what="x86-spill's worker runs job-1")
        workers.finish("job-1")

        def done() -> bool:
            with psycopg.connect(broker_dsn) as conn:
                row = conn.execute("SELECT status FROM saq_jobs WHERE key LIKE 'job-1.%'").fetchone()
            return row is not None and row[0] == "complete"

        wait_until(done, timeout=deadline_for(1), what="SAQ completed job-1")
        code, _, err = fabric(capsys, *spill.argv())
        assert code == 0 and memoized(err), err
        assert reported_in_flight(spill) == 1
    finally:
        workers.close()
        lanes.close()


def test_a_lane_hosts_memo_hit_imports_no_model_and_its_passes_no_saq(tmp_path: Path, broker_dsn: str) -> None:
    """Whole `fabric reconcile` processes of x86-spill with a real broker
    (tests/support/pass_imports.py's child notes sys.modules): the memo
    names the lanes' queues and the broker, so a hit validates no fabric.toml
    (no pydantic, no core.desired) and reads the in_flight in plain SQL;
    no pass imports saq or what its worker needs (croniter, dateutil)."""
    spill = Sandbox(tmp_path, host="x86-spill")
    url_file = tmp_path / "queue_url"
    url_file.write_text(broker_dsn)
    url_file.chmod(0o600)
    fleet_file = spill.desired / "fabric.toml"
    fleet_file.write_text(fleet_file.read_text().replace("[phaze]\n", f'[phaze]\nqueue_url_file = "{url_file}"\n', 1))
    in_use = PostgresLaneBroker(broker_dsn, SystemClock())
    in_use.jobs()  # a broker in use: saq's tables are there (a first read would make them)
    in_use.close()
    saq = ("saq", "croniter", "dateutil", "psycopg_pool")
    full = one_pass(spill)
    assert full.at_activation is not None and "psycopg" in full.at_end, full.stderr
    assert loaded(full.at_end, *saq) == []
    hit = one_pass(spill)
    assert hit.at_activation is None and memoized(hit.stderr), hit.stderr
    assert "note: heartbeat: x86-spill tier relay, in_flight 0" in hit.stderr, hit.stderr
    assert "psycopg" in hit.at_end
    assert loaded(hit.at_end, *saq, "pydantic", "reconciler.core.desired") == []
