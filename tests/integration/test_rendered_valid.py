"""What render.py produces for the example fleet passes the real checks the
pass runs before activating anything, through the real adapters:

- every unit of every host: `systemd-analyze verify` (SystemdAnalyzeVerifier,
  strict: any diagnostic about our units fails). systemd checks that each
  ExecStart= program exists, so the check runs in a private mount namespace
  where the fleet's programs (/opt/researchstack/bin/*, podman) exist as stubs;
  nothing reaches the host's file system.
- every host's ruleset: `nft -c -f` and two loads in a fresh network namespace
  (the second one changes nothing), leaving another table untouched;
- the edge's complete Caddy config: `caddy validate`, inside a network
  namespace of its own so its health checkers reach nobody.

Each check is also shown to fail on a broken input, so a check that passes
everything cannot hide here.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import pytest

from reconciler.adapters.caddy import CaddyAdmin
from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.nftables import NftCommand
from reconciler.adapters.unit_verify import SystemdAnalyzeVerifier
from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import Artifact, complete_caddy_config, render
from reconciler.ports import ActivationError, CommandResult
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.netns import network_lab

pytestmark = pytest.mark.integration

HOSTS = ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"]
GOLDEN_PLAN = REPO / "tests" / "golden" / "fleet-plan.json"


def rendered(host: str, plan: FleetPlan | None = None) -> list[Artifact]:
    state = load_desired(EXAMPLE_FLEET)
    arch = "aarch64" if host == "a1-arm64" else "x86_64"
    facts = HostFacts(node_id=host, k3s_hostname=host, hardware=Hardware(arch=arch), tier="cpu_ffmpeg")
    plan = plan or FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())
    return list(render(state, host, facts, plan).artifacts)


class PrefixRunner:
    """A CommandRunner that runs every command behind an argv prefix."""

    def __init__(self, prefix: Sequence[str]) -> None:
        self.prefix = list(prefix)
        self.inner = SubprocessRunner()

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        return self.inner.run([*self.prefix, *argv], timeout=timeout, stdin=stdin)


def stub_programs_prefix(work: Path, programs: Sequence[str]) -> list[str]:
    """argv prefix: a private mount namespace in which `programs` exist as
    executable stubs (a tmpfs over /opt, an overlay over the directory of any
    other program), then the command."""
    work.mkdir(parents=True, exist_ok=True)
    lines = ["set -e", "mount -t tmpfs tmpfs /opt"]
    overlays: dict[str, list[str]] = {}
    for program in programs:
        directory, name = program.rsplit("/", 1)
        if directory.startswith("/opt/"):
            lines += [f"mkdir -p {shlex.quote(directory)}", f"printf '#!/bin/sh\\n' > {shlex.quote(program)}", f"chmod +x {shlex.quote(program)}"]
        else:
            overlays.setdefault(directory, []).append(name)
    for index, (directory, names) in enumerate(sorted(overlays.items())):
        upper, scratch = work / f"upper{index}", work / f"work{index}"
        upper.mkdir()
        scratch.mkdir()
        for name in names:
            stub = upper / name
            stub.write_text("#!/bin/sh\n")
            stub.chmod(0o755)
        lines.append(f"mount -t overlay overlay -o lowerdir={directory},upperdir={upper},workdir={scratch} {directory}")
    lines.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines), "stub-programs"]


def write_units(directory: Path, artifacts: list[Artifact]) -> list[str]:
    paths = []
    for a in artifacts:
        if a.kind == "unit":
            path = directory / a.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(a.content)
            paths.append(str(path))
    return paths


def executables(artifacts: list[Artifact]) -> set[str]:
    """The programs the units start: the first word of ExecStart= and friends."""
    found = set()
    for a in artifacts:
        for line in a.content.splitlines():
            if line.startswith(("ExecStartPre=", "ExecStart=", "ExecStop=", "ExecStopPost=", "ExecReload=")):
                first = line.split("=", 1)[1].split()[0].lstrip("+-").strip('"')
                found.add(first)
    return found


@pytest.mark.parametrize("host", HOSTS)
def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path, host: str) -> None:
    require_root()
    require("systemd-analyze", "unshare", "mount")
    artifacts = rendered(host)
    paths = write_units(tmp_path / "generation", artifacts)
    assert paths
    missing = sorted(p for p in executables(artifacts) if not Path(p).exists())
    verifier = SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs", missing)))
    verifier.verify(paths)


CO_LOCATED_LANE = """[[backends]]
kind = "compute"
id = "a1-arm64-b"
rank = 15
cap = 1
agent_ref = "a1-arm64-b"
push_host = "a1-arm64"
scratch_dir = "/var/lib/phaze/scratch-b"
ssh_user = "phaze"
token_file = "/run/keys/phaze-b.token"

"""


def test_co_located_agent_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """Two agents on a1-arm64 (the second with its own token_file): both
    units, with their own credentials, state directories and container names,
    pass the real check."""
    require_root()
    require("systemd-analyze", "unshare", "mount")
    desired = tmp_path / "desired"
    desired.mkdir()
    for f in EXAMPLE_FLEET.glob("*.toml"):
        (desired / f.name).write_text(f.read_text())
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    assert "# --- Tier 2" in text
    fleet.write_text(text.replace("# --- Tier 2", CO_LOCATED_LANE + "# --- Tier 2", 1))
    facts = HostFacts(node_id="a1-arm64", k3s_hostname="a1-arm64", hardware=Hardware(arch="aarch64"), tier="cpu_ffmpeg")
    artifacts = list(render(load_desired(desired), "a1-arm64", facts, FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())).artifacts)
    agents = sorted(a.unit for a in artifacts if a.unit and a.unit.startswith("fabric-agent-a1-arm64"))
    assert agents == ["fabric-agent-a1-arm64-b.service", "fabric-agent-a1-arm64.service"]
    paths = write_units(tmp_path / "generation", [a for a in artifacts if a.unit in agents])
    missing = sorted(p for p in executables(artifacts) if not Path(p).exists())
    SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs", missing))).verify(paths)
    # The check sees these units: one broken setting in the second fails it.
    second = Path(next(p for p in paths if p.endswith("fabric-agent-a1-arm64-b.service")))
    second.write_text(
        second.read_text().replace(
            "LoadCredential=phaze_agent_token_file:/run/keys/phaze-b.token", "LoadCredential=phaze_agent_token_file:relative/token"
        )
    )
    with pytest.raises(ActivationError, match="fabric-agent-a1-arm64-b.service"):
        SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs2", missing))).verify(paths)


def test_agent_unit_with_a_scratch_dir_outside_var_lib_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """x86-spill's scratch_dir moved to /srv/scratch: the unit that creates it
    (systemd-tmpfiles from StandardInputText=), joins its group and writes
    it passes the real check, and a broken path in those lines fails it."""
    require_root()
    require("systemd-analyze", "unshare", "mount")
    desired = tmp_path / "desired"
    desired.mkdir()
    for f in EXAMPLE_FLEET.glob("*.toml"):
        (desired / f.name).write_text(f.read_text())
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    old = 'push_host = "x86-spill"\nscratch_dir = "/var/lib/phaze/scratch"'
    assert old in text
    fleet.write_text(text.replace(old, 'push_host = "x86-spill"\nscratch_dir = "/srv/scratch"'))
    facts = HostFacts(node_id="x86-spill", k3s_hostname="x86-spill", hardware=Hardware(arch="x86_64"), tier="cpu_ffmpeg")
    artifacts = list(render(load_desired(desired), "x86-spill", facts, FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())).artifacts)
    agent = next(a for a in artifacts if a.unit == "fabric-agent-x86-spill.service")
    assert "ReadWritePaths=-/srv/scratch\n" in agent.content
    paths = write_units(tmp_path / "generation", [agent])
    missing = sorted(p for p in executables([agent]) if not Path(p).exists())
    SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs", missing))).verify(paths)
    # The check reads these lines: a relative scratch path fails it.
    Path(paths[0]).write_text(agent.content.replace("ReadWritePaths=-/srv/scratch", "ReadWritePaths=-srv/scratch"))
    with pytest.raises(ActivationError, match="fabric-agent-x86-spill.service"):
        SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs2", missing))).verify(paths)


def test_verify_rejects_a_broken_rendered_unit(tmp_path: Path) -> None:
    require_root()
    require("systemd-analyze", "unshare", "mount")
    artifacts = rendered("racknerd")
    paths = write_units(tmp_path / "generation", artifacts)
    broken = Path(next(p for p in paths if "fabric-socat-qfox-ssh" in p))
    broken.write_text(broken.read_text().replace("ProtectSystem=strict", "ProtectSystem=very"))
    verifier = SystemdAnalyzeVerifier(PrefixRunner(stub_programs_prefix(tmp_path / "stubs", [])))
    with pytest.raises(ActivationError, match="protect system value"):
        verifier.verify(paths)
    # And without the stubs, a missing program is a failure too.
    lupine = write_units(tmp_path / "qfox", rendered("qfox-1"))
    with pytest.raises(ActivationError, match="lupine-server"):
        SystemdAnalyzeVerifier(SubprocessRunner()).verify(lupine)


def test_rendered_rulesets_check_and_load_idempotently_without_touching_other_tables() -> None:
    require_root()
    require("ip", "nft")
    with network_lab() as lab:
        for host in HOSTS:
            ns = lab.namespace(host[:8])
            ns.check(
                "nft",
                "-f",
                "-",
                input="table ip other {\n\tchain keep {\n\t\ttype filter hook input priority 0; policy accept;\n\t\ttcp dport 9999 counter\n\t}\n}\n",
            )
            other_before = ns.check("nft", "list", "table", "ip", "other")
            ruleset = next(a for a in rendered(host) if a.kind == "nft").content
            nft = NftCommand(SubprocessRunner(), prefix=ns.exec_prefix)
            nft.check(ruleset)
            nft.apply(ruleset)
            first = ns.check("nft", "list", "table", "inet", "fabric")
            nft.apply(ruleset)
            # The file itself is idempotent too, loaded without the adapter's help.
            ns.check("nft", "-f", "-", input=ruleset)
            assert ns.check("nft", "list", "table", "inet", "fabric") == first
            assert ns.check("nft", "list", "table", "ip", "other") == other_before
            assert sorted(line for line in ns.check("nft", "list", "tables").splitlines() if line) == ["table inet fabric", "table ip other"]
        broken = next(a for a in rendered("qfox-1") if a.kind == "nft").content.replace("policy accept;", "policy acept;", 1)
        assert "acept" in broken
        with pytest.raises(ActivationError):
            NftCommand(SubprocessRunner(), prefix=ns.exec_prefix).check(broken)


def test_edge_caddy_config_validates_with_and_without_placements() -> None:
    require_root()
    require("ip", "caddy")
    plan = FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())
    unplaced = plan.model_copy(update={"placements": []})
    with network_lab() as lab:
        ns = lab.namespace("edge")
        caddy = CaddyAdmin(
            PrefixRunner([*ns.exec_prefix, "env", f"XDG_CONFIG_HOME=/tmp/fabric-caddy-{ns.name}", f"XDG_DATA_HOME=/tmp/fabric-caddy-{ns.name}"])
        )
        for p in (plan, unplaced):
            config = next(a for a in rendered("racknerd", p) if a.kind == "caddy").content
            assert ("reverse_proxy" in config) == (p is plan)
            caddy.validate(config)
        # The complete config of an edge whose main Caddyfile imports the snippet.
        main = "{\n\tadmin localhost:2019\n\tauto_https off\n}\nown.example:8080 {\n\trespond ok\n}\nimport /etc/caddy/fabric.caddy\n"
        complete = complete_caddy_config(main, "etc/caddy/fabric.caddy", config)
        assert "own.example:8080" in complete and "braid.researchstack.info" in complete
        caddy.validate(complete)
        with pytest.raises(ActivationError):
            caddy.validate(config.replace("respond", "respnod", 1))


def test_systemd_runs_a_rendered_unit_with_exactly_the_declared_argv_and_environment(tmp_path: Path) -> None:
    """Quoting checked by the real parser: systemd as PID 1 starts a rendered
    service whose argv and environment hold quotes, %, $, backslashes and
    spaces; the program writes down what it received (in its StateDirectory:
    the sandbox lets it write nowhere else)."""
    require_root()
    require("unshare", "nsenter", "chroot", "python3")
    from reconciler.core.desired.load import load_desired as load
    from tests.support.harness.systemd import systemd_container
    from tests.support.harness.waiting import wait_until

    nasty = ['say "hi"', "100% $HOME ${X} %n", "back\\slash\\", "  spaced  ", "'single'"]
    dump = "import json,os,sys; json.dump([sys.argv[1:], os.environ.get('NOTE')], open('seen.json','w'))"
    argv = ["/usr/bin/python3", "-c", dump, *nasty]
    toml_argv = ", ".join(json_string(a) for a in argv)
    desired = tmp_path / "desired"
    desired.mkdir()
    for f in EXAMPLE_FLEET.glob("*.toml"):
        (desired / f.name).write_text(f.read_text())
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    old = 'command = { x86_64 = ["/opt/researchstack/bin/lupine-server", "--port", "8701"] }\nenvironment = { LUPINE_MODEL_DIR = "/var/lib/lupine/models" }'
    assert old in text
    note = 'a "note" with 50% \\ and $PATH'
    fleet.write_text(text.replace(old, f"command = {{ x86_64 = [{toml_argv}] }}\nenvironment = {{ NOTE = {json_string(note)} }}"))
    state = load(desired)
    facts = HostFacts(node_id="qfox-1", k3s_hostname="qfox-1", hardware=Hardware(arch="x86_64"), tier="gpu_cuda")
    plan = FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())
    lupine = next(a for a in render(state, "qfox-1", facts, plan).artifacts if a.path.endswith("fabric-agent-lupine.service"))
    with systemd_container() as container:
        container.write_file("/etc/systemd/system/fabric-agent-lupine.service", lupine.content)
        assert container.systemctl("daemon-reload").returncode == 0
        started = container.systemctl("start", "fabric-agent-lupine.service")
        assert started.returncode == 0, started.stderr
        seen = wait_until(lambda: container.run("cat", "/var/lib/fabric-lupine/seen.json").stdout, what="the service's record of its argv")
    assert json.loads(seen) == [nasty, note]


def json_string(value: str) -> str:
    """A TOML basic string (JSON's escaping is a subset TOML accepts)."""
    return json.dumps(value)
