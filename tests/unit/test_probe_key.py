"""The live probe's part of the pass memo's key (core.probe.facts_key, built without the models).

Two probes of an unchanged machine differ in their raw outputs (free memory,
CPU clocks, tailnet traffic counters and timestamps change every second):
their key must be the same, or a live pass would never be a memo hit. Anything
HostFacts are built from (a GPU, the memory size, the CPU count, the tailnet
name) must change it, or a memo hit would vouch for facts the machine no
longer has. Each case also checks HostFacts, so the key and the facts agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.core.probe import RawCapture, facts_from_capture, facts_key, parse_capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "probe"
# A GPU host on a tailnet: every kind of fact the tiering reads is in it.
MACHINE = "qfox-1"

Edit = Callable[[dict[str, str]], None]


def capture_of(machine: str = MACHINE) -> RawCapture:
    outputs, errors = CaptureDirectory().load(str(FIXTURES / machine))
    return RawCapture(dict(outputs), dict(errors))


def edited(edit: Edit, machine: str = MACHINE) -> RawCapture:
    original = capture_of(machine)
    outputs = dict(original.outputs)
    edit(outputs)
    return RawCapture(outputs, dict(original.errors))


def key(capture: RawCapture) -> str:
    return facts_key(parse_capture(capture))


def _meminfo_field(outputs: dict[str, str], name: str, kib: int) -> None:
    outputs["meminfo"] = re.sub(rf"^{name}:\s+\d+ kB$", f"{name}:       {kib} kB", outputs["meminfo"], count=1, flags=re.M)


def _tailscale(outputs: dict[str, str], change: Callable[[dict[str, Any]], None]) -> None:
    status = json.loads(outputs["tailscale.json"])
    change(status)
    outputs["tailscale.json"] = json.dumps(status, indent=2)


# --- what changes by itself on an unchanged machine ---------------------------


def free_memory_changes(outputs: dict[str, str]) -> None:
    for name, kib in (("MemFree", 9000001), ("MemAvailable", 18000003), ("Cached", 8100007), ("Buffers", 360011)):
        _meminfo_field(outputs, name, kib)


def cpu_clocks_change(outputs: dict[str, str]) -> None:
    outputs["cpuinfo"] = re.sub(r"^cpu MHz\t\t: [\d.]+$", "cpu MHz\t\t: 800.017", outputs["cpuinfo"], flags=re.M)
    outputs["cpuinfo"] = re.sub(r"^bogomips\t: [\d.]+$", "bogomips\t: 9380.11", outputs["cpuinfo"], flags=re.M)


def tailnet_counters_and_times_change(outputs: dict[str, str]) -> None:
    def bump(node: Any) -> None:
        if isinstance(node, dict):
            for field, value in node.items():
                if field in ("RxBytes", "TxBytes"):
                    node[field] = 987654321
                elif field in ("LastSeen", "LastHandshake", "LastWrite"):
                    node[field] = "2026-11-30T20:59:59.123456Z"
                else:
                    bump(value)
        elif isinstance(node, list):
            for item in node:
                bump(item)

    _tailscale(outputs, bump)


def all_volatile_values_change(outputs: dict[str, str]) -> None:
    free_memory_changes(outputs)
    cpu_clocks_change(outputs)
    tailnet_counters_and_times_change(outputs)


@pytest.mark.parametrize(
    "edit",
    [free_memory_changes, cpu_clocks_change, tailnet_counters_and_times_change, all_volatile_values_change],
    ids=["free-memory", "cpu-clocks", "tailnet-counters-and-times", "all-of-them"],
)
def test_the_key_stays_when_only_volatile_values_change(edit: Edit) -> None:
    first, second = capture_of(), edited(edit)
    assert first.outputs != second.outputs  # the edit did change the raw text
    assert key(second) == key(first)
    assert facts_from_capture(second, host=MACHINE) == facts_from_capture(first, host=MACHINE)


# --- what the tiering and the limits read -------------------------------------


def a_gpu_appears(outputs: dict[str, str]) -> None:
    outputs["nvidia-smi"] += "1, NVIDIA GeForce RTX 4090, 24564, 550.78, 00000000:02:00.0\n"


def memory_size_changes(outputs: dict[str, str]) -> None:
    _meminfo_field(outputs, "MemTotal", 15939584)


def cpu_count_changes(outputs: dict[str, str]) -> None:
    blocks = outputs["cpuinfo"].strip().split("\n\n")
    outputs["cpuinfo"] = "\n\n".join(blocks[: len(blocks) // 2]) + "\n"


def tailnet_name_changes(outputs: dict[str, str]) -> None:
    def rename(status: dict[str, Any]) -> None:
        status["Self"]["DNSName"] = "qfox-1.tail-def456.ts.net."

    _tailscale(outputs, rename)


@pytest.mark.parametrize(
    "edit",
    [a_gpu_appears, memory_size_changes, cpu_count_changes, tailnet_name_changes],
    ids=["a-gpu-appears", "memory-size", "cpu-count", "tailnet-name"],
)
def test_the_key_changes_with_what_the_facts_are_built_from(edit: Edit) -> None:
    first, second = capture_of(), edited(edit)
    assert facts_from_capture(second, host=MACHINE) != facts_from_capture(first, host=MACHINE)  # it matters
    assert key(second) != key(first)


def test_the_key_changes_when_a_source_goes_missing() -> None:
    """nvidia-smi stops answering (a driver update half done): the facts lose the GPU."""
    first = capture_of()
    second = RawCapture(first.outputs, {**first.errors, "nvidia-smi": "nvidia-smi: exit 9: NVIDIA-SMI has failed"})
    assert key(second) != key(first)


@pytest.mark.parametrize("machine", sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file()))
def test_every_fixture_machine_has_a_key_and_a_stable_one(machine: str) -> None:
    assert key(capture_of(machine)) == key(capture_of(machine))
