"""What a pass imports on its way to activation, and after it: the cost a new plan's passes pay before they act.

Each test runs whole `fabric reconcile --no-activate` processes into a
sandbox root (tests/support/memo_sandbox.py's Sandbox: the example fleet, a
recorded probe, the sqlite registry under the root), in a child interpreter
that notes sys.modules when the pass enters the applier (`Applier.run`,
where activation starts; a memo hit never gets there) and when it ends.
The memo hit's own contracts (no model, no template) are in test_pass_memo.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.memo_sandbox import Sandbox
from tests.support.pass_imports import loaded, one_pass


@pytest.mark.parametrize("host", ["racknerd", "a1-arm64"])
def test_the_pass_of_a_host_that_may_not_lead_imports_nothing_of_the_leader(tmp_path: Path, host: str) -> None:
    """racknerd (the edge) and a1-arm64 (a compute lane's host) are no leader
    candidates: their pass never takes a leader step, so neither the leader's
    loop nor the dispatcher nor the scaling step is imported, first pass or full one."""
    s = Sandbox(tmp_path, host=host)
    leader = ("reconciler.engine.leader", "reconciler.engine.dispatch", "reconciler.engine.scaling_step")
    first = one_pass(s)
    assert first.at_activation is not None, first.stderr
    assert loaded(first.at_end, *leader) == []


@pytest.mark.parametrize("host", ["racknerd", "a1-arm64"])
def test_a_full_pass_imports_the_records_views_only_once_it_has_activated(tmp_path: Path, host: str) -> None:
    """The metrics textfile, the edge's status page and the fleet view's
    reader are written and read after activation: their modules are imported
    then (and are, every pass writes its metrics), not on the way to it."""
    s = Sandbox(tmp_path, host=host)
    after = ("reconciler.core.views", "reconciler.engine.status")
    full = one_pass(s)
    assert full.at_activation is not None, full.stderr
    assert loaded(full.at_activation, *after) == []
    # Every pass writes its metrics; the edge also reads the fleet's view for its page.
    assert loaded(full.at_end, *after) == (list(after) if host == "racknerd" else ["reconciler.core.views"])


def test_a_lane_hosts_pass_imports_no_saq_to_read_its_lanes(tmp_path: Path) -> None:
    """a1-arm64 runs a compute lane's jobs: its heartbeat counts them on
    phaze's broker (here one that refuses connections: a real broker is
    tests/integration/test_pass_memo_lanes.py's). Reading lanes is plain SQL:
    neither saq nor what saq's worker imports (croniter, dateutil) nor
    psycopg's pool is imported, though the lane queue is."""
    import socket

    s = Sandbox(tmp_path, host="a1-arm64")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        url_file = tmp_path / "queue_url"
        url_file.write_text(f"postgresql://postgres@127.0.0.1:{closed.getsockname()[1]}/phaze\n")
        url_file.chmod(0o600)  # a secret: refused unless private
        fleet_file = s.desired / "fabric.toml"
        fleet_file.write_text(fleet_file.read_text().replace("[phaze]\n", f'[phaze]\nqueue_url_file = "{url_file}"\n', 1))
        full = one_pass(s)
    assert "note: lane queue: phaze's broker:" in full.stderr, full.stderr
    assert loaded(full.at_end, "reconciler.adapters.lane_broker_pg", "psycopg") == ["psycopg", "reconciler.adapters.lane_broker_pg"]
    assert loaded(full.at_end, "saq", "croniter", "dateutil", "psycopg_pool") == []


CADDY = """
import socket, sys
from reconciler.adapters.caddy import CaddyAdmin
from reconciler.ports import ActivationError

http = ("http.client", "urllib.request", "email")
with socket.socket() as closed:
    closed.bind(("127.0.0.1", 0))  # bound, never listening: the admin API is not there
    caddy = CaddyAdmin(None, admin_address=f"127.0.0.1:{closed.getsockname()[1]}", timeout=5)
    print(sorted(m for m in http if m in sys.modules))
    try:
        caddy.current_config()
    except ActivationError as exc:
        print(exc)
print(sorted(m for m in http if m in sys.modules))
"""


def test_the_caddy_adapter_imports_no_http_client_until_it_talks_to_caddy() -> None:
    """Every activating pass builds the Caddy adapter (validate runs `caddy
    validate`); only a pass that loads a new snippet talks to the admin API,
    over http.client, imported then (urllib.request is not needed at all)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", CADDY], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    before, reached, after = done.stdout.splitlines()
    assert before == "[]"
    assert "caddy read config: cannot reach the admin API at 127.0.0.1:" in reached and "Connection refused" in reached, reached
    assert after == "['email', 'http.client']"


class LiveSandbox(Sandbox):
    """The sandbox's passes probing this machine live (no --replay)."""

    def argv(self, *extra: str) -> list[str]:
        argv = super().argv(*extra)
        at = argv.index("--replay")
        return argv[:at] + argv[at + 2 :]


@pytest.mark.parametrize("probe", ["replayed", "live"])
def test_a_memo_hit_imports_no_protocol_no_importlib_metadata_and_no_openssl(tmp_path: Path, probe: str) -> None:
    """A memo hit of the checkout (a source tree: the version is pyproject.toml's)
    with the sqlite registry catches the registry's errors from
    reconciler.port_errors, not the ports' Protocols, and reads its version
    without importlib.metadata. With a replayed probe it runs no program at
    all, so subprocess is not imported either (the live probe's runner
    imports it when a program is there to run: tailscale, nvidia-smi, or
    lspci and the others when their inputs changed)."""
    s = (Sandbox if probe == "replayed" else LiveSandbox)(tmp_path, host="racknerd")
    first = one_pass(s)
    assert first.at_activation is not None, first.stderr
    hit = one_pass(s)
    # The pass ended well without entering the applier: the memo's (its audit line may be in the journal).
    assert hit.at_activation is None, hit.stderr
    assert loaded(hit.at_end, "reconciler.ports", "importlib.metadata") == []
    # Its sha256 (the key, the files' hashes, the probe's stamps) is CPython's own: no OpenSSL.
    assert loaded(hit.at_end, "hashlib", "_hashlib") == []
    if probe == "replayed":
        assert loaded(hit.at_end, "subprocess") == []
