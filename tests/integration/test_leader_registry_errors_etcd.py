"""`fabric leader run` survives a plan the registry refuses, and says why (issue 34, item 3).

A real `fabric leader run` process (signed plans, the example fleet) over a
real etcd member whose request limit is lowered (`--max-request-bytes`) below
the size of the plan the leader makes, so etcd itself refuses every publish
with its own error. The leader must stay up, keep its term (the registry's
term does not change while it retries), say in its journal what failed and
that it retries, and write the problem into its record: `fabric leader`
and `fabric status --json` show it. SIGTERM ends it with exit 0 (it resigns).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, require
from tests.support.harness.etcd import EtcdCluster, etcd_cluster
from tests.support.harness.waiting import deadline_for, wait_until
from tests.support.plan_keys import signed_example_fleet

pytestmark = pytest.mark.integration

FABRIC = [sys.executable, "-m", "reconciler"]
EXAMPLE_REGISTRY = 'backend = "sqlite"        # embedded default; "etcd" for the fleet\npath = "/var/lib/fabric/registry.sqlite"'
# Above every request of a campaign, a renewal (with the problem's text), the
# plan's index and a read; below the transaction of the example fleet's plan
# parts (its lanes' part and its deferred replicas' part: about 1.7 KB).
REQUEST_LIMIT = 1280
LEASE_TTL_S = 3.0


@pytest.fixture(scope="module")
def small_etcd() -> Iterator[EtcdCluster]:
    require("etcd")
    with etcd_cluster(members=1, extra_args=("--max-request-bytes", str(REQUEST_LIMIT))) as cluster:
        yield cluster


def run_cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FABRIC, *argv], env=env, capture_output=True, text=True, timeout=60)


def test_a_refused_plan_leaves_the_leader_up_in_its_term_saying_why(tmp_path: Path, small_etcd: EtcdCluster) -> None:
    signed = signed_example_fleet(tmp_path)
    desired = signed.desired
    text = (desired / "fabric.toml").read_text()
    assert EXAMPLE_REGISTRY in text
    endpoints = ", ".join(f'"{e}"' for e in small_etcd.endpoints)
    (desired / "fabric.toml").write_text(
        text.replace(EXAMPLE_REGISTRY, f'backend = "etcd"\nendpoints = [{endpoints}]\nprefix = "/t{uuid.uuid4().hex[:12]}"')
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FABRIC_REGISTRY", None)
    log = tmp_path / "leader.log"
    argv = [
        "leader",
        "run",
        "--host",
        "lux",
        "--lease-ttl",
        str(LEASE_TTL_S),
        "--plan-key-file",
        str(signed.key_file("lux")),
        "--desired",
        str(desired),
    ]
    with open(log, "w") as out:
        leader = subprocess.Popen([*FABRIC, *argv], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def said(needle: str) -> bool:
            assert leader.poll() is None, f"the leader died (exit {leader.returncode}):\n{log.read_text()}"
            return needle in log.read_text()

        timeout = deadline_for(LEASE_TTL_S * 4, at_least=30)
        wait_until(lambda: said("registry error (RegistryError, attempt 1"), timeout=timeout, what="the first failed publish said")
        first = json.loads(run_cli(env, "leader", "--json", "--desired", str(desired)).stdout)
        wait_until(lambda: said("registry error (RegistryError, attempt 4"), timeout=timeout, what="four failed publishes said")
        shown = json.loads(run_cli(env, "leader", "--json", "--desired", str(desired)).stdout)
        journal = log.read_text()
        assert "request is too large" in journal, journal
        assert "keeping term" in journal and "retrying in" in journal, journal
        assert "Traceback" not in journal, journal
        assert shown["leader"] == "lux" and shown["term"] == first["term"], "the same term all along"
        assert shown["plan_epoch"] is None, "nothing was published"
        problem = shown["problem"]
        assert problem is not None and problem["kind"] == "RegistryError" and "request is too large" in problem["what"], shown
        status = run_cli(env, "status", "--json", "--desired", str(desired))
        assert status.returncode == 0, status.stderr
        document = json.loads(status.stdout)
        assert document["leader_problem"]["kind"] == "RegistryError", document["leader_problem"]
        human = run_cli(env, "status", "--desired", str(desired)).stdout
        assert "LEADER FAILING · it keeps its term and retries: RegistryError since" in human, human
    finally:
        if leader.poll() is None:
            leader.send_signal(signal.SIGTERM)
        try:
            leader.wait(timeout=30)
        except subprocess.TimeoutExpired:
            leader.kill()
            leader.wait(timeout=30)
    assert leader.returncode == 0, log.read_text()
    assert "lux resigned" in log.read_text()
