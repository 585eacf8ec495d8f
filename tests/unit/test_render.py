"""render: what each host of the example fleet gets, quoting, trust of the plan.

The complete texts for every example host are golden files under
tests/golden/render/<host>/ (regenerate with UPDATE_GOLDEN=1 and review the
diff); the tests below pin the properties that matter one by one.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from jinja2 import PackageLoader, StrictUndefined, UndefinedError

from reconciler.core.desired.load import DesiredStateError, load_desired
from reconciler.core.desired.model import DesiredState, EdgeSettings, OperatingSystem
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import TEMPLATES_DIR, Layout, RenderError, render, systemd_env, systemd_quote
from reconciler.core.templating import environment as template_environment
from tests.support.render import facts, files, golden_plan

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
HOSTS = ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"]


def example() -> DesiredState:
    return load_desired(REPO / "hosts")


def edited(tmp_path: Path, old: str, new: str) -> DesiredState:
    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    text = (desired / "fabric.toml").read_text()
    assert old in text
    (desired / "fabric.toml").write_text(text.replace(old, new))
    return load_desired(desired)


def unit(texts: dict[str, str], name: str) -> str:
    return texts[f"etc/systemd/system/{name}"]


def systemd_unquote(word: str, *, command_line: bool = True) -> str:
    """Reference decoding of one double-quoted ExecStart= (or Environment=)
    word, by systemd's rules: C escapes inside quotes, %% -> %, and on
    command lines only (where $VAR is expanded) $$ -> $."""
    assert word.startswith('"') and word.endswith('"'), word
    out, i, body = [], 0, word[1:-1]
    while i < len(body):
        c = body[i]
        special = "%$" if command_line else "%"
        if c in special and body[i + 1 : i + 2] == c:
            out.append(c)
            i += 2
        elif c == "\\":
            out.append(body[i + 1])
            i += 2
        else:
            assert c not in '"' + special, f"unescaped {c!r} in {word}"
            out.append(c)
            i += 1
    return "".join(out)


def words(line: str) -> list[str]:
    return re.findall(r'"(?:\\.|[^"\\])*"|\S+', line)


# --------------------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
def test_rendered_texts_match_golden_files(host: str) -> None:
    rendered = files(example(), host)
    directory = GOLDEN / "render" / host
    if UPDATE:
        shutil.rmtree(directory, ignore_errors=True)
        for path, text in rendered.items():
            (directory / path).parent.mkdir(parents=True, exist_ok=True)
            (directory / path).write_text(text)
    on_disk = {str(p.relative_to(directory)): p.read_text() for p in directory.rglob("*") if p.is_file()}
    assert on_disk == rendered


def test_edge_routes_every_service_to_where_it_is_placed_with_retries_and_passive_checks() -> None:
    caddy = files(example(), "racknerd")["etc/caddy/fabric.caddy"]
    fft = caddy[caddy.index("fft.researchstack.info {") :]
    # Two replicas: qfox-1 and x86-spill, addresses from their host files.
    assert "reverse_proxy 100.88.57.96:8703 100.101.7.22:8703 {" in fft
    # [edge]'s defaults; no active health check (it held new upstreams out).
    assert "lb_try_duration 5s\n\t\tlb_try_interval 100ms\n\t\tfail_duration 250ms\n\t\tmax_fails 1\n" in fft
    assert "\t\t\tdial_timeout 1s\n" in fft
    assert not [line for line in caddy.splitlines() if line.lstrip().startswith("health_")]
    assert "encode.researchstack.info {\n\treverse_proxy 100.88.57.96:8702 {" in caddy


def test_the_example_fleets_edge_timings_are_the_defaults_it_says_they_are() -> None:
    """hosts/fabric.toml spells out [edge] as "the defaults": a default changed
    in EdgeSettings (fail_memory_ms 250 ms: a replacement that listens gets
    traffic within a quarter second, issue 14) changes the example too."""
    assert example().fleet.edge == EdgeSettings()


def test_edge_takes_its_retry_and_failure_timings_from_the_edge_settings() -> None:
    state = example()
    edge = EdgeSettings(retry_window_ms=8000, retry_interval_ms=250, fail_memory_ms=1500, dial_timeout_ms=2000)
    state = state.model_copy(update={"fleet": state.fleet.model_copy(update={"edge": edge})})
    caddy = files(state, "racknerd")["etc/caddy/fabric.caddy"]
    for site in ("braid", "encode", "fft"):
        block = caddy[caddy.index(f"{site}.researchstack.info {{") :].split("\n}\n")[0]
        assert "lb_try_duration 8s\n\t\tlb_try_interval 250ms\n\t\tfail_duration 1500ms\n" in block
        assert "dial_timeout 2s\n" in block


def test_a_routed_service_without_placement_answers_503() -> None:
    plan = golden_plan(placements=[p for p in golden_plan().placements if p.service != "braid"])
    caddy = files(example(), "racknerd", plan)["etc/caddy/fabric.caddy"]
    site = caddy[caddy.index("braid.researchstack.info {") :].split("\n}\n")[0]
    assert "reverse_proxy" not in site
    assert re.search(r'respond "braid\.researchstack\.info: service braid is not running on any host right now[^"]*" 503', site)


def test_only_edge_hosts_get_a_caddy_snippet() -> None:
    for host in HOSTS:
        has = "etc/caddy/fabric.caddy" in files(example(), host)
        assert has == (host == "racknerd")


def test_nft_replaces_only_table_inet_fabric_and_opens_ports_to_the_tailnet_only() -> None:
    nft = files(example(), "racknerd")["etc/fabric/fabric.nft"]
    code = [line.strip() for line in nft.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert code[:3] == ["table inet fabric", "delete table inet fabric", "table inet fabric {"]
    assert not re.search(r"\btable\s+(?!inet fabric\b)", "\n".join(code)), "no other table is named"
    assert 'iifname "tailscale0" ip saddr 100.64.0.0/10 tcp dport { 2222, 4445 } accept' in code
    assert "tcp dport { 2222, 4445 } drop" in code
    qfox = files(example(), "qfox-1")["etc/fabric/fabric.nft"]
    assert "tcp dport { 8701, 8702, 8703 } accept" in qfox


def test_nftables_fix_from_host_file_or_os_release() -> None:
    state = example()
    assert "chain forward" in files(state, "qfox-1")["etc/fabric/fabric.nft"]  # nftables_fix = true
    assert "chain forward" not in files(state, "lux")["etc/fabric/fabric.nft"]
    cachy = facts("lux", os=OperatingSystem(id="cachyos", id_like=["arch"]))
    assert 'iifname "tailscale0" accept' in files(state, "lux", node_facts=cachy)["etc/fabric/fabric.nft"]
    arch = facts("lux", os=OperatingSystem(id="arch"))
    assert "chain forward" in files(state, "lux", node_facts=arch)["etc/fabric/fabric.nft"]


def test_host_file_can_turn_the_fix_off(tmp_path: Path) -> None:
    desired = tmp_path / "d"
    shutil.copytree(REPO / "hosts", desired)
    (desired / "lux.toml").write_text(
        (desired / "lux.toml")
        .read_text()
        .replace('tailnet_name = "lux.tail-abc123.ts.net"', 'tailnet_name = "lux.tail-abc123.ts.net"\nnftables_fix = false')
    )
    arch = facts("lux", os=OperatingSystem(id="arch"))
    assert "chain forward" not in files(load_desired(desired), "lux", node_facts=arch)["etc/fabric/fabric.nft"]


def test_one_socat_unit_per_port_map_of_this_host() -> None:
    texts = files(example(), "racknerd")
    socat = sorted(p for p in texts if "fabric-socat-" in p)
    assert socat == ["etc/systemd/system/fabric-socat-lux-smb.service", "etc/systemd/system/fabric-socat-qfox-ssh.service"]
    qfox = unit(texts, "fabric-socat-qfox-ssh.service")
    # On racknerd's tailnet address (tests/integration/test_socat.py runs it).
    assert 'ExecStart="/usr/bin/socat" "TCP4-LISTEN:2222,bind=100.101.7.2,ip-freebind=1,fork,reuseaddr" "TCP4:100.88.57.96:22"' in qfox
    for setting in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "CapabilityBoundingSet=\n"):
        assert setting in qfox
    assert not any("fabric-socat-" in p for p in files(example(), "lux"))


def test_agent_image_and_command_swap_per_architecture() -> None:
    state = example()
    arm = unit(files(state, "a1-arm64"), "fabric-agent-a1-arm64.service")
    x86 = unit(files(state, "x86-spill"), "fabric-agent-x86-spill.service")
    arm_exec = [systemd_unquote(w) if w.startswith('"') else w for w in words(arm.split("ExecStart=")[1].splitlines()[0])]
    x86_exec = [systemd_unquote(w) if w.startswith('"') else w for w in words(x86.split("ExecStart=")[1].splitlines()[0])]
    assert arm_exec[-5:] == ["ghcr.io/researchstack/phaze:2026.11-arm64", "python3", "-m", "saq", "phaze.tasks.agent_worker.settings"]
    assert x86_exec[-5:] == ["ghcr.io/researchstack/phaze:2026.11", "uv", "run", "saq", "phaze.tasks.agent_worker.settings"]
    assert 'Environment="PHAZE_AGENT_QUEUE=phaze-agent-a1-arm64"' in arm
    assert 'Environment="PHAZE_AGENT_QUEUE=phaze-agent-x86-spill"' in x86
    assert 'Environment="PHAZE_CLOUD_SCRATCH_DIR=/var/lib/phaze/scratch"' in arm
    # The override in the host file wins over the probe.
    swapped = unit(files(state, "a1-arm64", node_facts=facts("a1-arm64", arch="x86_64")), "fabric-agent-a1-arm64.service")
    assert "phaze:2026.11-arm64" not in swapped


def test_no_agent_runs_the_local_lane() -> None:
    # The local lane is phaze's own processing on the file server: no host
    # renders an agent for it, the control host included.
    for host in HOSTS:
        assert not any("fabric-agent-local" in path for path in files(example(), host))
    lux_units = {path for path in files(example(), "lux") if path.startswith("etc/systemd/system/")}
    # (lux's other unit is the example fleet's Ray head.)
    assert lux_units == {"etc/systemd/system/fabric-nftables.service", "etc/systemd/system/fabric-ray-head.service"}


def test_the_local_lanes_queue_is_named_by_the_desired_state(tmp_path: Path) -> None:
    # A phaze fleet: the file server agent's own lane queue, as phaze's
    # LocalBackend.dispatch names it (phaze-agent-<fileserver agent>-analyze).
    state = example()
    assert state.queue_for(state.lanes[-1]) == "phaze-agent-lux-analyze"
    other = edited(tmp_path / "other", 'fileserver_agent = "lux"', 'fileserver_agent = "nas-1"')
    assert other.queue_for(other.lanes[-1]) == "phaze-agent-nas-1-analyze"
    no_lanes = edited(tmp_path / "bare", 'fileserver_agent = "lux"\n', 'fileserver_agent = "lux"\nagent_lane = ""\n')
    assert no_lanes.queue_for(no_lanes.lanes[-1]) == "phaze-agent-lux", "a phaze without lanes: the bare queue"
    # The fabric's own lanes (no api_url): phaze-local unless the lane names its queue.
    own_text = 'api_url = "https://lux.tail-abc123.ts.net:8000"\n'
    default = edited(tmp_path / "own-default", own_text, "")
    assert default.lanes[-1].queue is None and default.queue_for(default.lanes[-1]) == "phaze-local"
    desired = tmp_path / "own" / "desired"
    shutil.copytree(REPO / "hosts", desired)
    text = (
        (desired / "fabric.toml")
        .read_text()
        .replace(own_text, "")
        .replace('id = "local"\nrank = 99\ncap = 1\n', 'id = "local"\nrank = 99\ncap = 1\nqueue = "fileserver-analysis"\n')
    )
    (desired / "fabric.toml").write_text(text)
    own = load_desired(desired)
    assert own.queue_for(own.lanes[-1]) == "fileserver-analysis"


BACKEND_KEYS = ("kind", "id", "rank", "cap", "agent_ref", "push_host", "scratch_dir", "ssh_user")


def test_the_control_host_gets_phazes_backends_toml_equal_to_the_declared_lanes() -> None:
    state = example()
    rendered = {a.path: a for a in render(state, "lux", facts("lux"), golden_plan()).artifacts}
    backends = rendered["etc/phaze/backends.toml"]
    # Exactly the declared [[backends]], in phaze's field names, only the keys
    # set (multi-compute.md's worked file), never the fabric's queue or token_file.
    assert tomllib.loads(backends.content) == {
        "backends": [
            {
                "kind": "compute",
                "id": "a1-arm64",
                "rank": 10,
                "cap": 2,
                "agent_ref": "a1-arm64",
                "push_host": "a1-arm64",
                "scratch_dir": "/var/lib/phaze/scratch",
                "ssh_user": "phaze",
            },
            {
                "kind": "compute",
                "id": "x86-spill",
                "rank": 20,
                "cap": 4,
                "agent_ref": "x86-spill",
                "push_host": "x86-spill",
                "scratch_dir": "/var/lib/phaze/scratch",
                "ssh_user": "phaze",
            },
            {"kind": "local", "id": "local", "rank": 99, "cap": 1},
        ]
    }
    assert tomllib.loads(backends.content)["backends"] == [
        lane.model_dump(include=set(BACKEND_KEYS), exclude_none=True) for lane in state.fleet.lanes
    ]
    assert backends.kind == "file" and backends.mode == 0o644
    # A change of it restarts phaze's control plane (it reads the file at startup only).
    assert backends.restarts == ("phaze-api.service", "phaze-worker.service")
    for host in HOSTS:
        assert ("etc/phaze/backends.toml" in files(state, host)) == (host == "lux")


def test_without_declared_lanes_there_is_no_backends_toml(tmp_path: Path) -> None:
    # phaze's own default (no file: one local backend) is the fabric's implicit lane.
    text = (REPO / "hosts" / "fabric.toml").read_text()
    declared = text[text.index("# --- Tier 1") : text.index("# Services exercising")]
    state = edited(tmp_path, declared, "")
    assert not state.fleet.lanes
    assert "etc/phaze/backends.toml" not in files(state, "lux")


def co_located(tmp_path: Path, *, token_file: str | None = None) -> DesiredState:
    """The example fleet with a second agent on a1-arm64: its own agent_ref, scratch dir and (optionally) token file."""
    second = (
        "[[backends]]\n"
        'kind = "compute"\n'
        'id = "a1-arm64-b"\n'
        "rank = 15\n"
        "cap = 1\n"
        'agent_ref = "a1-arm64-b"\n'
        'push_host = "a1-arm64"\n'
        'scratch_dir = "/var/lib/phaze/scratch-b"\n'
        'ssh_user = "phaze"\n' + (f'token_file = "{token_file}"\n' if token_file else "") + "\n"
    )
    return edited(tmp_path, "# --- Tier 2: paid/trial x86", second + "# --- Tier 2: paid/trial x86")


def test_co_located_agents_each_get_their_own_unit_queue_scratch_dir_and_token(tmp_path: Path) -> None:
    state = co_located(tmp_path)
    a1 = files(state, "a1-arm64")
    first, second = unit(a1, "fabric-agent-a1-arm64.service"), unit(a1, "fabric-agent-a1-arm64-b.service")
    assert 'Environment="PHAZE_AGENT_QUEUE=phaze-agent-a1-arm64"' in first
    assert 'Environment="PHAZE_AGENT_QUEUE=phaze-agent-a1-arm64-b"' in second
    assert 'Environment="PHAZE_CLOUD_SCRATCH_DIR=/var/lib/phaze/scratch"' in first
    assert 'Environment="PHAZE_CLOUD_SCRATCH_DIR=/var/lib/phaze/scratch-b"' in second
    assert "ReadWritePaths=-/var/lib/phaze/scratch\n" in first
    assert "ReadWritePaths=-/var/lib/phaze/scratch-b\n" in second
    # Each its own token, by default under agent.token_dir/<agent_ref>/, as a credential.
    for text, ref in ((first, "a1-arm64"), (second, "a1-arm64-b")):
        token = f"/run/secrets/phaze/agents/{ref}/token"
        assert f'Environment="PHAZE_AGENT_TOKEN_FILE={token}"' in text
        assert f"LoadCredential=phaze_agent_token_file:{token}\n" in text
        assert f"--volume=%d/phaze_agent_token_file:{token}:ro" in text
        assert f'"--name=fabric-agent-{ref}"' in text
    assert "scratch-b" not in first and "agents/a1-arm64-b" not in first
    # phaze's control plane sees both lanes.
    lanes = tomllib.loads(files(state, "lux")["etc/phaze/backends.toml"])["backends"]
    assert [(b["id"], b["push_host"], b["scratch_dir"]) for b in lanes if b["kind"] == "compute"] == [
        ("a1-arm64", "a1-arm64", "/var/lib/phaze/scratch"),
        ("a1-arm64-b", "a1-arm64", "/var/lib/phaze/scratch-b"),
        ("x86-spill", "x86-spill", "/var/lib/phaze/scratch"),
    ]


def test_a_lane_may_name_its_own_token_file(tmp_path: Path) -> None:
    state = co_located(tmp_path, token_file="/run/keys/phaze-b.token")
    second = unit(files(state, "a1-arm64"), "fabric-agent-a1-arm64-b.service")
    assert 'Environment="PHAZE_AGENT_TOKEN_FILE=/run/keys/phaze-b.token"' in second
    assert "LoadCredential=phaze_agent_token_file:/run/keys/phaze-b.token\n" in second
    assert "/run/secrets/phaze/agents" not in second


def test_a_lane_may_name_its_agents_own_broker_dsn_file(tmp_path: Path) -> None:
    """The DSN of the lane's own role (`fabric lane init-roles`: fabric-agent-<id>), as a credential like any DSN file."""
    old = 'push_host = "a1-arm64"\n'
    state = edited(tmp_path, old, old + 'queue_url_file = "/run/secrets/phaze/agent-a1-arm64.url"\n')
    own = unit(files(state, "a1-arm64"), "fabric-agent-a1-arm64.service")
    assert 'Environment="PHAZE_QUEUE_URL_FILE=/run/secrets/phaze/agent-a1-arm64.url"' in own
    assert "LoadCredential=phaze_queue_url_file:/run/secrets/phaze/agent-a1-arm64.url\n" in own
    assert "/run/secrets/phaze/queue_url" not in own
    other = unit(files(state, "x86-spill"), "fabric-agent-x86-spill.service")
    assert 'Environment="PHAZE_QUEUE_URL_FILE=/run/secrets/phaze/queue_url"' in other, "a lane without its own keeps [agent] queue_url_file"


def test_secrets_reach_units_only_as_paths() -> None:
    state = example()
    a1 = files(state, "a1-arm64")
    agent = unit(a1, "fabric-agent-a1-arm64.service")
    token = "/run/secrets/phaze/agents/a1-arm64/token"
    assert f'Environment="PHAZE_AGENT_TOKEN_FILE={token}"' in agent
    # The agent's dynamic user cannot read root's file: systemd hands it over
    # as a credential, and the container sees it at the path the variable names.
    assert f"LoadCredential=phaze_agent_token_file:{token}" in agent
    assert f"--volume=%d/phaze_agent_token_file:{token}:ro" in agent
    assert f"{token}:/run/secrets" not in agent
    braid = unit(a1, "fabric-agent-braid.service")
    assert "LoadCredential=api_token:/run/secrets/braid/api_token" in braid
    assert 'Environment="API_TOKEN_FILE=/run/credentials/fabric/api_token"' in braid
    assert "--volume=%d:/run/credentials/fabric:ro" in braid
    # Values are handed to the container by name, never in its argv.
    assert '"--env=PHAZE_AGENT_TOKEN_FILE"' in agent and "--env=PHAZE_AGENT_TOKEN_FILE=" not in agent


def test_command_services_are_sandboxed_gpu_services_keep_devices() -> None:
    qfox = files(example(), "qfox-1")
    lupine = unit(qfox, "fabric-agent-lupine.service")
    fft = unit(qfox, "fabric-agent-flac-fft.service")
    assert 'ExecStart="/opt/researchstack/bin/lupine-server" "--port" "8701"' in lupine
    for text in (lupine, fft):
        for setting in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "Restart=on-failure"):
            assert setting in text
    assert "PrivateDevices=yes" not in lupine  # gpu_cuda needs /dev/nvidia*
    assert "PrivateDevices=yes" in fft


def test_argv_and_environment_are_quoted_for_systemd(tmp_path: Path) -> None:
    nasty = ['/opt/x/bin/s p"a%c$e', "--msg", 'say "hi" 100% $HOME \\n ${X}', "%n"]
    toml_argv = ", ".join('"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"' for a in nasty)
    state = edited(
        tmp_path,
        'command = { x86_64 = ["/opt/researchstack/bin/lupine-server", "--port", "8701"] }\nenvironment = { LUPINE_MODEL_DIR = "/var/lib/lupine/models" }',
        f'command = {{ x86_64 = [{toml_argv}] }}\nenvironment = {{ LUPINE_NOTE = "50% \\"quoted\\" \\\\ $x" }}',
    )
    text = unit(files(state, "qfox-1"), "fabric-agent-lupine.service")
    exec_line = text.split("ExecStart=")[1].splitlines()[0]
    assert [systemd_unquote(w) for w in words(exec_line)] == nasty
    env_line = next(line for line in text.splitlines() if line.startswith("Environment=") and "LUPINE_NOTE" in line)
    assert systemd_unquote(env_line.removeprefix("Environment="), command_line=False) == 'LUPINE_NOTE=50% "quoted" \\ $x'
    assert systemd_quote("a") == '"a"' and systemd_env("A", "%") == '"A=%%"'


def test_plan_entries_the_desired_state_does_not_know_are_ignored() -> None:
    plan = golden_plan()
    raw = plan.model_dump()
    raw["placements"] += [
        {"service": "evil", "replica": 0, "node": "racknerd", "tier": "relay"},
        {"service": "fft", "replica": 0, "node": "intruder", "tier": "relay"},
        {"service": "flac-fft", "replica": 3, "node": "intruder", "tier": "relay"},
    ]
    rendered = render(example(), "racknerd", facts("racknerd"), FleetPlan.model_validate(raw))
    texts = {a.path: a.content for a in rendered.artifacts}
    assert not any("evil" in p for p in texts)
    assert "intruder" not in texts["etc/caddy/fabric.caddy"]
    assert any("unknown service 'evil'" in n for n in rendered.notes)
    assert any("unknown host 'intruder'" in n for n in rendered.notes)


def test_unknown_host_and_unit_name_collisions_are_errors(tmp_path: Path) -> None:
    with pytest.raises(RenderError, match="'nosuch' is not declared"):
        render(example(), "nosuch", facts("nosuch"), golden_plan())
    # A lane and a service of one id would share fabric-agent-<id>.service: the
    # desired state refuses it (wherever the service is placed) ...
    with pytest.raises(DesiredStateError, match="backends\\[0\\].id: 'a1-arm64' is also the id of services\\[3\\]"):
        edited(tmp_path, 'id = "braid"', 'id = "a1-arm64"')
    # ... and render refuses a state built around that validation.
    state = example()
    services = [s.model_copy(update={"id": "a1-arm64"}) if s.id == "braid" else s for s in state.fleet.services]
    state = state.model_copy(update={"fleet": state.fleet.model_copy(update={"services": services})})
    plan = golden_plan(placements=[p.model_copy(update={"service": "a1-arm64"}) if p.service == "braid" else p for p in golden_plan().placements])
    with pytest.raises(RenderError, match="fabric-agent-a1-arm64.service would run both"):
        render(state, "a1-arm64", facts("a1-arm64"), plan)


def test_k3s_labels_from_probe_and_host_file() -> None:
    probe = facts(
        "qfox-1", labels={"topology.researchstack.io/gpu": "nvidia:rtx4070", "topology.researchstack.io/role": "auto:foxtop", "bad key!": "x"}
    )
    rendered = render(example(), "qfox-1", probe, golden_plan())
    dropin = {a.path: a for a in rendered.artifacts}["etc/rancher/k3s/config.yaml.d/50-fabric-labels.yaml"]
    assert dropin.kind == "dropin"
    assert '  - "topology.researchstack.io/gpu=nvidia-rtx4070"\n' in dropin.content
    assert '  - "topology.researchstack.io/role=foxtop"\n' in dropin.content  # the host file wins
    assert any("bad key!" in n for n in rendered.notes)


def test_unit_directory_is_a_parameter() -> None:
    rendered = render(example(), "racknerd", facts("racknerd"), golden_plan(), layout=Layout(unit_dir="run/systemd/system"))
    units = [a.path for a in rendered.artifacts if a.kind == "unit"]
    assert units and all(p.startswith("run/systemd/system/fabric-") for p in units)


def test_templates_are_strict_about_missing_values(tmp_path: Path) -> None:
    # The environments render() and the status page use: loaded from the
    # package, StrictUndefined.
    for kind in ("text", "html"):
        packaged = template_environment(kind)  # type: ignore[arg-type]
        assert isinstance(packaged.loader, PackageLoader) and packaged.undefined is StrictUndefined
    # A copy of the templates with one name misspelt: rendering fails instead of
    # writing an empty value (the socat unit reaches it through an include).
    templates = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, templates, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    path = templates / "socat.service.j2"
    path.write_text(path.read_text().replace("{{ listen_port }}", "{{ listen_prot }}", 1))
    with pytest.raises(UndefinedError, match="listen_prot"):
        render(example(), "racknerd", facts("racknerd"), golden_plan(), templates=templates)
    header = templates / "_unit_header.j2"
    path.write_text((TEMPLATES_DIR / "socat.service.j2").read_text())
    header.write_text(header.read_text().replace("{{ source }}", "{{ sauce }}", 1))
    with pytest.raises(UndefinedError, match="sauce"):
        render(example(), "racknerd", facts("racknerd"), golden_plan(), templates=templates)


def test_rendering_is_deterministic_and_independent_of_the_desired_path(tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere"
    shutil.copytree(REPO / "hosts", copy)
    assert files(example(), "qfox-1") == files(load_desired(copy), "qfox-1")


def test_free_text_cannot_run_into_the_next_setting(tmp_path: Path) -> None:
    state = edited(tmp_path, 'description = "FLAC audio FFT: any tier can do it"', 'description = "100% FFT \\\\"')
    text = unit(files(state, "qfox-1"), "fabric-agent-flac-fft.service")
    assert "Description=fabric service flac-fft: 100%% FFT\nWants=network-online.target\n" in text


def test_secret_files_of_a_command_service_become_credentials(tmp_path: Path) -> None:
    state = edited(
        tmp_path,
        'environment = { LUPINE_MODEL_DIR = "/var/lib/lupine/models" }',
        'environment = { LUPINE_MODEL_DIR = "/var/lib/lupine/models", LUPINE_TOKEN_FILE = "/run/secrets/lupine/token" }',
    )
    text = unit(files(state, "qfox-1"), "fabric-agent-lupine.service")
    assert "LoadCredential=lupine_token_file:/run/secrets/lupine/token" in text
    assert 'Environment="LUPINE_TOKEN_FILE=%d/lupine_token_file"' in text
    assert 'Environment="LUPINE_MODEL_DIR=/var/lib/lupine/models"' in text


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# What model.py lets into an argv element or environment value: no control characters.
_ARG_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=40)


@given(_ARG_TEXT)
def test_any_allowed_argument_survives_systemd_quoting(value: str) -> None:
    quoted = systemd_quote(value)
    assert words(quoted) == [quoted], "one word, whatever it holds"
    assert systemd_unquote(quoted) == value


@given(_ARG_TEXT)
def test_any_allowed_environment_value_survives_quoting(value: str) -> None:
    assert systemd_unquote(systemd_env("NAME", value), command_line=False) == f"NAME={value}"


def test_the_snippet_replaces_an_exact_or_glob_import_in_the_main_caddyfile() -> None:
    from reconciler.core.render.artifacts import complete_caddy_config

    snippet = "encode.researchstack.info {\n\trespond 200\n}\n"
    debian = "{\n\tadmin 127.0.0.1:2019\n}\nimport /etc/caddy/fabric.caddy\nown.example {\n\trespond 204\n}\n"
    nixos = "{\n\tadmin 127.0.0.1:2019\n}\nimport /etc/caddy/fabric*.caddy # services.fabric\n"
    for main in (debian, nixos):
        config = complete_caddy_config(main, "etc/caddy/fabric.caddy", snippet)
        assert snippet in config and "import" not in config.split("#")[0]
        assert config.startswith("{\n\tadmin 127.0.0.1:2019\n}\n")
    assert "own.example" in complete_caddy_config(debian, "etc/caddy/fabric.caddy", snippet)
    # A main file that does not import the snippet: the snippet alone is the config.
    assert complete_caddy_config("other.example {\n}\n", "etc/caddy/fabric.caddy", snippet) == snippet
    assert complete_caddy_config("import /etc/caddy/other*.caddy\n", "etc/caddy/fabric.caddy", snippet) == snippet


def assert_scratch_dir_is_the_pushers_at_its_real_path(text: str, scratch: str, state_directory: str) -> None:
    """phaze pushes as the lane's ssh_user ("phaze") into scratch_dir on the
    host, and the container reads the same directory at the same path."""
    # The directory itself: the pusher's, 2770 with the pusher's group, made
    # (or set right) before every start by systemd-tmpfiles as root.
    assert f"StandardInputText=d {scratch} 2770 phaze phaze -\n" in text
    assert 'ExecStartPre=+"/usr/bin/systemd-tmpfiles" --create -\n' in text
    # The agent gets in through that group.
    assert "SupplementaryGroups=phaze\n" in text
    # Writable for it: that directory, and otherwise only its own state.
    assert re.findall(r"^ReadWritePaths=.*$", text, re.M) == [f"ReadWritePaths=-{scratch}"]
    assert re.findall(r"^StateDirectory=.*$", text, re.M) == [f"StateDirectory={state_directory}"]
    assert f'"--volume={scratch}:{scratch}"' in text
    assert f'Environment="PHAZE_CLOUD_SCRATCH_DIR={scratch}"' in text
    assert "/volumes" not in text and "/var/lib/private" not in text


def test_podman_agent_scratch_dir_under_var_lib_is_the_pushers_directory(tmp_path: Path) -> None:
    # Not a StateDirectory=: it is the pusher's directory, not the agent's
    # (and a DynamicUser= unit's would live in /var/lib/private, 0700 root).
    rendered = render(example(), "a1-arm64", facts("a1-arm64"), golden_plan())
    arm = next(a.content for a in rendered.artifacts if a.unit == "fabric-agent-a1-arm64.service")
    assert_scratch_dir_is_the_pushers_at_its_real_path(arm, "/var/lib/phaze/scratch", "fabric-agent-a1-arm64")
    assert "User=fabric-agent-a1-arm64\n" in arm and "DynamicUser=" not in arm


def test_podman_agent_scratch_dir_outside_var_lib_is_seen_at_its_real_path(tmp_path: Path) -> None:
    # issue 12: it was kept in /var/lib/fabric-agent-<id>/volumes/..., where
    # phaze's push never arrives.
    state = edited(
        tmp_path, 'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"', 'push_host = "x86-spill"\nscratch_dir = "/srv/scratch"'
    )
    rendered = render(state, "x86-spill", facts("x86-spill"), golden_plan())
    x86 = next(a.content for a in rendered.artifacts if a.unit == "fabric-agent-x86-spill.service")
    assert_scratch_dir_is_the_pushers_at_its_real_path(x86, "/srv/scratch", "fabric-agent-x86-spill")
    assert not any("/srv/scratch" in note for note in rendered.notes)


def test_a_compute_lane_without_ssh_user_and_no_fleet_default_is_refused_when_the_desired_state_loads(tmp_path: Path) -> None:
    # Its scratch dir must be given to the user phaze pushes as: the lane's
    # ssh_user, else [phaze] push_ssh_user; with neither, `fabric validate`
    # says so, before any host renders.
    text = (REPO / "hosts" / "fabric.toml").read_text()
    assert 'push_ssh_user = "phaze"\n' in text
    desired = tmp_path / "desired"
    shutil.copytree(REPO / "hosts", desired)
    (desired / "fabric.toml").write_text(
        text.replace('push_ssh_user = "phaze"\n', "").replace(
            'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"\nssh_user = "phaze"\n',
            'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"\n',
        )
    )
    with pytest.raises(DesiredStateError, match=r"fabric\.toml: backends\[1\]\.ssh_user: required for a compute lane unless \[phaze\] push_ssh_user"):
        load_desired(desired)


def test_a_compute_lane_without_ssh_user_uses_the_fleet_wide_push_ssh_user(tmp_path: Path) -> None:
    """multi-compute.md: ssh_user is optional. The fabric falls back to
    [phaze] push_ssh_user (phaze's file server's PHAZE_PUSH_SSH_USER) and
    writes it into backends.toml, so phaze pushes as the user the scratch dir
    is given to."""
    state = edited(
        tmp_path,
        'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"\nssh_user = "phaze"\n',
        'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"\n',
    )
    state = state.model_copy(
        update={"fleet": state.fleet.model_copy(update={"phaze": state.fleet.phaze.model_copy(update={"push_ssh_user": "pusher"})})}
    )
    backends = tomllib.loads(files(state, "lux")["etc/phaze/backends.toml"])["backends"]
    assert [b.get("ssh_user") for b in backends] == ["phaze", "pusher", None]
    agent = unit(files(state, "x86-spill"), "fabric-agent-x86-spill.service")
    assert "StandardInputText=d /var/lib/phaze/scratch 2770 pusher pusher -" in agent
    assert "SupplementaryGroups=pusher" in agent
