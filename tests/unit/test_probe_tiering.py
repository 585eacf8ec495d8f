"""Tiering, labels, limitations and probe damping (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from reconciler.core.desired.model import TIER_SCORE, Gpu, HostFacts, LabelKey, LabelValue
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.probe.damping import DEMOTE_AFTER_PASSES, ProbeHistory, damp
from reconciler.core.probe.parsers import (
    BlockDisk,
    DriNodes,
    Encoder,
    NvidiaGpu,
    NvidiaReport,
    PciDisplay,
    SysfsPci,
    SysfsPciDevice,
    VaDevice,
    VaInfo,
)
from reconciler.core.probe.raw import ParsedFacts
from reconciler.core.probe.tiering import (
    LABEL_PREFIX,
    build_node_facts,
    gpu_slug,
    limitations_for,
    storage_type,
    usable_hardware_encoders,
)
from tests.support.probe_fixtures import MACHINES, load_capture

LABELS = TypeAdapter(dict[LabelKey, LabelValue])
T0 = datetime(2026, 6, 1, 4, 0, tzinfo=UTC)


@pytest.mark.parametrize("machine", MACHINES)
def test_labels_satisfy_the_label_rules_and_follow_the_seed(machine):
    facts = facts_from_capture(load_capture(machine))
    LABELS.validate_python(facts.labels)
    assert all(key.startswith(LABEL_PREFIX) for key in facts.labels)
    assert facts.labels[f"{LABEL_PREFIX}tier"] == facts.tier
    assert facts.labels[f"{LABEL_PREFIX}network"] == ("tailscale" if facts.tailscale_ip else "none")
    assert 1 <= facts.limitations.max_concurrent_tasks <= facts.limitations.max_concurrent_ceiling


def test_qfox_1_gets_the_seed_labels_exactly():
    facts = facts_from_capture(load_capture("qfox-1"))
    assert facts.labels == {
        "topology.researchstack.io/role": "auto:qfox-1",
        "topology.researchstack.io/tier": "gpu_cuda",
        "topology.researchstack.io/gpu": "nvidia:rtx4070",
        "topology.researchstack.io/arm64": "false",
        "topology.researchstack.io/storage-tier": "nvme-ssd",
        "topology.researchstack.io/network": "tailscale",
    }
    assert facts.os is not None and facts.os.arch_based


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("NVIDIA GeForce RTX 4070", "rtx4070"),
        ("NVIDIA RTX A6000", "rtxa6000"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
        ("Tesla T4", "teslat4"),
        ("AMD Radeon RX 6600/6600 XT/6600M", "rx6600"),
        ("AMD Radeon 680M", "680m"),
        ("AMD Raphael", "raphael"),
        ("Intel Iris Xe Graphics", "irisxe"),
        ("Intel Arc A770 Graphics", "arca770"),
        ("AMD Radeon Graphics", "amdradeongraphics"),
    ],
)
def test_gpu_slug(model, slug):
    assert gpu_slug(model) == slug
    LABELS.validate_python({"k": f"nvidia:{slug}"})


def test_host_name_given_by_the_fleet_replaces_the_machine_name():
    facts = facts_from_capture(load_capture("amd-apu-laptop"), host="qfox-1")
    assert facts.k3s_hostname == "qfox-1" and facts.tailnet_name == "qfox-1"
    assert facts.labels[f"{LABEL_PREFIX}role"] == "auto:qfox-1"


# ---------------------------------------------------------------- tier rule

NVIDIA = PciDisplay("0000:01:00.0", "0300", "10de", "NVIDIA Corporation", "2786", "AD104 [GeForce RTX 4070]")
RX6600 = PciDisplay("0000:03:00.0", "0300", "1002", "Advanced Micro Devices, Inc. [AMD/ATI]", "73ff", "Navi 23 [Radeon RX 6600/6600 XT/6600M]")
RAPHAEL = PciDisplay("0000:0e:00.0", "0300", "1002", "Advanced Micro Devices, Inc. [AMD/ATI]", "164e", "Raphael")
UHD = PciDisplay("0000:00:02.0", "0300", "8086", "Intel Corporation", "4692", "AlderLake-S GT1")
ARC = PciDisplay("0000:03:00.0", "0300", "8086", "Intel Corporation", "56a0", "DG2 [Arc A770]")
ENCODE = VaDevice("renderD128", "Mesa", ("VAProfileH264Main", "VAProfileHEVCMain"))
FFMPEG = (
    Encoder("libx264", "V"),
    Encoder("h264_nvenc", "V"),
    Encoder("h264_vaapi", "V"),
    Encoder("av1_vaapi", "V"),
    Encoder("h264_qsv", "V"),
    Encoder("h264_amf", "V"),
    Encoder("h264_v4l2m2m", "V"),
    Encoder("aac", "A"),
)


def _parsed(pci=(), nvidia=None, render=None, va=None, ffmpeg=FFMPEG, missing=None):
    values = {"pci": tuple(pci), "ffmpeg": ffmpeg, "cpu": 8, "memory": 16000, "arch": "x86_64", "hostname": "box"}
    if nvidia is not None:
        values["nvidia"] = nvidia
    if render is not None:
        values["dri"] = DriNodes(tuple(sorted(set(render.values()))), (), render)
    if va is not None:
        values["vainfo"] = va
    if ffmpeg is None:
        del values["ffmpeg"]
    return ParsedFacts({k: v for k, v in values.items() if v is not None}, dict(missing or {}))


def _gpu_tiers(facts: HostFacts) -> list[tuple[str, str]]:
    return [(g.pci_slot, g.tier) for g in facts.hardware.gpus]


def test_nvidia_listed_by_nvidia_smi_is_gpu_cuda():
    smi = NvidiaReport((NvidiaGpu(0, "NVIDIA GeForce RTX 4070", 12282, "550.78", "0000:01:00.0"),))
    facts = build_node_facts(_parsed([NVIDIA], smi))
    assert facts.tier == "gpu_cuda" and _gpu_tiers(facts) == [("0000:01:00.0", "gpu_cuda")]
    assert facts.hardware.ffmpeg == ["h264_nvenc"]


def test_nvidia_that_nvidia_smi_does_not_answer_for_is_not_usable():
    facts = build_node_facts(_parsed([NVIDIA], missing={"nvidia": "nvidia-smi: timed out"}))
    assert facts.tier == "cpu_ffmpeg" and facts.hardware.gpus == []
    assert facts.missing["gpu 0000:01:00.0"] == "NVIDIA GeForce RTX 4070: no working NVIDIA driver (nvidia-smi: timed out)"


def test_discrete_amd_with_va_api_encode_is_gpu_vaapi():
    facts = build_node_facts(_parsed([RX6600], render={RX6600.slot: "renderD128"}, va=VaInfo((ENCODE,))))
    assert facts.tier == "gpu_vaapi"
    assert facts.hardware.ffmpeg == ["h264_vaapi"]  # no AV1 encode entrypoint, no Intel for qsv, amf unverifiable


def test_discrete_intel_arc_with_va_api_encode_is_gpu_vaapi_and_may_use_qsv():
    facts = build_node_facts(_parsed([ARC], render={ARC.slot: "renderD128"}, va=VaInfo((ENCODE,))))
    assert facts.tier == "gpu_vaapi" and not facts.hardware.gpus[0].integrated
    assert facts.hardware.ffmpeg == ["h264_qsv", "h264_vaapi"]


def test_discrete_gpu_without_va_api_encode_counts_as_gpu_apu_and_says_why():
    facts = build_node_facts(_parsed([RX6600], render={RX6600.slot: "renderD128"}, missing={"vainfo": "vainfo: not installed"}))
    assert facts.tier == "gpu_apu"
    assert any("no VA-API encode (vainfo: not installed)" in note for note in facts.limitations.notes)


@pytest.mark.parametrize("igpu", [RAPHAEL, UHD])
def test_integrated_gpu_with_render_node_is_gpu_apu_even_with_encode(igpu):
    facts = build_node_facts(_parsed([igpu], render={igpu.slot: "renderD128"}, va=VaInfo((ENCODE,))))
    assert facts.tier == "gpu_apu" and facts.hardware.gpus[0].integrated


def test_gpu_without_render_node_is_not_usable():
    facts = build_node_facts(_parsed([RAPHAEL], render={}))
    assert facts.tier == "cpu_ffmpeg"
    assert facts.missing["gpu 0000:0e:00.0"].endswith("no render node in /dev/dri (no kernel driver bound)")


def test_best_gpu_decides_the_tier_and_the_gpu_label():
    smi = NvidiaReport((NvidiaGpu(0, "NVIDIA GeForce RTX 4070", 12282, "550.78", "0000:01:00.0"),))
    facts = build_node_facts(_parsed([RAPHAEL, NVIDIA], smi, render={RAPHAEL.slot: "renderD129", NVIDIA.slot: "renderD128"}))
    assert _gpu_tiers(facts) == [("0000:01:00.0", "gpu_cuda"), ("0000:0e:00.0", "gpu_apu")]
    assert facts.labels[f"{LABEL_PREFIX}gpu"] == "nvidia:rtx4070"


def test_no_gpu_and_no_ffmpeg_is_relay():
    assert build_node_facts(_parsed(ffmpeg=None, missing={"ffmpeg": "ffmpeg: not installed"})).tier == "relay"
    assert build_node_facts(_parsed()).tier == "cpu_ffmpeg"


def test_a_vps_ffmpeg_lists_hardware_encoders_it_cannot_drive():
    assert usable_hardware_encoders(FFMPEG, [], None) == []


@pytest.mark.parametrize(
    ("disk", "kind"),
    [
        (BlockDisk("nvme0n1", 1, False, "nvme", ("/",)), "nvme"),
        (BlockDisk("sda", 1, False, "sata", ()), "ssd"),
        (BlockDisk("sdb", 1, True, "sata", ()), "hdd"),
        (BlockDisk("vda", 1, True, None, ("/",)), "other"),
        (BlockDisk("sda", 1, True, "iscsi", ("/",)), "other"),
        (BlockDisk("sdc", 1, None, "usb", ()), "other"),
    ],
)
def test_storage_type(disk, kind):
    assert storage_type(disk) == kind


# ---------------------------------------------------------------- limitations


def _cuda(vram):
    return [Gpu(vendor="nvidia", model="x", vram_mib=v, integrated=False, tier="gpu_cuda") for v in vram]


def test_limitations_of_the_seed_desktop():
    limits = limitations_for(12, 31132, "gpu_cuda", _cuda([12282]))
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling, limits.vram_mib) == (5, 5, 12282)


def test_limitations_without_known_cores_or_memory_are_one_task():
    limits = limitations_for(None, None, "relay", [])
    assert (limits.max_concurrent_tasks, limits.max_concurrent_ceiling) == (1, 1)


@settings(max_examples=200, deadline=None)
@given(
    cores=st.integers(1, 256),
    memory=st.integers(256, 2_000_000),
    vram=st.lists(st.integers(256, 200_000), max_size=8),
    more_cores=st.integers(0, 64),
    more_memory=st.integers(0, 100_000),
)
def test_limitations_are_bounded_and_monotonic(cores, memory, vram, more_cores, more_memory):
    tier = "gpu_cuda" if vram else "cpu_ffmpeg"
    limits = limitations_for(cores, memory, tier, _cuda(vram))
    bigger = limitations_for(cores + more_cores, memory + more_memory, tier, _cuda(vram))
    assert 1 <= limits.max_concurrent_tasks <= limits.max_concurrent_ceiling
    assert limits.max_concurrent_ceiling <= max(1, cores)
    assert bigger.max_concurrent_tasks >= limits.max_concurrent_tasks
    assert bigger.max_concurrent_ceiling >= limits.max_concurrent_ceiling


# ---------------------------------------------------------------- damping


def _qfox(nvidia_answers: bool = True, memory_kb: int | None = None) -> HostFacts:
    capture = load_capture("qfox-1")
    outputs, errors = dict(capture.outputs), dict(capture.errors)
    if not nvidia_answers:
        del outputs["nvidia-smi"]
        errors["nvidia-smi"] = "nvidia-smi: timed out"
    if memory_kb is not None:
        outputs["meminfo"] = f"MemTotal: {memory_kb} kB\n"
    return facts_from_capture(RawCapture(outputs, errors))


def test_one_missed_probe_does_not_demote():
    good, blip = _qfox(), _qfox(nvidia_answers=False, memory_kb=30_000_000)
    assert blip.tier == "gpu_apu"
    _, history = damp(ProbeHistory(), good, T0)
    effective, history = damp(history, blip, T0 + timedelta(seconds=30))
    assert effective.tier == "gpu_cuda"
    assert effective.hardware.gpus == good.hardware.gpus and effective.hardware.ffmpeg == good.hardware.ffmpeg
    assert effective.labels[f"{LABEL_PREFIX}gpu"] == "nvidia:rtx4070"
    assert effective.labels[f"{LABEL_PREFIX}tier"] == "gpu_cuda"
    # What is not a capability is the fresh observation, reasons included.
    assert effective.hardware.memory_mib == 29296
    assert effective.missing["nvidia"] == "nvidia-smi: timed out"
    assert effective.limitations.notes[-1].startswith("damped: probe found gpu_apu on 1 of 3")
    assert (history.lower_tier, history.lower_passes, history.lower_since) == ("gpu_apu", 1, T0 + timedelta(seconds=30))


def test_a_lower_tier_seen_on_consecutive_passes_demotes():
    good, blip = _qfox(), _qfox(nvidia_answers=False)
    _, history = damp(ProbeHistory(), good, T0)
    tiers = []
    for n in range(1, DEMOTE_AFTER_PASSES + 1):
        effective, history = damp(history, blip, T0 + timedelta(seconds=30 * n))
        tiers.append(effective.tier)
    assert tiers == ["gpu_cuda"] * (DEMOTE_AFTER_PASSES - 1) + ["gpu_apu"]
    assert effective == blip and history.effective == blip and history.lower_passes == 0


def test_a_recovery_resets_the_count_and_promotion_is_immediate():
    good, blip = _qfox(), _qfox(nvidia_answers=False)
    _, history = damp(ProbeHistory(), blip, T0)
    effective, history = damp(history, good, T0 + timedelta(seconds=30))
    assert effective == good  # new capacity is taken at once
    _, history = damp(history, blip, T0 + timedelta(seconds=60))
    _, history = damp(history, good, T0 + timedelta(seconds=90))
    effective, history = damp(history, blip, T0 + timedelta(seconds=120))
    assert effective.tier == "gpu_cuda" and history.lower_passes == 1


def test_history_survives_json_between_passes():
    good, blip = _qfox(), _qfox(nvidia_answers=False)
    _, history = damp(ProbeHistory(), good, T0)
    for n in range(1, DEMOTE_AFTER_PASSES):
        _, history = damp(history, blip, T0 + timedelta(seconds=30 * n))
        history = ProbeHistory.model_validate_json(history.model_dump_json())
    effective, _ = damp(history, blip, T0 + timedelta(seconds=300))
    assert effective.tier == "gpu_apu"


@settings(max_examples=200, deadline=None)
@given(observed=st.lists(st.sampled_from(["gpu_cuda", "gpu_apu", "cpu_ffmpeg", "relay"]), min_size=1, max_size=20), passes=st.integers(1, 5))
def test_the_effective_tier_drops_only_after_enough_consecutive_lower_passes(observed, passes):
    base = _qfox()
    history, effective_tiers = ProbeHistory(), []
    for n, tier in enumerate(observed):
        facts = base.model_copy(update={"tier": tier})
        effective, history = damp(history, facts, T0 + timedelta(seconds=30 * n), passes=passes)
        effective_tiers.append(effective.tier)
    for n in range(1, len(observed)):
        if TIER_SCORE[effective_tiers[n]] < TIER_SCORE[effective_tiers[n - 1]]:
            window = observed[max(0, n - passes + 1) : n + 1]
            assert len(window) == passes
            assert all(TIER_SCORE[t] < TIER_SCORE[effective_tiers[n - passes]] for t in window)
        # Damping only ever holds a tier up: never below what this pass saw.
        assert TIER_SCORE[effective_tiers[n]] >= TIER_SCORE[observed[n]]


# ---------------------------------------------------------------- sysfs, no lspci


def _sysfs_only(devices, dri_nodes, va=None, ffmpeg=FFMPEG, fb=None):
    """A machine without lspci: GPUs only from sysfs-pci."""
    values = {"pci_sysfs": SysfsPci(tuple(devices)), "cpu": 8, "memory": 16000, "arch": "x86_64", "hostname": "box"}
    if dri_nodes is not None:
        values["dri"] = DriNodes(tuple(dri_nodes), ())
    if va is not None:
        values["vainfo"] = va
    if ffmpeg is not None:
        values["ffmpeg"] = ffmpeg
    if fb is not None:
        values["framebuffer"] = fb
    return ParsedFacts(values, {"pci": "lspci: not installed"})


def _dev(slot, vendor, device, driver=None, drm=(), cls="030000"):
    return SysfsPciDevice(slot, cls, vendor, device, None, driver, tuple(drm))


RX6600_VA = "Mesa Gallium driver 24.2.7 for AMD Radeon RX 6600 (radeonsi, navi23, LLVM 18.1.8, DRM 3.59, 6.11.9)"
PHOENIX_VA = "Mesa Gallium driver 23.3.3 for AMD Radeon Graphics (radeonsi, gfx1103_r1, LLVM 17.0.6, DRM 3.56, 6.7.0)"


def _va(driver):
    return VaInfo((VaDevice("renderD128", driver, ("VAProfileH264High", "VAProfileHEVCMain")),))


def test_without_lspci_a_discrete_radeon_with_encode_is_gpu_vaapi_named_by_va_api():
    facts = build_node_facts(_sysfs_only([_dev("0000:03:00.0", "1002", "73ff", "amdgpu", ("card1", "renderD128"))], ["renderD128"], _va(RX6600_VA)))
    [gpu] = facts.hardware.gpus
    assert (gpu.tier, gpu.integrated, gpu.model, gpu.render_node) == ("gpu_vaapi", False, "AMD Radeon RX 6600", "renderD128")
    assert facts.labels[f"{LABEL_PREFIX}gpu"] == "amd:rx6600"


@pytest.mark.parametrize(
    ("device", "driver"),
    [
        ("15bf", PHOENIX_VA),  # Phoenix by id and by codename
        ("ffff", PHOENIX_VA),  # an id not in the table: the codename says APU
        ("15bf", None),  # no vainfo at all: the id says APU
        ("ffff", "Mesa Gallium driver 24.1.7 for AMD Radeon 780M (radeonsi, gfx1103_r1, LLVM 18, DRM 3.57)"),
        ("ffff", "Mesa Gallium driver 22.3.6 for AMD Radeon Graphics (renoir, LLVM 15.0.6, DRM 3.49, 6.1.0-17-amd64)"),
        ("ffff", "Mesa Gallium driver 24.1.3 for AMD Radeon Graphics (radeonsi, raphael_mendocino, LLVM 17.0.6)"),
    ],
)
def test_without_lspci_an_amd_apu_is_gpu_apu(device, driver):
    va = _va(driver) if driver else None
    facts = build_node_facts(_sysfs_only([_dev("0000:c4:00.0", "1002", device, "amdgpu", ("card0", "renderD128"))], ["renderD128"], va))
    [gpu] = facts.hardware.gpus
    assert gpu.integrated and gpu.tier == "gpu_apu"


@pytest.mark.parametrize(
    "driver",
    [
        "Mesa Gallium driver 22.2.0 for AMD Radeon RX 6400 (navi24, LLVM 14.0.6, DRM 3.48, 6.0.6)",
        "Mesa Gallium driver 18.1.6 for AMD Radeon (TM) RX 480 Graphics (POLARIS10, DRM 3.26.0, 4.18.5, LLVM 6.0.1)",
        "Mesa Gallium driver 23.0 for AMD Radeon RX Vega (radeonsi, vega10, LLVM 15)",
        "Mesa Gallium driver 24.0.0 for AMD Radeon RX 6800M (radeonsi, navi22, LLVM 17)",
    ],
)
def test_discrete_radeons_are_not_taken_for_apus(driver):
    facts = build_node_facts(_sysfs_only([_dev("0000:03:00.0", "1002", "73ff", "amdgpu", ("renderD128",))], ["renderD128"], _va(driver)))
    assert not facts.hardware.gpus[0].integrated


def test_without_lspci_an_intel_igpu_on_the_root_bus_is_gpu_apu_and_arc_is_not():
    ihd = "Intel iHD driver for Intel(R) Gen Graphics - 23.1.1 ()"
    igpu = build_node_facts(_sysfs_only([_dev("0000:00:02.0", "8086", "46a6", "i915", ("card0", "renderD128"))], ["renderD128"], _va(ihd)))
    assert [(g.model, g.integrated, g.tier) for g in igpu.hardware.gpus] == [("Intel GPU [8086:46a6]", True, "gpu_apu")]
    arc = build_node_facts(_sysfs_only([_dev("0000:03:00.0", "8086", "56a0", "xe", ("card1", "renderD128"))], ["renderD128"], _va(ihd)))
    assert [(g.integrated, g.tier) for g in arc.hardware.gpus] == [(False, "gpu_vaapi")]


def test_sysfs_render_node_must_be_in_dev_dri_and_a_bound_driver_is_named():
    device = _dev("0000:03:00.0", "1002", "73ff", "amdgpu", ("card1", "renderD128"))
    facts = build_node_facts(_sysfs_only([device], []))  # a container without /dev/dri/renderD128
    assert facts.hardware.gpus == []
    assert facts.missing["gpu 0000:03:00.0"] == "AMD GPU [1002:73ff]: driver amdgpu bound but no render node in /dev/dri"


def test_non_display_devices_are_not_gpus():
    audio = _dev("0000:03:00.1", "1002", "ab28", "snd_hda_intel", cls="040300")
    facts = build_node_facts(_sysfs_only([audio], ["renderD128"]))
    assert facts.hardware.gpus == [] and facts.labels[f"{LABEL_PREFIX}gpu"] == "none"


def test_render_nodes_by_pci_order_when_nothing_links_them():
    """No by-path links and no sysfs (a container): one GPU, one render node."""
    parsed = _parsed([UHD])
    parsed.values["dri"] = _with_dri(["renderD128"])
    facts = build_node_facts(parsed)
    assert [g.render_node for g in facts.hardware.gpus] == ["renderD128"]
    assert "render nodes matched to GPUs by PCI order (no /dev/dri/by-path)" in facts.limitations.notes


def _with_dri(nodes):
    return DriNodes(tuple(nodes), ())


# ---------------------------------------------------------------- framebuffer tier


def test_only_a_framebuffer_is_the_framebuffer_tier():
    facts = build_node_facts(_sysfs_only([], None, ffmpeg=None, fb="1920x1080"))
    assert facts.tier == "framebuffer"
    assert build_node_facts(_sysfs_only([], None, ffmpeg=None)).tier == "relay"
    # ffmpeg or a GPU rank above it.
    assert build_node_facts(_sysfs_only([], None, fb="1920x1080")).tier == "cpu_ffmpeg"


def test_a_virtual_machines_console_framebuffer_is_not_the_framebuffer_tier():
    cirrus = _dev("0000:00:02.0", "1013", "00b8", "cirrus", ("card0",))
    facts = build_node_facts(_sysfs_only([cirrus], ["card0"], ffmpeg=None, fb="1024x768"))
    assert facts.tier == "relay"
    assert facts.hardware.framebuffer is not None  # the fact stays; only the tier ignores it
    assert any("emulated display adapter (1013:00b8)" in note for note in facts.limitations.notes)


# A container or VM given only a render node: no lspci, no PCI display device.
IHD = "Intel iHD driver for Intel(R) Gen Graphics - 24.1.0 ()"
RADEONSI_APU = "Mesa Gallium driver 24.1.3 for AMD Radeon Graphics (radeonsi, raphael_mendocino, LLVM 17.0.6, DRM 3.57)"
RADEONSI_RX = "Mesa Gallium driver 24.2.7 for AMD Radeon RX 6600 (radeonsi, navi23, LLVM 18.1.8, DRM 3.59)"


def _render_only(driver: str, encode: tuple[str, ...] = ("VAProfileH264Main",)) -> HostFacts:
    parsed = _parsed(va=VaInfo((VaDevice("renderD128", driver, encode),)))
    parsed.values["dri"] = DriNodes(("renderD128",), (), {})
    return build_node_facts(parsed)


def test_a_render_node_alone_with_va_api_encode_is_that_gpu_and_says_where_it_came_from():
    facts = _render_only(RADEONSI_RX)
    (gpu,) = facts.hardware.gpus
    assert (gpu.vendor, gpu.model, gpu.tier, gpu.pci_slot, gpu.render_node) == ("amd", "AMD Radeon RX 6600", "gpu_vaapi", None, "renderD128")
    assert facts.tier == "gpu_vaapi"
    assert any("no PCI device shows it" in note for note in facts.limitations.notes)


@pytest.mark.parametrize("driver", [IHD, RADEONSI_APU], ids=["intel-ihd", "amd-apu"])
def test_a_render_node_alone_that_may_be_integrated_counts_as_gpu_apu(driver):
    facts = _render_only(driver)
    assert [(g.tier, g.integrated) for g in facts.hardware.gpus] == [("gpu_apu", True)]


def test_a_render_node_whose_va_api_driver_did_not_answer_is_no_gpu():
    parsed = _parsed(missing={"vainfo": "vainfo: not installed"})
    parsed.values["dri"] = DriNodes(("renderD128",), (), {})
    assert build_node_facts(parsed).hardware.gpus == []


def test_render_nodes_of_gpus_pci_shows_are_not_counted_twice():
    facts = build_node_facts(
        _parsed([RX6600], va=VaInfo((VaDevice("renderD128", RADEONSI_RX, ("VAProfileH264Main",)),)), render={RX6600.slot: "renderD128"})
    )
    assert [(g.pci_slot, g.render_node) for g in facts.hardware.gpus] == [(RX6600.slot, "renderD128")]
