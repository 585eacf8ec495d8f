"""One etcd client and one lane queue per `fabric reconcile` process (reconciler.adapters.pass_connections).

x86-spill of the example fleet (tests/support/memo_sandbox.py's Sandbox:
`fabric reconcile --no-activate` in one process), a compute lane's host: its
heartbeats count its lane's jobs on phaze's broker. Its fabric.toml's
[registry] is a private prefix of this module's etcd member (a real one),
its [phaze] queue_url_file holds a real PostgreSQL's DSN. Each pass process
(the first, full; one whose memo check finds a new epoch, and the full pass
after it; a memo hit) builds one EtcdRegistry and one PostgresLaneBroker and
closes each once. The unit tests (tests/unit/test_pass_connections.py)
count the sqlite file's connections and show that a failed one is not reused.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest

from reconciler.adapters.lane_broker_pg import PostgresLaneBroker
from reconciler.adapters.registry_etcd import EtcdRegistry
from tests.support.cli import fabric
from tests.support.harness.etcd import EtcdCluster
from tests.support.harness.postgres import broker_url_file, naming_broker
from tests.support.memo_sandbox import Sandbox, audit_on_stderr, memoized, new_term_without_a_plan

pytestmark = pytest.mark.integration

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here too


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many etcd clients and lane queues were built and closed."""
    seen: Counter[str] = Counter()
    for cls, name in ((EtcdRegistry, "etcd"), (PostgresLaneBroker, "lane queue")):
        init, close = cls.__init__, cls.close

        def counted_init(self, *args, _init=init, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            _init(self, *args, **kwargs)
            seen[f"{_name} opened"] += 1

        def counted_close(self, _close=close, _name=name):  # type: ignore[no-untyped-def]
            seen[f"{_name} closed"] += 1
            _close(self)

        monkeypatch.setattr(cls, "__init__", counted_init)
        monkeypatch.setattr(cls, "close", counted_close)
    return seen


def test_a_lane_host_s_pass_opens_the_registry_and_the_broker_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, broker_dsn: str, counted: Counter[str]
) -> None:
    spill = Sandbox(tmp_path, host="x86-spill")
    url_file = broker_url_file(tmp_path, broker_dsn)
    fleet_file = spill.desired / "fabric.toml"
    text = fleet_file.read_text().split("[[plan_keys]]")[0]
    text = naming_broker(text, url_file)
    endpoints = ", ".join(f'"{e}"' for e in etcd.endpoints)
    registry = f'[registry]\nbackend = "etcd"\nendpoints = [{endpoints}]\nprefix = "/t{uuid.uuid4().hex[:12]}"\n'
    fleet_file.write_text(re.sub(r"(?ms)^\[registry\]\n.*?(?=^\[)", registry + "\n", text, count=1))

    def one_pass(memo: bool) -> None:
        counted.clear()
        code, _, err = fabric(capsys, *spill.argv())
        assert code == 0 and memoized(err) == memo, err
        assert "heartbeat: x86-spill" in err, err
        assert counted == {"etcd opened": 1, "etcd closed": 1, "lane queue opened": 1, "lane queue closed": 1}, counted

    one_pass(memo=False)  # the first beat and plan read, the beat after activation
    one_pass(memo=True)
    from reconciler.core.desired.load import load_desired
    from reconciler.wiring import open_registry

    # The epoch moves on: the memo's check makes way for a full pass.
    with closing(open_registry(load_desired(spill.desired).fleet)) as leader:
        new_term_without_a_plan(leader)
    one_pass(memo=False)
    one_pass(memo=True)
