"""The `[ray]` table of fabric.toml and the Ray node units a pass renders from it.

The complete unit texts of the example fleet are golden files
(tests/golden/render/<host>/etc/systemd/system/fabric-ray-*.service,
test_render.py); these tests pin the rules one by one: which host runs which
node, the `ray start` flags from the node's probe and limits, the tailnet-only
head port, a node closed to new work, and that a change of tier restarts
that host's worker and nothing else.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reconciler.core.desired.load import DesiredStateError, load_desired
from reconciler.core.desired.model import DesiredState, HostFacts
from reconciler.core.live.host_limits import effective_limits
from reconciler.core.live.models import FleetPlan
from reconciler.core.live.records import NodeRecord
from reconciler.core.render.artifacts import Layout, render
from reconciler.core.render.ray_node import RAY_HEAD_UNIT, RAY_WORKER_UNIT, ray_node_spec, tier_resource
from reconciler.core.render.ray_units import RayStateSource, closed_reason, ray_labels, ray_state_source
from reconciler.core.scheduling.lifecycle import NodeState
from tests.conftest import REPO
from tests.support.fleet import Fleet, fabric_plan

EXAMPLE = REPO / "hosts"
PROBES = REPO / "tests" / "fixtures" / "probe"
GOLDEN_PLAN = REPO / "tests" / "golden" / "fleet-plan.json"
NOW = datetime(2026, 12, 1, 2, 0, tzinfo=UTC)


def probe(machine: str) -> HostFacts:
    return HostFacts.model_validate(json.loads((PROBES / machine / "expected.json").read_text()))


def plan() -> FleetPlan:
    return FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())


def copy_example(tmp_path: Path) -> Path:
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE, desired)
    return desired


def with_ray(tmp_path: Path, table: str | None) -> Path:
    """The example fleet with its [ray] table replaced by `table` (None: without one)."""
    desired = copy_example(tmp_path)
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    start = text.index("[ray]\n")
    end = text.index("\n\n", start) + 2
    fleet.write_text(text[:start] + (table + "\n\n" if table else "") + text[end:])
    return desired


def problems(directory: Path) -> list[tuple[str, str, str]]:
    with pytest.raises(DesiredStateError) as caught:
        load_desired(directory)
    return [(Path(p.file).name, p.path, p.reason) for p in caught.value.problems]


def ray_unit_text(state: DesiredState, host: str, facts: HostFacts | None = None, **kw: object) -> str | None:
    rendered = render(state, host, facts or probe(host), plan(), **kw)  # type: ignore[arg-type]
    texts = [a.content for a in rendered.artifacts if a.unit in (RAY_HEAD_UNIT, RAY_WORKER_UNIT)]
    assert len(texts) <= 1
    return texts[0] if texts else None


def argv(unit_text: str) -> list[str]:
    """ExecStart= as its words, unquoted (the renderer's quoting: C escapes in double quotes)."""
    line = next(line for line in unit_text.splitlines() if line.startswith("ExecStart="))
    return [json.loads(word.replace("%%", "%").replace("$$", "$")) for word in re.findall(r'"(?:\\.|[^"\\])*"', line)]


def flag(words: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    assert len(values) == 1, (name, words)
    return values[0]


# --------------------------------------------------------------------------
# [ray] in fabric.toml


def test_the_example_fleet_has_its_head_on_lux_and_three_workers() -> None:
    ray = load_desired(EXAMPLE).fleet.ray
    assert ray is not None
    assert (ray.head, ray.port, ray.workers, ray.dashboard, ray.command) == ("lux", 6379, ["qfox-1", "a1-arm64", "x86-spill"], True, None)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            '[ray]\nhead = "luxx"\nworkers = ["qfox-1"]',
            [("fabric.toml", "ray.head", "'luxx' is not a declared host; did you mean 'lux'?")],
        ),
        (
            '[ray]\nhead = "lux"\nworkers = ["qfox-1", "qfox-2"]',
            [("fabric.toml", "ray.workers[1]", "'qfox-2' is not a declared host; did you mean 'qfox-1'?")],
        ),
        (
            '[ray]\nhead = "lux"\nworkers = ["qfox-1", "lux"]',
            [("fabric.toml", "ray.workers", "'lux' is the head: it is a Ray node already and cannot also join as a worker")],
        ),
        (
            '[ray]\nhead = "lux"\nworkers = ["qfox-1", "x86-spill", "qfox-1"]',
            [("fabric.toml", "ray.workers", "qfox-1 is listed twice (workers[0] and workers[2])")],
        ),
        (
            '[ray]\nhead = "lux"\nport = 8701',
            [("fabric.toml", "ray.port", "8701 is service lupine's port (on the head 'lux')")],
        ),
        (
            '[ray]\nhead = "lux"\ndashboard = true\ndashboard_port = 6379',
            [("fabric.toml", "ray.dashboard_port", "6379 is the head's port")],
        ),
        (
            '[ray]\nhead = "lux"\ncommand = "ray"',
            [("fabric.toml", "ray.command", "'ray' must be an absolute path")],
        ),
    ],
)
def test_a_broken_ray_table_is_refused_with_file_key_path_and_reason(tmp_path: Path, table: str, expected: list[tuple[str, str, str]]) -> None:
    assert problems(with_ray(tmp_path, table)) == expected


def test_an_unknown_key_of_the_ray_table_is_refused(tmp_path: Path) -> None:
    found = problems(with_ray(tmp_path, '[ray]\nhead = "lux"\ndashbord = true'))
    assert [(file, path) for file, path, _ in found] == [("fabric.toml", "ray.dashbord")]


def test_fabric_validate_exits_2_on_a_broken_ray_table_and_names_file_and_key(tmp_path: Path) -> None:
    desired = with_ray(tmp_path, '[ray]\nhead = "lux"\nworkers = ["qfox-9"]')
    done = subprocess.run([sys.executable, "-m", "reconciler", "validate", "--desired", str(desired)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "fabric.toml" in done.stderr and "ray.workers[0]" in done.stderr and "'qfox-9' is not a declared host" in done.stderr


# --------------------------------------------------------------------------
# Which host runs which node


def test_the_head_runs_the_head_unit_each_worker_the_worker_unit_and_the_edge_none() -> None:
    state = load_desired(EXAMPLE)
    units = {
        host: sorted(a.unit for a in render(state, host, probe(host), plan()).artifacts if a.unit and "ray" in a.unit)
        for host in ("lux", "qfox-1", "a1-arm64", "x86-spill", "racknerd")
    }
    assert units == {
        "lux": [RAY_HEAD_UNIT],
        "qfox-1": [RAY_WORKER_UNIT],
        "a1-arm64": [RAY_WORKER_UNIT],
        "x86-spill": [RAY_WORKER_UNIT],
        "racknerd": [],
    }


def test_without_a_ray_table_no_host_runs_a_ray_node(tmp_path: Path) -> None:
    state = load_desired(with_ray(tmp_path, None))
    assert state.fleet.ray is None
    for host in ("lux", "qfox-1"):
        assert ray_unit_text(state, host) is None
        assert "6379" not in render(state, host, probe(host), plan()).artifacts[0].content


# --------------------------------------------------------------------------
# What the unit runs


def test_a_worker_offers_its_probe_and_limits_and_joins_the_heads_tailnet_address() -> None:
    state = load_desired(EXAMPLE)
    qfox = probe("qfox-1")
    text = ray_unit_text(state, "qfox-1", qfox, layout=Layout(ray="/opt/ray/bin/ray"))
    assert text is not None
    words = argv(text)
    assert words[:3] == ["/opt/ray/bin/ray", "start", "--block"]
    assert "--head" not in words
    spec = ray_node_spec("qfox-1", qfox, effective_limits(state.hosts["qfox-1"], qfox.limitations))
    # The host file's max_concurrent_tasks 4 bounds the probe's 5.
    assert spec.num_cpus == 4
    assert flag(words, "address") == "100.101.7.10:6379"  # lux's declared address, [ray] port
    assert flag(words, "node-ip-address") == "100.88.57.96"  # qfox-1's
    assert flag(words, "num-cpus") == "4"
    # Only the GPUs CUDA can use: qfox-1's RTX 4070, not its AMD Raphael iGPU
    # (Ray would hand out CUDA_VISIBLE_DEVICES=1, a device CUDA does not have).
    assert [gpu.tier for gpu in qfox.hardware.gpus].count("gpu_cuda") == 1 and len(qfox.hardware.gpus) == 2
    assert flag(words, "num-gpus") == "1"
    assert flag(words, "memory") == str(spec.memory_bytes)
    resources = json.loads(flag(words, "resources"))
    assert resources == spec.resources
    assert resources[tier_resource("gpu_cuda")] == 4.0 and resources[tier_resource("relay")] == 4.0
    assert flag(words, "labels") == ray_labels(spec.labels)
    labels = dict(pair.split("=") for pair in flag(words, "labels").split(","))
    assert labels["topology.researchstack.io/host"] == "qfox-1"
    assert labels["topology.researchstack.io/tier"] == "gpu_cuda"
    assert labels["topology.researchstack.io/gpu"] == "nvidia-rtx4070"  # Ray takes no ':' in a value
    assert labels["topology.researchstack.io/arch"] == "x86_64"
    assert flag(words, "temp-dir") == "/var/lib/fabric-ray-worker/tmp"
    assert "StateDirectory=fabric-ray-worker\n" in text and "DynamicUser=yes\n" in text
    # GPUs: the devices stay visible.
    assert "PrivateDevices=yes" not in text


def test_a_node_without_gpus_gets_private_devices() -> None:
    text = ray_unit_text(load_desired(EXAMPLE), "x86-spill")
    assert text is not None
    assert flag(argv(text), "num-gpus") == "0"
    assert "PrivateDevices=yes\n" in text


def test_the_head_listens_on_its_port_without_a_dashboard_and_keeps_the_port_to_the_tailnet(tmp_path: Path) -> None:
    state = load_desired(with_ray(tmp_path, '[ray]\nhead = "lux"\nworkers = ["qfox-1", "a1-arm64", "x86-spill"]'))
    text = ray_unit_text(state, "lux")
    assert text is not None
    words = argv(text)
    assert "--head" in words and flag(words, "port") == "6379" and flag(words, "include-dashboard") == "false"
    assert "--address" not in " ".join(words)
    assert flag(words, "node-ip-address") == "100.101.7.10"
    nft = {a.path: a.content for a in render(state, "lux", probe("lux"), plan()).artifacts}["etc/fabric/fabric.nft"]
    assert "ip saddr 100.64.0.0/10 tcp dport { 6379 } accept" in nft
    assert "tcp dport { 6379 } drop" in nft
    worker_nft = {a.path: a.content for a in render(state, "qfox-1", probe("qfox-1"), plan()).artifacts}["etc/fabric/fabric.nft"]
    assert "6379" not in worker_nft


def test_a_dashboard_asked_for_listens_on_the_tailnet_address_and_its_port_is_tailnet_only(tmp_path: Path) -> None:
    state = load_desired(with_ray(tmp_path, '[ray]\nhead = "lux"\nworkers = ["qfox-1"]\ndashboard = true\ncommand = "/opt/ray/bin/ray"'))
    text = ray_unit_text(state, "lux", layout=Layout(ray="/usr/bin/elsewhere"))
    assert text is not None
    words = argv(text)
    # [ray] command wins over the program found on PATH.
    assert words[0] == "/opt/ray/bin/ray"
    assert flag(words, "include-dashboard") == "true"
    assert flag(words, "dashboard-host") == "100.101.7.10" and flag(words, "dashboard-port") == "8265"
    nft = {a.path: a.content for a in render(state, "lux", probe("lux"), plan()).artifacts}["etc/fabric/fabric.nft"]
    assert "tcp dport { 6379, 8265 } drop" in nft


# --------------------------------------------------------------------------
# A node closed to new work


def node_state(**changes: object) -> NodeState:
    record = NodeRecord(node_id="qfox-1", tier="gpu_cuda", max_concurrent_tasks=4)
    return NodeState(node_id="qfox-1", status="active", since=NOW - timedelta(hours=1), record=record).model_copy(update=changes)


def test_a_drained_or_held_off_node_is_closed_and_an_open_one_is_not() -> None:
    assert closed_reason(None, NOW) is None
    assert closed_reason(node_state(), NOW) is None
    assert closed_reason(node_state(drained=True), NOW) == "drained"
    assert closed_reason(node_state(held_off_until=NOW + timedelta(minutes=5)), NOW) == "held off until 2026-12-01T02:05:00Z"
    # A hold-off that is over closes nothing.
    assert closed_reason(node_state(held_off_until=NOW - timedelta(seconds=1)), NOW) is None


def test_a_closed_worker_stays_in_the_cluster_offering_nothing_new() -> None:
    state = load_desired(EXAMPLE)
    rendered = render(state, "qfox-1", probe("qfox-1"), plan(), ray_closed="drained")
    text = next(a.content for a in rendered.artifacts if a.unit == RAY_WORKER_UNIT)
    words = argv(text)
    assert flag(words, "num-cpus") == "0" and flag(words, "num-gpus") == "0"
    assert json.loads(flag(words, "resources")) == {}
    # Still the same node: its labels and address stay, so a driver sees which host it is.
    assert "topology.researchstack.io/host=qfox-1" in flag(words, "labels")
    assert flag(words, "address") == "100.101.7.10:6379"
    assert "closed to new tasks: drained" in text
    assert f"{RAY_WORKER_UNIT}: closed to new Ray tasks (drained): no CPUs, GPUs or tiers offered" in rendered.notes


# --------------------------------------------------------------------------
# A change of tier restarts that host's worker only


def test_a_change_of_tier_restarts_only_that_hosts_ray_worker(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "qfox-1")
    replay = str(PROBES / "qfox-1")  # the CUDA desktop's capture: gpu_cuda
    assert fleet.reconcile(replay=replay).ok
    fleet.machine.forget_calls()
    # The operator pins qfox-1 below its probe's tier (the host file's [overrides]).
    host_file = fleet.desired / "qfox-1.toml"
    assert "overrides" not in tomllib.loads(host_file.read_text())
    host_file.write_text(host_file.read_text() + '\n[overrides]\ntier = "gpu_apu"\n')
    text = fabric_plan(fleet, replay=replay)
    assert "would restart the following units:\n  fabric-ray-worker.service\nwould" in text or text.endswith(
        "would restart the following units:\n  fabric-ray-worker.service\n"
    )
    assert fleet.reconcile(replay=replay).ok
    assert fleet.machine.calls == [("daemon-reload", ""), ("restart", RAY_WORKER_UNIT)]
    resources = json.loads(flag(argv((fleet.root / "etc/systemd/system" / RAY_WORKER_UNIT).read_text()), "resources"))
    assert tier_resource("gpu_cuda") not in resources and tier_resource("gpu_apu") in resources


# --------------------------------------------------------------------------
# Packaging: ray is the optional extra's, and only reconciler.ray may import it


def test_ray_is_only_the_optional_extra_and_the_contract_covers_every_package_but_reconciler_ray() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert not any(d.startswith("ray") for d in project["project"]["dependencies"])
    assert project["project"]["optional-dependencies"]["ray"] == ["ray[default]==2.60.0"]
    assert "ensure_venv test,ray" in (REPO / "scripts" / "test").read_text()
    contract = next(c for c in project["tool"]["importlinter"]["contracts"] if c["name"] == "only reconciler.ray imports ray")
    assert contract["type"] == "forbidden" and contract["forbidden_modules"] == ["ray"]
    packages = {
        f"reconciler.{p.stem if p.suffix == '.py' else p.name}"
        for p in (REPO / "reconciler").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert set(contract["source_modules"]) == packages - {"reconciler.ray"}


# --------------------------------------------------------------------------
# Where the leader reads Ray's state (fabric leader run without --ray-address)


def test_the_leader_reads_ray_from_the_heads_dashboard_on_its_tailnet_address(tmp_path: Path) -> None:
    state = load_desired(with_ray(tmp_path, '[ray]\nhead = "lux"\nworkers = ["qfox-1"]\ndashboard = true\ndashboard_port = 8299'))
    source = ray_state_source(state)
    assert source.address == f"http://{state.hosts['lux'].host.address}:8299" and source.note is None


def test_without_the_dashboard_the_leader_says_rays_tasks_are_not_in_the_load(tmp_path: Path) -> None:
    state = load_desired(with_ray(tmp_path, '[ray]\nhead = "lux"\nworkers = ["qfox-1"]\ndashboard = false'))
    source = ray_state_source(state)
    assert source.address is None
    assert source.note is not None and "ray.dashboard is off" in source.note and "not counted in the hosts' load" in source.note


def test_without_a_ray_table_there_is_no_ray_to_read(tmp_path: Path) -> None:
    assert ray_state_source(load_desired(with_ray(tmp_path, None))) == RayStateSource(None)
