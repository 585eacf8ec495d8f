"""`fabric schedule` and `fabric dispatch` against saved snapshots (what-if).

The desired state is the example fleet in hosts/; snapshots are written to
tmp_path the way `fabric registry export` writes them.
"""

from __future__ import annotations

import json

import pytest

from reconciler.cli import main
from reconciler.core.live.models import FleetPlan
from tests.conftest import EXAMPLE_FLEET
from tests.support.cli import fabric

NODES = [
    {"node_id": "qfox-1", "tier": "gpu_cuda", "status": "active", "in_flight": 0, "max_concurrent_tasks": 4, "arch": "x86_64", "labels": {}},
    {"node_id": "x86-spill", "tier": "cpu_ffmpeg", "status": "active", "in_flight": 1, "max_concurrent_tasks": 4, "arch": "x86_64", "labels": {}},
    {"node_id": "a1-arm64", "tier": "cpu_ffmpeg", "status": "active", "in_flight": 0, "max_concurrent_tasks": 2, "arch": "aarch64", "labels": {}},
    {"node_id": "lux", "tier": "batch", "status": "active", "in_flight": 0, "max_concurrent_tasks": 2, "arch": "x86_64", "labels": {}},
]


def write_snapshot(tmp_path, nodes=NODES, lanes=(), name="snapshot.json", **extra):
    path = tmp_path / name
    path.write_text(json.dumps({"now": "2026-11-29T18:00:00Z", "nodes": list(nodes), "lanes": list(lanes), **extra}))
    return path


def offline(node_id):
    return [dict(n, status="offline") if n["node_id"] == node_id else n for n in NODES]


# --------------------------------------------------------------------------
# fabric schedule


def test_schedule_json_is_the_fleet_plan(tmp_path, capsys):
    nodes = [dict(n, units={"fabric-agent-a1-arm64.service": "failed"}) if n["node_id"] == "a1-arm64" else n for n in offline("qfox-1")]
    snap = write_snapshot(tmp_path, nodes=nodes, lanes=[{"id": "a1-arm64", "in_flight": 0}])
    code, out, err = fabric(capsys, "schedule", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), "--json")
    assert (code, err) == (0, "")
    plan = FleetPlan.model_validate_json(out)
    placed = {(p.service, p.replica): (p.node, p.tier, p.fallback) for p in plan.placements}
    # With the CUDA box offline: VA-API work falls to cpu_ffmpeg, CUDA-only
    # lupine is deferred (not inadmissible: the box exists).
    assert placed[("vaapi-encode", 0)][1:] == ("cpu_ffmpeg", True)
    assert ("lupine", 0) not in placed
    [deferred] = plan.deferred
    assert (deferred.service, deferred.inadmissible) == ("lupine", False)
    assert "qfox-1 offline" in deferred.reason
    assert [(lane.id, lane.available, lane.reason) for lane in plan.lanes] == [
        ("a1-arm64", False, "fabric-agent-a1-arm64.service failed"),
        ("x86-spill", True, None),
        ("local", True, None),
    ]
    assert plan.created.isoformat() == "2026-11-29T18:00:00+00:00"


def test_schedule_text_lists_placements_deferred_work_and_lanes(tmp_path, capsys):
    nodes = offline("qfox-1") + [{"node_id": "stranger", "tier": "gpu_cuda"}]
    snap = write_snapshot(tmp_path, nodes=nodes)
    code, out, _ = fabric(capsys, "schedule", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap))
    assert code == 0
    assert "plan at 2026-11-29T18:00:00Z, epoch 0, leader what-if, strategy highest_tier" in out
    assert "vaapi-encode[0]" in out and "fallback from gpu_vaapi" in out
    assert "deferred (1):\n  lupine[0]: no eligible node from gpu_cuda" in out
    assert "lanes (dispatch order):\n  compute  a1-arm64" in out
    assert "ignored nodes (not declared hosts): stranger" in out


def test_schedule_reads_the_live_registry_without_a_snapshot(tmp_path, capsys):
    # An empty registry: no node has registered, so everything is inadmissible,
    # but what a member of the example's worker group (batch) could run: that waits for one.
    code, out, err = fabric(capsys, "schedule", "--desired", str(EXAMPLE_FLEET), "--registry-path", str(tmp_path / "registry.sqlite"), "--json")
    assert (code, err) == (0, "")
    plan = FleetPlan.model_validate_json(out)
    assert plan.placements == []
    assert {d.service for d in plan.deferred} == {"lupine", "vaapi-encode", "flac-fft", "braid"}
    assert {d.service for d in plan.deferred if d.inadmissible} == {"lupine", "vaapi-encode", "braid"}
    assert all(d.reason.startswith("waits for a member of worker group batch") for d in plan.deferred if d.service == "flac-fft")


BAD_SNAPSHOTS = [
    ("syntax", '{"now": ', ["snapshot.json: line 1 column 9: JSON syntax error: Expecting value"]),
    ("not an object", "[]", ["snapshot.json: (top level): a snapshot is a JSON object, not list"]),
    ("unknown tier", json.dumps({"nodes": [{"node_id": "lux", "tier": "gpu_quantum"}]}), ["snapshot.json: nodes[0].tier: Input should be"]),
    ("missing node id", json.dumps({"nodes": [NODES[0], {"tier": "relay"}]}), ["snapshot.json: nodes[1].node_id: Field required"]),
    (
        "negative in flight",
        json.dumps({"lanes": [{"id": "local", "in_flight": -1}]}),
        ["snapshot.json: lanes[0].in_flight: Input should be greater than or equal to 0"],
    ),
    ("bad time", json.dumps({"now": "yesterday"}), ["snapshot.json: now: Input should be a valid datetime"]),
    (
        "two problems",
        json.dumps({"now": "yesterday", "nodes": [{"node_id": "lux"}]}),
        ["snapshot.json: now:", "snapshot.json: nodes[0].tier: Field required"],
    ),
]


@pytest.mark.parametrize("text, expected", [r[1:] for r in BAD_SNAPSHOTS], ids=[r[0] for r in BAD_SNAPSHOTS])
@pytest.mark.parametrize("command", [["schedule"], ["dispatch", "--min-tier", "batch"], ["dispatch", "--lane"]])
def test_bad_snapshot_names_file_and_key_path_and_exits_2(tmp_path, capsys, text, expected, command):
    path = tmp_path / "snapshot.json"
    path.write_text(text)
    code, out, err = fabric(capsys, *command, "--desired", str(EXAMPLE_FLEET), "--snapshot", str(path), "--json")
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(f"{tmp_path}/{start}")


def test_missing_snapshot_file(tmp_path, capsys):
    code, out, err = fabric(capsys, "schedule", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(tmp_path / "nope.json"))
    assert (code, out) == (2, "")
    assert err.strip() == f"{tmp_path}/nope.json: (file): not found"


def test_unknown_snapshot_keys_are_reported_but_not_fatal(tmp_path, capsys):
    snap = write_snapshot(tmp_path, nodes=[dict(NODES[3], in_fligth=2)], bogus=1)
    code, out, err = fabric(capsys, "dispatch", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), "--min-tier", "batch", "--json")
    assert code == 0
    assert f"{snap}: bogus: unknown key, ignored" in err
    assert f"{snap}: nodes[0].in_fligth: unknown key, ignored" in err


def test_invalid_desired_state_exits_2(tmp_path, capsys):
    (tmp_path / "fabric.toml").write_text("[fleet]\nname = 3\n")
    snap = write_snapshot(tmp_path)
    code, out, err = fabric(capsys, "schedule", "--desired", str(tmp_path), "--snapshot", str(snap))
    assert (code, out) == (2, "")
    assert "fabric.toml: fleet" in err


# --------------------------------------------------------------------------
# fabric dispatch --min-tier


def limit(nodes, node_id, max_concurrent_tasks):
    return [dict(n, max_concurrent_tasks=max_concurrent_tasks) if n["node_id"] == node_id else n for n in nodes]


# The example fleet's services hold their slots first. All up: lupine,
# vaapi-encode, braid and flac-fft[0] fill qfox-1 (4/4), flac-fft[1] goes to
# a1-arm64 (0/2 beats x86-spill's 1/4). CUDA box offline: vaapi-encode ->
# a1-arm64, braid -> x86-spill, flac-fft[0] -> a1-arm64 (1/2 ties 2/4, id),
# flac-fft[1] -> x86-spill: a1-arm64 2/2, x86-spill 3/4.
DISPATCH_TABLE = [
    # (id, nodes, args, expected JSON)
    (
        "highest tier with a free slot",
        limit(NODES, "qfox-1", 6),
        ["--min-tier", "gpu_apu"],
        {"node": "qfox-1", "tier": "gpu_cuda", "fallback": False},
    ),
    # The host files' cost classes decide within a tier: a1-arm64 is free, x86-spill paid.
    ("CUDA box full: falls back", NODES, ["--min-tier", "gpu_apu"], {"node": "a1-arm64", "tier": "cpu_ffmpeg", "fallback": True}),
    ("CUDA box offline: falls back", offline("qfox-1"), ["--min-tier", "gpu_apu"], {"node": "x86-spill", "tier": "cpu_ffmpeg", "fallback": True}),
    (
        "arch restriction",
        # The free a1-arm64 takes the services qfox-1 cannot (four): room for one more.
        limit(offline("qfox-1"), "a1-arm64", 5),
        ["--min-tier", "cpu_ffmpeg", "--arch", "aarch64"],
        {"node": "a1-arm64", "tier": "cpu_ffmpeg", "fallback": False},
    ),
    (
        "arch restriction, that node full: below the fallback tiers",
        offline("qfox-1"),
        ["--min-tier", "cpu_ffmpeg", "--arch", "aarch64", "--floor", "cpu_ffmpeg"],
        {
            "node": None,
            "status": "deferred",
            "reason": "no eligible node from gpu_cuda..cpu_ffmpeg (min_tier cpu_ffmpeg, floor cpu_ffmpeg; arch [aarch64]): "
            "gpu_cuda: qfox-1 offline; cpu_ffmpeg: a1-arm64 full 2/2, x86-spill arch x86_64 not in [aarch64]; no node at gpu_vaapi, gpu_apu",
        },
    ),
    (
        "hard fail without CUDA",
        offline("qfox-1"),
        ["--min-tier", "gpu_cuda", "--floor", "gpu_cuda"],
        {
            "node": None,
            "status": "deferred",
            "reason": "no eligible node from gpu_cuda (min_tier gpu_cuda, floor gpu_cuda): gpu_cuda: qfox-1 offline",
        },
    ),
    (
        "inadmissible label",
        NODES,
        ["--min-tier", "relay", "--label", "zone=mars"],
        {
            "node": None,
            "status": "deferred",
            "reason": "inadmissible: no node in the fleet has tier relay or better with labels {zone=mars} (min_tier relay, floor relay); tiers present: gpu_cuda, cpu_ffmpeg, batch",
        },
    ),
]


@pytest.mark.parametrize("nodes, args, expected", [r[1:] for r in DISPATCH_TABLE], ids=[r[0] for r in DISPATCH_TABLE])
def test_dispatch_min_tier(tmp_path, capsys, nodes, args, expected):
    snap = write_snapshot(tmp_path, nodes=nodes)
    code, out, err = fabric(capsys, "dispatch", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), *args, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == expected


def test_dispatch_text(tmp_path, capsys):
    snap = write_snapshot(tmp_path, nodes=offline("qfox-1"))
    code, out, _ = fabric(capsys, "dispatch", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), "--min-tier", "gpu_apu")
    assert (code, out) == (0, "x86-spill (cpu_ffmpeg, fallback)\n")


# --------------------------------------------------------------------------
# fabric dispatch --lane


LANE_TABLE = [
    ("cheapest lane", [], [], {"lane": "a1-arm64", "hold": None}),
    ("a1 offline: x86", ["a1-arm64"], [], {"lane": "x86-spill", "hold": None}),
    (
        "cloud full: hold",
        [{"id": "a1-arm64", "in_flight": 2}, {"id": "x86-spill", "in_flight": 4}],
        [],
        {"lane": None, "hold": "local_spill_not_reached"},
    ),
    (
        "cloud full, waited: local",
        [{"id": "a1-arm64", "in_flight": 2}, {"id": "x86-spill", "in_flight": 4}],
        ["--waited-s", "900"],
        {"lane": "local", "hold": None},
    ),
    (
        "cloud offline: local at once",
        ["a1-arm64", "x86-spill"],
        [],
        {"lane": "local", "hold": None},
    ),
    ("attempts spent: local", [], ["--attempts", "3"], {"lane": "local", "hold": None}),
    ("attempts spent, local full", [{"id": "local", "in_flight": 1}], ["--attempts", "3"], {"lane": None, "hold": "cloud_attempts_exhausted"}),
    (
        "all full",
        [{"id": "a1-arm64", "in_flight": 2}, {"id": "x86-spill", "in_flight": 4}, {"id": "local", "in_flight": 1}],
        ["--waited-s", "5000"],
        {"lane": None, "hold": "no_free_slots"},
    ),
]


@pytest.mark.parametrize("lanes, args, expected", [r[1:] for r in LANE_TABLE], ids=[r[0] for r in LANE_TABLE])
def test_dispatch_lane(tmp_path, capsys, lanes, args, expected):
    """`lanes`: jobs running per lane, or the hosts that are offline (their lanes with them)."""
    down = [host for host in lanes if isinstance(host, str)]
    nodes = [dict(n, status="offline") if n["node_id"] in down else n for n in NODES]
    snap = write_snapshot(tmp_path, nodes=nodes, lanes=[lane for lane in lanes if isinstance(lane, dict)])
    code, out, err = fabric(capsys, "dispatch", "--lane", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), *args, "--json")
    assert (code, err) == (0, "")
    assert json.loads(out) == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min-tier", "cpu_ffmpeg", "--floor", "gpu_cuda"], "--floor gpu_cuda is above --min-tier cpu_ffmpeg"),
        (["--lane", "--floor", "relay"], "--floor: only with --min-tier"),
        (["--min-tier", "relay", "--attempts", "1"], "--attempts: only with --lane"),
        (["--lane", "--waited-s", "-1"], "must not be negative"),
        (["--lane", "--min-tier", "relay"], "not allowed with argument"),
        ([], "one of the arguments --min-tier --lane is required"),
        (["--min-tier", "gpu_quantum"], "invalid choice"),
        (["--min-tier", "relay", "--label", "zone"], "is not KEY=VALUE"),
    ],
)
def test_dispatch_bad_arguments_exit_2(tmp_path, capsys, args, message):
    snap = write_snapshot(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["dispatch", "--desired", str(EXAMPLE_FLEET), "--snapshot", str(snap), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
