"""fabric bootstrap: the plan of a new node's missing steps (pure, with a fake node).

The fake node applies each step to its own state the way the real adapters
would change the machine, so "a second run changes nothing" is checked as the
planner sees it: plan, apply, plan again -> nothing to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.cli import main
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts, OperatingSystem
from reconciler.core.install.bootstrap import (
    K3S_JOIN_DROPIN,
    NFT_FIX_DROPIN,
    NFT_FIX_FILE,
    Observed,
    Programs,
    Step,
    bootstrap_files,
    k3s_join_dropin,
    plan_bootstrap,
    socat_units,
)
from reconciler.core.install.nodeconfig import parse_node_config
from tests.conftest import EXAMPLE_FLEET, REPO

PROBE_CAPTURES = REPO / "tests" / "fixtures" / "probe"

STATE = load_desired(EXAMPLE_FLEET)
NODE = parse_node_config(
    """
[node]
host = "racknerd"
[bootstrap]
tailscale_auth_key_file = "/run/secrets/tailscale-auth-key"
k3s_server = "https://100.101.7.10:6443"
k3s_token_file = "/run/secrets/k3s-token"
"""
)
K3S_PATH = f"etc/rancher/k3s/config.yaml.d/{K3S_JOIN_DROPIN}"


def facts(os_id: str = "debian", id_like: tuple[str, ...] = ()) -> HostFacts:
    return HostFacts(
        node_id="racknerd.tail-abc123.ts.net",
        k3s_hostname="racknerd",
        hardware=Hardware(arch="x86_64", cpu_cores=2, memory_mib=2048),
        tier="relay",
        os=OperatingSystem(id=os_id, id_like=list(id_like)),
    )


class FakeNode:
    """A new node's state; `apply` changes it as the real step would."""

    def __init__(self, *, tailscale: bool | None = False, distro_table: bool = False, k3s: str | None = "agent") -> None:
        self.tailscale = tailscale
        # k3s as installed here: "agent" (k3s-agent.service, stopped), "server" (k3s.service), None.
        self.k3s = k3s
        self.agent_active = False
        self.agent_joined_with: str | None = None
        self.node_ready = False
        self.registered: list[str] = []
        self.files: dict[str, str] = {}
        self.distro_table = distro_table
        self.fix_loaded = False
        self.timer_active = False
        self.socat_running: set[str] = set()
        self.commands: list[tuple[str, ...]] = []

    def observe(self, host: str, node=NODE) -> Observed:
        return Observed(
            tailscale_running=self.tailscale,
            registered=host in self.registered,
            files={p: self.files.get(p) for p in bootstrap_files(node)},
            distro_table_present=self.distro_table,
            nft_fix_loaded=self.fix_loaded,
            timer_active=self.timer_active,
            socat_active={u: u in self.socat_running for u in socat_units(STATE, host)},
            k3s_server=self.k3s == "server",
            k3s_agent_installed=self.k3s == "agent",
            k3s_agent_active=self.agent_active,
            k3s_node_ready=self.node_ready,
        )

    def apply(self, step: Step, host: str) -> None:
        if step.kind == "tailscale_up":
            self.commands.append(step.argv)
            self.tailscale = True
        elif step.kind == "register":
            assert step.record is not None
            self.registered.append(step.record.node_id)
        elif step.kind == "write_file":
            assert step.path and step.content is not None
            self.files[step.path] = step.content
        elif step.kind == "restart_k3s_agent":
            # The agent reads its config.yaml.d at its start.
            self.agent_active = True
            self.agent_joined_with = self.files.get(K3S_PATH)
        elif step.kind == "wait_k3s_node":
            assert self.agent_active and step.node
            self.node_ready = True
        elif step.kind == "load_nft_fix":
            self.fix_loaded = True
        elif step.kind == "enable_timer":
            self.timer_active = True
        elif step.kind == "run_pass":
            self.socat_running |= set(socat_units(STATE, host))


def run(node_state: FakeNode, host: str = "racknerd", node=NODE, probe: HostFacts | None = None):
    plan = plan_bootstrap(node=node, desired=STATE, host=host, facts=probe or facts(), observed=node_state.observe(host, node))
    for step in plan.steps:
        node_state.apply(step, host)
    return plan


def test_new_edge_node_gets_every_step_in_the_seeds_order() -> None:
    plan = run(FakeNode())
    assert [s.kind for s in plan.steps] == [
        "tailscale_up",
        "register",
        "write_file",
        "restart_k3s_agent",
        "wait_k3s_node",
        "enable_timer",
        "run_pass",
    ]
    assert plan.steps[2].path == K3S_PATH
    assert "fabric-socat-lux-smb.service, fabric-socat-qfox-ssh.service" in plan.steps[6].reason
    assert plan.problems == ()


def test_second_run_has_nothing_to_do() -> None:
    node = FakeNode(distro_table=True)
    arch = facts("arch")
    first = run(node, probe=arch)
    assert not first.nothing_to_do
    second = run(node, probe=arch)
    assert second.nothing_to_do and second.steps == ()


def test_auth_key_only_as_a_file_reference() -> None:
    node = FakeNode()
    run(node)
    (argv,) = node.commands
    assert argv == ("tailscale", "up", "--auth-key=file:/run/secrets/tailscale-auth-key", "--hostname=racknerd")


def test_k3s_join_settings_hold_the_token_path_never_a_token() -> None:
    node = FakeNode()
    run(node)
    text = node.files[K3S_PATH]
    assert 'server: "https://100.101.7.10:6443"' in text
    assert 'token-file: "/run/secrets/k3s-token"' in text
    assert "token:" not in text and "node-label" not in text.split("\n", 3)[-1]


def test_changed_join_settings_are_rewritten() -> None:
    node = FakeNode()
    run(node)
    moved = NODE.model_copy(update={"bootstrap": NODE.bootstrap.model_copy(update={"k3s_server": "https://100.101.7.11:6443"})})
    plan = run(node, node=moved)
    # The agent reads its settings at its start: it is restarted and waited for.
    assert [(s.kind, s.path) for s in plan.steps] == [("write_file", K3S_PATH), ("restart_k3s_agent", None), ("wait_k3s_node", None)]
    assert plan.steps[0].reason.endswith("(changed)")
    assert node.files[K3S_PATH] == k3s_join_dropin("racknerd", "https://100.101.7.11:6443", "/run/secrets/k3s-token")
    assert node.agent_joined_with == node.files[K3S_PATH]


def test_the_agent_restarts_only_after_its_settings_are_written_and_the_node_is_waited_for() -> None:
    node = FakeNode()
    plan = run(node)
    kinds = [s.kind for s in plan.steps]
    assert kinds.index("write_file") < kinds.index("restart_k3s_agent") < kinds.index("wait_k3s_node") < kinds.index("run_pass")
    wait = next(s for s in plan.steps if s.kind == "wait_k3s_node")
    assert wait.node == "racknerd"
    assert node.agent_joined_with is not None and "server:" in node.agent_joined_with


def test_a_stopped_agent_is_started_and_a_node_not_ready_is_waited_for() -> None:
    node = FakeNode()
    run(node)
    node.agent_active = node.node_ready = False  # k3s-agent stopped since
    assert [s.kind for s in run(node).steps] == ["restart_k3s_agent", "wait_k3s_node"]
    node.node_ready = False  # up, but its Node not Ready
    assert [s.kind for s in run(node).steps] == ["wait_k3s_node"]


def test_a_host_running_a_k3s_server_is_refused_before_any_step() -> None:
    node = FakeNode(k3s="server")
    plan = plan_bootstrap(node=NODE, desired=STATE, host="racknerd", facts=facts(), observed=node.observe("racknerd"))
    # A problem stops `fabric bootstrap` before any step (test_problems_stop_before_any_step).
    assert not any(s.path == K3S_PATH or s.kind in ("restart_k3s_agent", "wait_k3s_node") for s in plan.steps)
    (problem,) = plan.problems
    assert "k3s runs here as a server (k3s.service)" in problem and "https://100.101.7.10:6443" in problem


def test_a_host_without_the_k3s_agent_is_refused_and_told_how_to_install_it() -> None:
    node = FakeNode(k3s=None)
    plan = plan_bootstrap(node=NODE, desired=STATE, host="racknerd", facts=facts(), observed=node.observe("racknerd"))
    assert not any(s.path == K3S_PATH or s.kind in ("restart_k3s_agent", "wait_k3s_node") for s in plan.steps)
    assert any("k3s-agent.service not found" in p and "INSTALL_K3S_EXEC=agent" in p for p in plan.problems)


@pytest.mark.parametrize(
    ("os_id", "id_like", "wanted"),
    [("arch", (), True), ("cachyos", ("arch",), True), ("endeavouros", ("arch",), True), ("debian", (), False), ("nixos", (), False)],
)
def test_nftables_fix_only_where_the_os_needs_it(os_id: str, id_like: tuple[str, ...], wanted: bool) -> None:
    node = FakeNode(tailscale=True, distro_table=True)
    plan = run(node, probe=facts(os_id, id_like))
    fix = [s for s in plan.steps if s.path in (NFT_FIX_FILE, NFT_FIX_DROPIN) or s.kind in ("load_nft_fix", "daemon_reload")]
    assert bool(fix) == wanted
    if wanted:
        assert [s.kind for s in fix] == ["write_file", "write_file", "daemon_reload", "load_nft_fix"]
        ruleset = node.files[NFT_FIX_FILE]
        assert 'insert rule inet filter forward iifname "tailscale0" accept comment "fabric-tailscale-fix"' in ruleset
        dropin = node.files[NFT_FIX_DROPIN]
        assert "ExecReload=-/usr/sbin/nft -f /etc/fabric/tailscale-fix.nft" in dropin
        assert "try-reload-or-restart fabric-nftables.service" in dropin


def test_host_file_overrides_the_os_detection() -> None:
    # qfox-1 declares nftables_fix = true; a Debian probe does not change that.
    node = FakeNode(tailscale=True, distro_table=True)
    plan = plan_bootstrap(node=NODE, desired=STATE, host="qfox-1", facts=facts("debian"), observed=node.observe("qfox-1"))
    assert any(s.kind == "load_nft_fix" for s in plan.steps)


def test_fix_waits_for_the_distro_table() -> None:
    plan = run(FakeNode(tailscale=True, distro_table=False), probe=facts("arch"))
    assert not any(s.kind == "load_nft_fix" for s in plan.steps)
    assert any("no table inet filter" in n for n in plan.notes)


def test_programs_paths_land_in_the_dropin() -> None:
    node = FakeNode(tailscale=True, distro_table=True)
    plan = plan_bootstrap(
        node=NODE,
        desired=STATE,
        host="racknerd",
        facts=facts("arch"),
        observed=node.observe("racknerd"),
        programs=Programs(nft="/usr/bin/nft", systemctl="/usr/bin/systemctl"),
    )
    dropin = next(s.content for s in plan.steps if s.path == NFT_FIX_DROPIN)
    assert "ExecStartPost=-/usr/bin/nft -f /etc/fabric/tailscale-fix.nft" in dropin


def test_problems_stop_before_any_step() -> None:
    no_key = NODE.model_copy(update={"bootstrap": NODE.bootstrap.model_copy(update={"tailscale_auth_key_file": None})})
    plan = plan_bootstrap(node=no_key, desired=STATE, host="racknerd", facts=facts(), observed=FakeNode().observe("racknerd"))
    assert plan.problems == ("tailscale is not up and [bootstrap] tailscale_auth_key_file is not set",)
    missing = plan_bootstrap(node=NODE, desired=STATE, host="racknerd", facts=facts(), observed=FakeNode(tailscale=None).observe("racknerd"))
    assert "tailscale is not installed" in missing.problems[0]
    unknown = plan_bootstrap(node=NODE, desired=STATE, host="nope", facts=facts(), observed=FakeNode().observe("racknerd"))
    assert unknown.steps == () and "'nope' is not in the desired state" in unknown.problems[0]


def test_registered_node_is_not_registered_again() -> None:
    node = FakeNode(tailscale=True)
    node.registered.append("racknerd")
    assert not any(s.kind == "register" for s in run(node).steps)


def test_host_without_port_maps_still_gets_a_first_pass() -> None:
    node = FakeNode(tailscale=True)
    plan = plan_bootstrap(node=NODE, desired=STATE, host="a1-arm64", facts=facts(), observed=node.observe("a1-arm64"))
    assert [s.kind for s in plan.steps][-2:] == ["enable_timer", "run_pass"]
    assert plan.steps[-1].reason == "no pass has run on this node yet"


# --------------------------------------------------------------------------
# The command line: dry run in a sandbox root, bad input


def test_cli_dry_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    root.mkdir()
    registry = tmp_path / "registry.sqlite"
    code = main(
        [
            "bootstrap",
            "--config",
            str(tmp_path / "absent.toml"),
            "--desired",
            str(EXAMPLE_FLEET),
            "--host",
            "racknerd",
            "--root",
            str(root),
            "--dry-run",
            "--registry-path",
            str(registry),
            "--replay",
            str(PROBE_CAPTURES / "racknerd"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "would register: the registry does not know this node" in out
    assert "would run_pass: port maps not running" in out
    assert list(root.iterdir()) == []


def test_cli_bad_node_toml_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[bootstrap]\nk3s_server = "https://100.101.7.10:6443"\n')
    assert main(["bootstrap", "--config", str(config), "--desired", str(EXAMPLE_FLEET), "--dry-run"]) == 2
    assert f"{config}: bootstrap.k3s_token_file: k3s_server and k3s_token_file go together" in capsys.readouterr().err


def test_cli_unknown_host_would_report_pending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A machine without a host file is not refused: it reports itself pending (#31)."""
    argv = ["bootstrap", "--config", str(tmp_path / "absent.toml"), "--desired", str(EXAMPLE_FLEET), "--host", "mystery"]
    argv += ["--replay", str(REPO / "tests" / "golden" / "probe" / "x86_64"), "--registry-path", str(tmp_path / "r.sqlite")]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would report mystery pending (probed tier relay)" in out and "`fabric admit mystery`" in out
    assert not (tmp_path / "r.sqlite").exists(), "a dry run changes nothing"


def test_cli_unknown_host_whose_name_cannot_be_a_hosts_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import reconciler.cli.bootstrap as bootstrap_cli

    monkeypatch.setattr(bootstrap_cli, "bootstrap_io", lambda registry, root: pytest.fail("nothing is run for a bad name"))
    argv = ["bootstrap", "--config", str(tmp_path / "absent.toml"), "--desired", str(EXAMPLE_FLEET), "--host", "Mystery.Box"]
    argv += ["--replay", str(REPO / "tests" / "golden" / "probe" / "x86_64"), "--registry-path", str(tmp_path / "r.sqlite")]
    assert main(argv) == 2
    assert "cannot be a fabric host's name" in capsys.readouterr().err
    assert not (tmp_path / "r.sqlite").exists(), "nothing changed"


def test_cli_unknown_host_reports_pending_and_enables_its_timer(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import reconciler.cli.bootstrap as bootstrap_cli
    from reconciler.adapters.registry_sqlite import SqliteRegistry
    from tests.support.clock import FakeClock

    done: list[str] = []

    class IO:
        def execute(self, step) -> None:
            done.append(step.kind)

    monkeypatch.setattr(bootstrap_cli, "bootstrap_io", lambda registry, root: IO())
    argv = ["bootstrap", "--config", str(tmp_path / "absent.toml"), "--desired", str(EXAMPLE_FLEET), "--host", "mystery"]
    argv += ["--replay", str(REPO / "tests" / "golden" / "probe" / "x86_64"), "--registry-path", str(tmp_path / "r.sqlite")]
    assert main(argv) == 0
    assert "pending: mystery has no host file" in capsys.readouterr().out
    assert done == ["enable_timer"]
    fleet = load_desired(EXAMPLE_FLEET).fleet
    registry = SqliteRegistry(tmp_path / "r.sqlite", timing=fleet.timing, flap=fleet.flap, clock=FakeClock(0))
    try:
        assert [r.node_id for r in registry.pending_nodes()[0]] == ["mystery"]
        assert registry.node_states() == []
    finally:
        registry.close()


def test_cli_dry_run_of_an_arch_gpu_desktop_plans_the_nftables_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """qfox-1's capture (CachyOS, RTX 4070): the fix files are planned under the sandbox root."""
    root = tmp_path / "root"
    root.mkdir()
    code = main(
        [
            "bootstrap",
            "--config",
            str(tmp_path / "absent.toml"),
            "--desired",
            str(EXAMPLE_FLEET),
            "--host",
            "qfox-1",
            "--root",
            str(root),
            "--dry-run",
            "--registry-path",
            str(tmp_path / "r.sqlite"),
            "--replay",
            str(PROBE_CAPTURES / "qfox-1"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert f"would write_file {NFT_FIX_FILE}: tailnet accepts for the distro ruleset" in out
    assert f"would write_file {NFT_FIX_DROPIN}: re-apply the fix after nftables.service reloads" in out
    assert list(root.iterdir()) == []


def test_the_registration_carries_the_limits_bounded_by_the_probe() -> None:
    """x86-spill's host file declares 4/8; a probe of 2/3 bounds them, as every pass's heartbeat does."""
    from reconciler.core.desired.model import Limitations

    probe = facts().model_copy(update={"limitations": Limitations(max_concurrent_tasks=2, max_concurrent_ceiling=3)})
    plan = plan_bootstrap(node=NODE, desired=STATE, host="x86-spill", facts=probe, observed=FakeNode().observe("x86-spill", NODE))
    (register,) = [s for s in plan.steps if s.kind == "register"]
    assert register.record is not None
    assert (register.record.max_concurrent_tasks, register.record.max_concurrent_ceiling) == (2, 3)
    assert register.record.lowered_limits == [
        "max_concurrent_tasks 4 lowered to 2 by the probe",
        "max_concurrent_ceiling 8 lowered to 3 by the probe",
    ]
