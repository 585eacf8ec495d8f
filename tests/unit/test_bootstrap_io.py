"""reconciler.adapters.bootstrap_io against a real sqlite registry and a scripted
command runner: what the adapter observes and what each step does."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from reconciler.adapters.bootstrap_io import NodeIO
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts
from reconciler.core.install.bootstrap import NFT_FIX_COMMENT, NFT_FIX_FILE, Step
from reconciler.core.live.records import NodeRecord
from reconciler.ports import BootstrapError, CommandResult
from reconciler.wiring import open_registry
from tests.conftest import EXAMPLE_FLEET

STATE = load_desired(EXAMPLE_FLEET)


class ScriptedRunner:
    """Answers by argv prefix; records every command."""

    def __init__(self, answers: dict[tuple[str, ...], CommandResult]) -> None:
        self.answers = answers
        self.ran: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        self.ran.append(argv)
        for prefix, result in self.answers.items():
            if argv[: len(prefix)] == prefix:
                return CommandResult(argv, result.returncode, result.stdout, result.stderr, result.missing)
        return CommandResult(argv, 1, "", "unknown")


def ok(stdout: str = "") -> CommandResult:
    return CommandResult((), 0, stdout)


@pytest.fixture
def registry(tmp_path: Path):
    reg = open_registry(STATE.fleet, sqlite_path=tmp_path / "registry.sqlite")
    yield reg
    reg.close()


def test_observe_reads_tailscale_registry_files_nft_and_units(tmp_path: Path, registry) -> None:
    (tmp_path / "etc" / "fabric").mkdir(parents=True)
    (tmp_path / NFT_FIX_FILE).write_text("old\n")
    runner = ScriptedRunner(
        {
            ("tailscale", "status"): ok('{"BackendState": "Running"}'),
            ("nft", "list", "table", "inet", "filter"): ok(
                f'table inet filter {{ chain forward {{ iifname "tailscale0" accept comment "{NFT_FIX_COMMENT}" }} }}'
            ),
            ("systemctl", "is-active", "--quiet", "fabric-reconcile.timer"): ok(),
        }
    )
    observed = NodeIO(runner, registry, root=tmp_path).observe("racknerd", [NFT_FIX_FILE, "etc/absent"], ["fabric-socat-qfox-ssh.service"])
    assert observed.tailscale_running is True
    assert observed.registered is False
    assert observed.files == {NFT_FIX_FILE: "old\n", "etc/absent": None}
    assert observed.distro_table_present and observed.nft_fix_loaded
    assert observed.timer_active is True
    assert observed.socat_active == {"fabric-socat-qfox-ssh.service": False}


def test_tailscale_missing_or_stopped(tmp_path: Path, registry) -> None:
    missing = ScriptedRunner({("tailscale",): CommandResult((), None, missing=True)})
    assert NodeIO(missing, registry, root=tmp_path).observe("racknerd", [], []).tailscale_running is None
    stopped = ScriptedRunner({("tailscale",): ok('{"BackendState": "NeedsLogin"}')})
    assert NodeIO(stopped, registry, root=tmp_path).observe("racknerd", [], []).tailscale_running is False


def test_register_writes_a_heartbeat_the_next_observation_sees(tmp_path: Path, registry) -> None:
    io = NodeIO(ScriptedRunner({}), registry, root=tmp_path)
    facts = HostFacts(node_id="racknerd.ts.net", k3s_hostname="racknerd", hardware=Hardware(arch="x86_64"), tier="relay")
    io.execute(Step("register", "new", record=NodeRecord.from_facts("racknerd", facts)))
    assert io.observe("racknerd", [], []).registered is True


def test_write_file_is_atomic_under_the_root(tmp_path: Path, registry) -> None:
    io = NodeIO(ScriptedRunner({}), registry, root=tmp_path)
    io.execute(Step("write_file", "k3s", path="etc/rancher/k3s/config.yaml.d/10-fabric-join.yaml", content="server: x\n"))
    target = tmp_path / "etc/rancher/k3s/config.yaml.d/10-fabric-join.yaml"
    assert target.read_text() == "server: x\n"
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp file left


def test_commands_of_each_step_and_their_failure(tmp_path: Path, registry) -> None:
    runner = ScriptedRunner({("systemctl",): ok(), ("nft",): ok(), ("tailscale", "up"): CommandResult((), 1, "", "invalid key")})
    io = NodeIO(runner, registry, root=tmp_path)
    io.execute(Step("load_nft_fix", "x"))
    io.execute(Step("daemon_reload", "x"))
    io.execute(Step("enable_timer", "x"))
    io.execute(Step("run_pass", "x"))
    assert runner.ran == [
        ("nft", "-f", str(tmp_path / NFT_FIX_FILE)),
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", "--now", "fabric-reconcile.timer"),
        ("systemctl", "start", "fabric-reconcile.service"),
    ]
    with pytest.raises(BootstrapError, match="tailscale up: tailscale: exit 1: invalid key"):
        io.execute(Step("tailscale_up", "x", argv=("tailscale", "up", "--auth-key=file:/k")))


class FakeNodeApi:
    """The k3s Node as its kubelet sees it: Ready after `ready_after` asks, or never."""

    def __init__(self, ready_after: int | None, down: str | None = None) -> None:
        self.ready_after = ready_after
        self.down = down
        self.asked = 0

    def ready(self, node: str) -> bool:
        self.asked += 1
        if self.down:
            from reconciler.ports import NodeLabelsUnavailable

            raise NodeLabelsUnavailable(self.down)
        return self.ready_after is not None and self.asked > self.ready_after


def test_observe_tells_a_k3s_server_from_an_installed_agent_and_asks_whether_the_node_is_ready(tmp_path: Path, registry) -> None:
    runner = ScriptedRunner(
        {
            ("systemctl", "cat", "k3s-agent.service"): ok("[Service]\nExecStart=/usr/local/bin/k3s agent\n"),
            ("systemctl", "is-active", "--quiet", "k3s-agent.service"): ok(),
        }
    )
    api = FakeNodeApi(ready_after=0)
    observed = NodeIO(runner, registry, tmp_path, node_api=api).observe("racknerd", [], [], k3s_node="racknerd")
    assert (observed.k3s_server, observed.k3s_agent_installed, observed.k3s_agent_active, observed.k3s_node_ready) == (False, True, True, True)
    server = ScriptedRunner({("systemctl", "is-enabled", "--quiet", "k3s.service"): ok()})
    assert NodeIO(server, registry, tmp_path).observe("racknerd", [], []).k3s_server is True


def test_the_agent_is_restarted_and_its_node_waited_for_until_ready(tmp_path: Path, registry, monkeypatch) -> None:
    import reconciler.adapters.bootstrap_io as bootstrap_io

    monkeypatch.setattr(bootstrap_io, "K3S_READY_POLL_S", 0.0)
    runner = ScriptedRunner({("systemctl", "restart", "k3s-agent.service"): ok()})
    api = FakeNodeApi(ready_after=3)
    io = NodeIO(runner, registry, tmp_path, node_api=api)
    io.execute(Step("restart_k3s_agent", "to read the join settings"))
    io.execute(Step("wait_k3s_node", "until the Node racknerd is Ready", node="racknerd"))
    assert ("systemctl", "restart", "k3s-agent.service") in runner.ran
    assert api.asked == 4


def test_a_node_that_never_gets_ready_fails_the_bootstrap_with_the_last_answer(tmp_path: Path, registry, monkeypatch) -> None:
    import reconciler.adapters.bootstrap_io as bootstrap_io

    monkeypatch.setattr(bootstrap_io, "K3S_READY_POLL_S", 0.0)
    api = FakeNodeApi(ready_after=None, down="https://127.0.0.1:6444: ConnectionRefusedError")
    io = NodeIO(ScriptedRunner({}), registry, tmp_path, node_api=api, ready_timeout_s=0.0)
    with pytest.raises(BootstrapError, match="not Ready after 0 s: https://127.0.0.1:6444: ConnectionRefusedError"):
        io.execute(Step("wait_k3s_node", "until the Node racknerd is Ready", node="racknerd"))
