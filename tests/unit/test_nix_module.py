"""The NixOS module, the flake and the Python unit definitions agree.

Every .nix file must parse. modules/fabric.nix is evaluated offline (nix-instantiate
with tests/unit/nix/eval-module.nix standing in for nixpkgs' lib and pkgs) and
its fabric-reconcile service and timer and fabric-leader service are compared
with reconciler/core/install/units.py, the definitions `scripts/join.sh` installs: command,
timer and every hardening setting. A change on one side only fails here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from reconciler.cli import main
from reconciler.core.install.nodeconfig import NodeConfig
from reconciler.core.install.units import (
    DAEMON_HARDENING,
    HARDENING,
    PASS_DIRECTORIES,
    PASS_HARDENING,
    PASS_HOME,
    Install,
    bootstrap_service,
    leader_service,
    reconcile_service,
    reconcile_timer,
    watch_service,
)
from reconciler.core.pass_files import TEXTFILE_PATH
from tests.conftest import REPO, require

EVAL_MODULE = REPO / "tests" / "unit" / "nix" / "eval-module.nix"
MODULE = REPO / "modules" / "fabric.nix"
PACKAGE = "/nix/store/11111111111111111111111111111111-fabric-reconciler-0.1.0"
NODE_TOML = "/etc/fabric/node.toml"

# Settings a unit may give several times: a single Nix string is one of them.
LIST_KEYS = {"ReadWritePaths", "ReadOnlyPaths", "SystemCallFilter", "ExecStartPre"}
STAMP = "/var/lib/fabric/bootstrap.stamp"


def nix_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.nix"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(REPO / p for p in out)


def nix_eval(expr_file: Path, *, args: dict[str, str] | None = None, attr_expr: str | None = None) -> object:
    require("nix-instantiate")
    argv = ["nix-instantiate", "--eval", "--strict", "--json", "--store", "dummy://"]
    for name, value in (args or {}).items():
        argv += ["--arg", name, value]
    if attr_expr is not None:
        argv += ["-E", attr_expr]
    else:
        argv.append(str(expr_file))
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def nix_value(value: object) -> str:
    """A Nix value as systemd writes it into a unit (NixOS: true -> "true")."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    return str(value)


def normalized(config: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, list):
            out[key] = tuple(nix_value(v) for v in value)
        elif key in LIST_KEYS:
            out[key] = (nix_value(value),)
        else:
            out[key] = nix_value(value)
    return out


def nix_environment(service: dict) -> dict[str, tuple[str, ...]]:
    """NixOS writes `environment` as Environment= lines (PATH comes from `path`)."""
    env = service.get("environment", {})
    return {"Environment": tuple(f"{k}={v}" for k, v in sorted(env.items()))} if env else {}


def evaluate(user: str, **flags: str) -> dict:
    """The module evaluated with `services.fabric = { enable = true; package = ...; } // user`."""
    config = f'{{ enable = true; package = {{ outPath = "{PACKAGE}"; }}; }} // ({user})'
    args = {"module": str(MODULE), "userConfig": config, **flags}
    result = nix_eval(EVAL_MODULE, args=args)
    assert isinstance(result, dict)
    return result


def python_install(module_result: dict) -> Install:
    """What join.sh would install for the node.toml the module renders."""
    node = NodeConfig.model_validate(module_result["node"])
    return Install(fabric_bin=f"{PACKAGE}/bin/fabric", node=node, config_path=NODE_TOML)


CONFIGS = {
    "defaults": ("{ }", {}),
    "edge-with-git": (
        '{ hostName = "racknerd"; interval = "45s"; randomizedDelaySec = "10s";'
        ' desired.git = { remote = "git@github.com:researchstack/fleet.git"; branch = "prod";'
        ' sshKeyFile = "/etc/fabric/deploy-key"; requireSignedCommits = true;'
        ' sshHostKey = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";'
        ' allowedSignersFile = "/etc/fabric/allowed_signers"; }; }',
        {"caddyEnable": "true"},
    ),
    "leader-local-path": (
        '{ hostName = "lux"; leaderCandidate = true; desired.path = "/srv/fleet"; unitDir = "/etc/systemd/system.control";'
        ' registry.sqlitePath = "/var/lib/fabric/registry.sqlite"; }',
        {"tailscaleEnable": "true"},
    ),
}


# --------------------------------------------------------------------------


def test_every_nix_file_parses() -> None:
    require("nix-instantiate")
    files = nix_files()
    names = {str(f.relative_to(REPO)) for f in files}
    assert {"flake.nix", "modules/fabric.nix", "nix/package.nix", "nix/vm-test.nix"} <= names
    for path in files:
        proc = subprocess.run(["nix-instantiate", "--parse", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reconcile_service_matches_python_definition(name: str) -> None:
    user, flags = CONFIGS[name]
    result = evaluate(user, **flags)
    nix_service = result["services"]["fabric-reconcile"]
    python_unit = reconcile_service(python_install(result)).values("Service")
    assert normalized(nix_service["serviceConfig"]) | nix_environment(nix_service) == python_unit
    # No start rate limit on either side (units.PASS_START_LIMIT_INTERVAL).
    python_unit_section = reconcile_service(python_install(result)).values("Unit")
    assert normalized(nix_service["unitConfig"])["StartLimitIntervalSec"] == python_unit_section["StartLimitIntervalSec"] == "0"
    # A switch never restarts or stops a pass.
    assert nix_service["restartIfChanged"] is False
    assert nix_service["stopIfChanged"] is False


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reconcile_timer_matches_python_definition(name: str) -> None:
    user, flags = CONFIGS[name]
    result = evaluate(user, **flags)
    nix_timer = result["timers"]["fabric-reconcile"]
    python_timer = reconcile_timer(python_install(result))
    assert normalized(nix_timer["timerConfig"]) == python_timer.values("Timer")
    assert nix_timer["wantedBy"] == [python_timer.values("Install")["WantedBy"]]


def test_leader_service_only_on_candidates_and_matches_python() -> None:
    assert "fabric-leader" not in evaluate("{ }")["services"]
    user, flags = CONFIGS["leader-local-path"]
    result = evaluate(user, **flags)
    nix_leader = result["services"]["fabric-leader"]
    python_leader = leader_service(python_install(result)).values("Service")
    assert normalized(nix_leader["serviceConfig"]) | nix_environment(nix_leader) == python_leader


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_watch_service_on_every_host_matches_python(name: str) -> None:
    user, flags = CONFIGS[name]
    result = evaluate(user, **flags)
    nix_watch = result["services"]["fabric-watch"]
    python_watch = watch_service(python_install(result))
    assert normalized(nix_watch["serviceConfig"]) | nix_environment(nix_watch) == python_watch.values("Service")
    assert nix_watch["wantedBy"] == [python_watch.values("Install")["WantedBy"]]


def test_hardening_is_shared_and_complete() -> None:
    result = evaluate("{ }")
    service_config = normalized(result["services"]["fabric-reconcile"]["serviceConfig"])
    for key, value in PASS_HARDENING.items():
        assert service_config[key] == value, key
    # The probe must see GPUs: no PrivateDevices in the pass on either side.
    assert "PrivateDevices" not in service_config
    for key, value in HARDENING.items():
        assert PASS_HARDENING[key] == value, key
    watch_config = normalized(result["services"]["fabric-watch"]["serviceConfig"])
    for key, value in DAEMON_HARDENING.items():
        assert watch_config[key] == value, key
    assert "ReadWritePaths" not in watch_config


def test_settings_reach_node_toml_and_the_command() -> None:
    result = evaluate(CONFIGS["edge-with-git"][0])
    node = NodeConfig.model_validate(result["node"])
    assert node.node.host == "racknerd"
    assert node.node.unit_dir == "/run/systemd/system"
    assert node.source is not None and node.source.branch == "prod" and node.source.require_signed_commits
    assert node.timer.interval == "45s"
    service = result["services"]["fabric-reconcile"]["serviceConfig"]
    assert service["ExecStart"].split() == [
        f"{PACKAGE}/bin/fabric",
        "reconcile",
        "--desired",
        "/var/lib/fabric/desired",
        "--unit-dir",
        "/run/systemd/system",
        "--host",
        "racknerd",
    ]
    assert service["ExecStartPre"].split() == [f"{PACKAGE}/bin/fabric", "pull", "--config", NODE_TOML]
    assert result["timers"]["fabric-reconcile"]["timerConfig"]["OnUnitActiveSec"] == "45s"


def test_free_form_settings_override_the_options() -> None:
    result = evaluate(
        '{ settings.timer.interval = "2min"; settings.bootstrap.k3s_server = "https://100.101.7.10:6443";'
        ' settings.bootstrap.k3s_token_file = "/run/secrets/k3s-token"; }'
    )
    node = NodeConfig.model_validate(result["node"])
    assert node.timer.interval == "2min"
    assert node.bootstrap.k3s_token_file == "/run/secrets/k3s-token"
    assert result["timers"]["fabric-reconcile"]["timerConfig"]["OnUnitActiveSec"] == "2min"


def test_no_pull_without_a_git_remote() -> None:
    result = evaluate("{ }")
    assert "ExecStartPre" not in result["services"]["fabric-reconcile"]["serviceConfig"]
    assert "source" not in result["node"]


def test_signed_commits_need_allowed_signers() -> None:
    result = evaluate('{ desired.git = { remote = "/srv/fleet.git"; requireSignedCommits = true; }; }')
    assert [a["assertion"] for a in result["assertions"]] == [True, True, False]
    # On by default: a remote alone is refused until signers are named or signing is turned off in so many words.
    result = evaluate('{ desired.git.remote = "/srv/fleet.git"; }')
    assert [a["assertion"] for a in result["assertions"]] == [True, True, False]
    result = evaluate('{ desired.git = { remote = "/srv/fleet.git"; requireSignedCommits = false; }; }')
    assert all(a["assertion"] for a in result["assertions"])
    assert NodeConfig.model_validate(result["node"]).source.require_signed_commits is False  # type: ignore[union-attr]
    result = evaluate(CONFIGS["edge-with-git"][0])
    assert all(a["assertion"] for a in result["assertions"])


def test_git_checkout_must_be_in_the_state_directory() -> None:
    result = evaluate('{ desired = { path = "/srv/fleet"; git = { remote = "/srv/fleet.git"; requireSignedCommits = false; }; }; }')
    assert [a["assertion"] for a in result["assertions"]] == [True, False, True]
    with pytest.raises(ValidationError, match="the checkout must be inside node.state_dir"):
        NodeConfig.model_validate(result["node"])


def test_caddy_and_nftables_integration() -> None:
    plain = evaluate("{ }")
    assert plain["flushRuleset"] is False
    assert plain["caddyExtraConfig"] is None
    with_caddy = evaluate("{ }", caddyEnable="true")
    assert with_caddy["caddyExtraConfig"].strip() == "import /etc/caddy/fabric*.caddy"
    kept = evaluate("{ nftables.keepFabricTable = false; }")
    assert kept["flushRuleset"] is None
    trusted = evaluate("{ trustTailnet = true; }", tailscaleEnable="true")
    assert trusted["trustedInterfaces"] == ["tailscale0"]


def test_pass_path_has_the_programs_it_calls() -> None:
    path = evaluate("{ }", tailscaleEnable="true")["services"]["fabric-reconcile"]["path"]
    names = {p.split("-", 1)[1] for p in path}
    assert {"nftables", "caddy", "git", "openssh", "socat", "iproute2", "systemd", "tailscale"} <= names
    without_tailscale = evaluate("{ }")["services"]["fabric-reconcile"]["path"]
    assert not any(p.endswith("-tailscale") for p in without_tailscale)


def test_the_ray_package_goes_on_the_pass_path_only_when_given() -> None:
    ray = "/nix/store/22222222222222222222222222222222-ray-2.60.0"
    path = evaluate(f'{{ ray.package = {{ outPath = "{ray}"; name = "ray"; }}; }}')["services"]["fabric-reconcile"]["path"]
    assert ray in path
    assert not any("-ray" in p for p in evaluate("{ }")["services"]["fabric-reconcile"]["path"])


def test_flake_outputs_for_both_systems() -> None:
    expr = f"""
    let
      flake = import {REPO}/flake.nix;
      stubLib = {{ genAttrs = names: f: builtins.listToAttrs (map (n: {{ name = n; value = f n; }}) names); mkDefault = x: x; }};
      stubPkgs = system: {{
        inherit system;
        stdenv.hostPlatform.system = system;
        callPackage = path: args: {{ package = path; }};
        testers.runNixOSTest = test: {{ vmTest = test; }};
        mkShell = args: args;
        python3.withPackages = f: "python";
      }};
      nixpkgs = {{ lib = stubLib; legacyPackages = stubLib.genAttrs [ "x86_64-linux" "aarch64-linux" ] stubPkgs; }};
      outputs = flake.outputs {{ self = outputs; inherit nixpkgs; }};
      module = outputs.nixosModules.default {{ lib = stubLib; pkgs = stubPkgs "aarch64-linux"; }};
    in {{
      inputs = builtins.attrNames flake.inputs;
      packages = builtins.mapAttrs (_: builtins.attrNames) outputs.packages;
      packageFile = map toString [ outputs.packages.x86_64-linux.default.package ];
      checks = builtins.mapAttrs (_: builtins.attrNames) outputs.checks;
      devShells = builtins.mapAttrs (_: builtins.attrNames) outputs.devShells;
      formatter = builtins.attrNames outputs.formatter;
      moduleImports = map toString module.imports;
      modulePackage = toString module.services.fabric.package.package;
    }}
    """
    result = nix_eval(Path("-"), attr_expr=expr)
    systems = ["aarch64-linux", "x86_64-linux"]
    assert result["inputs"] == ["nixpkgs"]
    assert result["packages"] == {s: ["default", "fabric"] for s in systems}
    assert result["packageFile"] == [str(REPO / "nix" / "package.nix")]
    assert result["checks"] == {s: ["package", "vm"] for s in systems}
    assert result["devShells"] == {s: ["default"] for s in systems}
    assert result["formatter"] == systems
    assert result["moduleImports"] == [str(MODULE)]
    assert result["modulePackage"] == str(REPO / "nix" / "package.nix")


def test_vm_test_has_a_leader_and_an_edge_checking_the_pass_and_the_journal() -> None:
    expr = f"""
    let
      test = import {REPO}/nix/vm-test.nix {{ self = {{ nixosModules.default = {{ }}; }}; }} {{
        hostPkgs = {{ runCommand = name: env: script: "/nix/store/fleet"; }};
      }};
    in {{ nodes = builtins.attrNames test.nodes; script = test.testScript; name = test.name; }}
    """
    result = nix_eval(Path("-"), attr_expr=expr)
    assert result["nodes"] == ["lux", "racknerd"]
    for needle in ("systemctl status fabric-reconcile.timer", "journalctl -t fabric-reconcile", "ExecMainStatus", "nft list table inet fabric"):
        assert needle in result["script"], needle


def test_leader_needs_a_host_name_on_both_sides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = evaluate("{ hostName = null; leaderCandidate = true; }")
    assert [a["assertion"] for a in result["assertions"]] == [False, True, True]
    assert main(["units", "--config", str(tmp_path / "absent.toml"), "--fabric-bin", "/opt/fabric/bin/fabric", "--leader-candidate"]) == 2
    assert "node.host: required for fabric-leader.service" in capsys.readouterr().err


def test_registry_file_reaches_both_services() -> None:
    user, flags = CONFIGS["leader-local-path"]
    result = evaluate(user, **flags)
    for name in ("fabric-reconcile", "fabric-leader"):
        assert result["services"][name]["environment"] == {"FABRIC_REGISTRY": "/var/lib/fabric/registry.sqlite", "HOME": PASS_HOME}
    assert evaluate("{ }")["services"]["fabric-reconcile"]["environment"] == {"HOME": PASS_HOME}


def test_directories_a_pass_writes_exist_on_both_install_paths() -> None:
    rules = evaluate("{ }")["tmpfiles"]
    assert {r.split()[1] for r in rules} == set(PASS_DIRECTORIES)
    assert all(r.startswith("d ") for r in rules)
    assert "d /etc/caddy 0755 root root -" in evaluate("{ }", caddyEnable="true")["tmpfiles"]
    join = (REPO / "scripts" / "join.sh").read_text()
    mkdir = next(line for line in join.splitlines() if line.startswith("mkdir -p /etc/fabric"))
    assert set(PASS_DIRECTORIES) <= set(mkdir.split())


def test_node_exporter_reads_the_textfile_each_pass_writes() -> None:
    flag = f"--collector.textfile.directory=/{TEXTFILE_PATH.rsplit('/', 1)[0]}"
    assert evaluate("{ }", nodeExporterEnable="true")["nodeExporterFlags"] == [flag]
    assert evaluate("{ }")["nodeExporterFlags"] == []
    assert evaluate("{ nodeExporterTextfile = false; }", nodeExporterEnable="true")["nodeExporterFlags"] == []
    # The directory exists on a NixOS host before the first pass writes it.
    assert f"d /{TEXTFILE_PATH.rsplit('/', 1)[0]} 0755 root root -" in evaluate("{ }")["tmpfiles"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bootstrap_service_matches_python_and_runs_once_before_the_pass(name: str) -> None:
    """fabric-bootstrap.service: the same command and settings on both install
    paths; skipped while its stamp exists; after the network (and tailscaled,
    when this host runs Tailscale), before the pass, wanted at boot."""
    user, flags = CONFIGS[name]
    result = evaluate(user, **flags)
    nix_boot = result["services"]["fabric-bootstrap"]
    python_boot = bootstrap_service(python_install(result))
    assert normalized(nix_boot["serviceConfig"]) | nix_environment(nix_boot) == python_boot.values("Service")
    assert nix_boot["serviceConfig"]["ExecStart"].split()[1:] == ["bootstrap", "--config", NODE_TOML, "--first-boot"]
    unit = python_boot.values("Unit")
    assert nix_boot["unitConfig"]["ConditionPathExists"] == unit["ConditionPathExists"] == f"!{STAMP}"
    assert nix_boot["wantedBy"] == [python_boot.values("Install")["WantedBy"]] == ["multi-user.target"]
    assert nix_boot["wants"] == list(unit["Wants"]) == ["network-online.target"]
    assert nix_boot["before"] == list(unit["Before"]) == ["fabric-reconcile.service"]
    tailscale = flags.get("tailscaleEnable") == "true"
    assert nix_boot["after"] == ["network-online.target", *(["tailscaled.service"] if tailscale else [])]
    # join.sh's unit: tailscaled always named (After= on a unit not installed orders nothing).
    assert unit["After"] == ("network-online.target", "tailscaled.service")
    assert nix_boot["restartIfChanged"] is False


def test_the_bootstrap_unit_can_be_turned_off() -> None:
    assert "fabric-bootstrap" not in evaluate("{ bootstrap.enable = false; }")["services"]
    assert "fabric-bootstrap" in evaluate("{ }")["services"]
