"""The metrics textfile against the real tools: promtool's linter, and node_exporter's
textfile collector reading it from `<root>/var/lib/node_exporter/textfile/` and
serving it on loopback, as Prometheus would scrape it.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import FleetPlan, Snapshot
from reconciler.core.pass_files import TEXTFILE_PATH
from reconciler.core.views.metrics import PassMetrics, render_metrics
from tests.conftest import EXAMPLE_FLEET, REPO, require
from tests.support.harness.caddy import free_port
from tests.support.harness.waiting import stop_process, wait_until

pytestmark = pytest.mark.integration

FIXTURES = REPO / "tests" / "fixtures" / "status"
NOW = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)


@pytest.fixture(scope="module")
def textfile() -> str:
    desired = load_desired(EXAMPLE_FLEET)
    snapshot = Snapshot.model_validate_json((FIXTURES / "snapshot.json").read_text())
    plan = FleetPlan.model_validate_json((FIXTURES / "plan.json").read_text())
    stats = PassMetrics(duration_s=1.25, succeeded=True, last_success=NOW, generation=12, plan_epoch=7, rollbacks_total=2)
    return render_metrics(stats, desired, snapshot, plan)


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    require("promtool")
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


def test_promtool_finds_no_problem(textfile):
    result = promtool_check(textfile)

    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_promtool_is_strict_enough_to_catch_a_misnamed_counter(textfile):
    # The check above can fail: the same file with a counter not ending in _total is linted.
    result = promtool_check(textfile.replace("fabric_rollbacks_total", "fabric_rollbacks"))

    assert result.returncode != 0
    assert "fabric_rollbacks" in result.stdout + result.stderr


@dataclass
class NodeExporter:
    textfile_dir: Path
    url: str

    def write(self, name: str, text: str) -> None:
        """Atomically, as the apply step must: the collector may read at any instant."""
        temp = self.textfile_dir / f".{name}.tmp"
        temp.write_text(text)
        os.replace(temp, self.textfile_dir / name)

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as response:
            return response.read().decode()


@pytest.fixture
def node_exporter(tmp_path: Path) -> Iterator[NodeExporter]:
    require("prometheus-node-exporter")
    textfile_dir = tmp_path / "root" / TEXTFILE_PATH.rsplit("/", 1)[0]
    textfile_dir.mkdir(parents=True)
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "node_exporter.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                "prometheus-node-exporter",
                f"--web.listen-address={address}",
                "--collector.disable-defaults",
                "--collector.textfile",
                f"--collector.textfile.directory={textfile_dir}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        exporter = NodeExporter(textfile_dir, f"http://{address}/metrics")

        def serving() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"node_exporter exited {process.returncode}: {log.read_text()[-2000:]}")
            try:
                exporter.scrape()
                return True
            except OSError:
                return False

        wait_until(serving, what="node_exporter's /metrics")
        yield exporter
    finally:
        stop_process(process)


def test_node_exporter_serves_the_textfile(node_exporter, textfile):
    node_exporter.write(TEXTFILE_PATH.rsplit("/", 1)[1], textfile)

    scraped = node_exporter.scrape().splitlines()

    assert "node_textfile_scrape_error 0" in scraped
    assert 'fabric_lane_up{kind="compute",lane="x86-spill"} 0' in scraped
    assert 'fabric_lane_in_flight{kind="compute",lane="a1-arm64"} 1' in scraped
    assert 'fabric_node_status{node="qfox-1",status="not_reporting"} 1' in scraped
    assert "fabric_rollbacks_total 2" in scraped
    assert "fabric_plan_epoch 7" in scraped


def test_node_exporter_flags_a_file_it_cannot_read(node_exporter, textfile):
    # The collector's own error gauge is what the test above relies on: show it moves.
    node_exporter.write("fabric.prom", textfile.replace("fabric_generation 12.0\n", "fabric_generation 12.0 1795977000000\n"))

    assert "node_textfile_scrape_error 1" in node_exporter.scrape().splitlines()
