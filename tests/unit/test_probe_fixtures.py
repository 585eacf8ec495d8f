"""Probe fixtures: raw outputs of real machines, turned into tests automatically.

Every directory under tests/fixtures/probe/ is one machine: its raw files
under the fixed capture names (DESIGN.md "Probe"), optionally errors.json (why
an absent file is absent), and expected.json (the whole HostFacts the probe
must derive). Adding a directory adds its tests; no code changes.

To add a machine: `fabric probe --capture DIR` on it (or write the files by
hand), then `fabric probe --replay DIR --json > DIR/expected.json` and read
expected.json line by line before committing it.
"""

from __future__ import annotations

import json
import tomllib

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.probe.facts import ERRORS_FILE, FACTS, RAW_NAMES
from reconciler.core.probe.identity import probed_tailnet_name, tailnet_name_note
from reconciler.core.probe.raw import parse_capture
from tests.conftest import EXAMPLE_FLEET
from tests.support.probe_fixtures import EXPECTED, FIXTURES, MACHINES, expected_facts, load_capture

# Where a fixture's raw files come from (a published output, or assembled).
NOTE = "NOTE"
# The hosts of the example fleet: the fleet end-to-end tests replay these.
FLEET_HOSTS = ("qfox-1", "a1-arm64", "x86-spill", "lux", "racknerd")


RAW_CASES = [
    pytest.param(machine, raw, id=f"{machine}/{raw}")
    for machine in MACHINES
    for raw in RAW_NAMES
    if (FIXTURES / machine / raw).is_file() or raw in load_capture(machine).errors
]


def test_there_are_fixtures_for_every_kind_of_machine():
    assert set(FLEET_HOSTS) <= set(MACHINES)
    assert len(MACHINES) >= 10
    assert len(RAW_CASES) >= 100


@pytest.mark.parametrize("machine", MACHINES)
def test_fixture_holds_only_known_files(machine):
    names = {p.name for p in (FIXTURES / machine).iterdir()}
    unknown = names - set(RAW_NAMES) - {ERRORS_FILE, EXPECTED, NOTE}
    assert not unknown, f"not raw probe names (typo?): {sorted(unknown)}"
    errors = load_capture(machine).errors
    assert set(errors) <= set(RAW_NAMES), "errors.json names a file that is not a raw probe name"


@pytest.mark.parametrize(("machine", "raw"), RAW_CASES)
def test_raw_output_parses_as_the_machine_expects(machine, raw):
    """One raw output through its own parser: usable exactly when expected.json
    has the fact, absent with exactly the recorded reason when it does not."""
    capture = load_capture(machine)
    fact = next(f for f in FACTS if f.raw == raw)
    alone = RawCapture(
        {raw: capture.outputs[raw]} if raw in capture.outputs else {},
        {raw: capture.errors[raw]} if raw in capture.errors else {},
    )
    parsed = parse_capture(alone, (fact,))
    expected_missing = expected_facts(machine)["missing"]
    if fact.name in expected_missing:
        assert parsed.missing == {fact.name: expected_missing[fact.name]}
        assert fact.name not in parsed.values
    else:
        assert parsed.missing == {}
        assert parsed.values[fact.name] is not None


@pytest.mark.parametrize("machine", MACHINES)
def test_machine_probes_to_its_expected_facts(machine):
    facts = facts_from_capture(load_capture(machine))
    assert facts.model_dump(mode="json") == expected_facts(machine)
    # expected.json is itself a valid HostFacts document (what the registry stores).
    assert HostFacts.model_validate(expected_facts(machine)) == facts


@pytest.mark.parametrize("machine", MACHINES)
def test_every_absent_fact_says_why(machine):
    facts = HostFacts.model_validate(expected_facts(machine))
    parsed = parse_capture(load_capture(machine))
    assert set(parsed.missing) <= set(facts.missing)
    for fact in FACTS:
        assert (fact.name in parsed.values) != (fact.name in facts.missing)
    assert all(reason.strip() for reason in facts.missing.values())


@pytest.mark.parametrize("host", FLEET_HOSTS)
def test_fleet_host_capture_matches_its_host_file(host):
    """The e2e fleet replays these captures for the example hosts: each must
    name itself as the host file does and sit at its declared tailnet address."""
    declared = tomllib.loads((EXAMPLE_FLEET / f"{host}.toml").read_text())["host"]
    facts = HostFacts.model_validate(expected_facts(host))
    assert facts.k3s_hostname == host
    assert facts.tailscale_ip == declared["address"]
    assert facts.tailnet_name == declared["tailnet_name"]
    assert facts.labels["topology.researchstack.io/role"] == f"auto:{host}"


# ---------------------------------------------------------------- without pciutils

BOTH_PCI_SOURCES = [m for m in MACHINES if (FIXTURES / m / "lspci").is_file() and (FIXTURES / m / "sysfs-pci").is_file()]
NO_LSPCI = ("rx6600-debian-no-lspci", "intel-adl-laptop-no-lspci", "ryzen-780m-no-lspci", "pi-zero-framebuffer")


def _gpu_view(facts: HostFacts) -> list[tuple]:
    return [(g.vendor, g.pci_slot, g.render_node, g.integrated, g.tier) for g in facts.hardware.gpus]


def _unusable_gpus(facts: HostFacts) -> set[str]:
    return {key for key in facts.missing if key.startswith("gpu ")}


def test_some_machines_have_both_pci_sources():
    assert {"qfox-1", "radeon-desktop", "amd-apu-laptop", "intel-nuc", "multi-gpu-server"} <= set(BOTH_PCI_SOURCES)


@pytest.mark.parametrize("machine", BOTH_PCI_SOURCES)
def test_without_lspci_sysfs_finds_the_same_gpus(machine):
    """Drop lspci from a machine that has both: the same GPUs (vendor, slot,
    render node, integrated, tier), the same unusable ones, the same tier."""
    capture = load_capture(machine)
    with_lspci = facts_from_capture(capture)
    without = facts_from_capture(
        RawCapture(
            {k: v for k, v in capture.outputs.items() if k != "lspci"},
            {**{k: v for k, v in capture.errors.items() if k != "lspci"}, "lspci": "lspci: not installed"},
        )
    )
    assert _gpu_view(without) == _gpu_view(with_lspci)
    assert _unusable_gpus(without) == _unusable_gpus(with_lspci)
    assert without.tier == with_lspci.tier
    assert without.hardware.ffmpeg == with_lspci.hardware.ffmpeg
    assert without.missing["pci"] == "lspci: not installed"


@pytest.mark.parametrize("machine", NO_LSPCI)
def test_machines_without_pciutils_are_not_relays(machine):
    assert not (FIXTURES / machine / "lspci").is_file()
    assert (FIXTURES / machine / NOTE).is_file(), "say where the raw files come from"
    facts = HostFacts.model_validate(expected_facts(machine))
    expected_tier = {
        "rx6600-debian-no-lspci": "gpu_vaapi",
        "intel-adl-laptop-no-lspci": "gpu_apu",
        "ryzen-780m-no-lspci": "gpu_apu",
        "pi-zero-framebuffer": "framebuffer",
    }[machine]
    assert facts.tier == expected_tier
    if machine != "pi-zero-framebuffer":
        [gpu] = facts.hardware.gpus
        assert gpu.integrated == (expected_tier == "gpu_apu")


# ---------------------------------------------------------------- tailnet name


def test_the_tailnet_name_keeps_its_json_key_node_id():
    """Operators' scripts read `fabric probe --json`'s node_id: the attribute's
    rename to tailnet_name does not change the document."""
    facts = facts_from_capture(load_capture("qfox-1"))
    document = json.loads(facts.model_dump_json())
    assert document["node_id"] == facts.tailnet_name == "qfox-1.tail-abc123.ts.net"
    assert "tailnet_name" not in document and "tailnet_name" not in facts.model_dump(by_alias=True)
    assert HostFacts.model_validate_json(facts.model_dump_json()) == facts
    assert facts.model_copy(update={"tailnet_name": "x.ts.net"}).tailnet_name == "x.ts.net"


@pytest.mark.parametrize("host", FLEET_HOSTS)
def test_a_fleet_host_probing_as_itself_gets_no_tailnet_name_note(host):
    facts = facts_from_capture(load_capture(host), host=host)
    assert probed_tailnet_name(facts) == f"{host}.tail-abc123.ts.net"
    assert tailnet_name_note(load_desired(EXAMPLE_FLEET), host, facts) is None


def test_a_probe_of_another_machine_names_both_tailnet_names():
    facts = facts_from_capture(load_capture("lux"), host="qfox-1")
    note = tailnet_name_note(load_desired(EXAMPLE_FLEET), "qfox-1", facts)
    assert note is not None
    assert "'lux.tail-abc123.ts.net'" in note and "tailnet_name 'qfox-1.tail-abc123.ts.net'" in note


def test_no_tailnet_name_note_when_either_name_is_unknown():
    desired = load_desired(EXAMPLE_FLEET)
    # No Tailscale on the machine: the probe reports its host name instead.
    offline = facts_from_capture(load_capture("amd-apu-laptop"), host="qfox-1")
    assert probed_tailnet_name(offline) is None
    assert tailnet_name_note(desired, "qfox-1", offline) is None
    # Nothing declared in the host file.
    qfox = desired.hosts["qfox-1"]
    undeclared = desired.model_copy(
        update={"hosts": {**desired.hosts, "qfox-1": qfox.model_copy(update={"host": qfox.host.model_copy(update={"tailnet_name": None})})}}
    )
    assert tailnet_name_note(undeclared, "qfox-1", facts_from_capture(load_capture("lux"), host="qfox-1")) is None
