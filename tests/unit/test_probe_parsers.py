"""Probe parsers: the odd cases real machines print, and a property that no
text at all can make a parser raise anything but ParseError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.core.probe import parsers
from reconciler.core.probe.facts import FACTS
from reconciler.core.probe.parsers import ParseError
from tests.support.probe_fixtures import FIXTURES, MACHINES

PARSERS = {fact.raw: fact.parser for fact in FACTS}
REAL_OUTPUTS = sorted(
    (raw, (FIXTURES / machine / raw).read_text()) for machine in MACHINES for raw in PARSERS if (FIXTURES / machine / raw).is_file()
)


@settings(max_examples=300, deadline=None)
@given(raw=st.sampled_from(sorted(PARSERS)), text=st.text())
def test_no_text_makes_a_parser_raise_anything_but_parse_error(raw, text):
    try:
        PARSERS[raw](text)
    except ParseError:
        pass


@settings(max_examples=400, deadline=None)
@given(
    case=st.sampled_from(REAL_OUTPUTS),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    noise=st.text(max_size=40),
)
def test_damaged_real_outputs_never_crash_a_parser(case, cut, noise):
    """Truncated, spliced and noisy versions of real outputs (a killed
    command, a short read) give a value or a ParseError, nothing else."""
    raw, text = case
    a, b = sorted(int(x * len(text)) for x in cut)
    for damaged in (text[:a], text[a:], text[:a] + noise + text[b:]):
        try:
            PARSERS[raw](damaged)
        except ParseError:
            pass


@pytest.mark.parametrize(
    ("text", "arch"),
    [("x86_64\n", "x86_64"), ("aarch64\n", "aarch64"), ("arm64\n", "aarch64"), ("riscv64\n", "riscv64")],
)
def test_uname_m(text, arch):
    assert parsers.parse_uname_m(text) == arch


@pytest.mark.parametrize("text", ["", "\n", "x86_64 GNU/Linux\n", "Linux"])
def test_uname_m_rejects_what_is_not_a_machine_name(text):
    with pytest.raises(ParseError):
        parsers.parse_uname_m(text)


def test_cpuinfo_counts_logical_cpus_on_old_arm_kernels_too():
    # Old arm kernels print a "Processor : <name>" line besides the numbered ones.
    text = "Processor\t: AArch64 Processor rev 1 (aarch64)\nprocessor\t: 0\nprocessor\t: 1\nHardware\t: Ampere\n"
    assert parsers.parse_cpuinfo(text) == 2


def test_meminfo_is_mebibytes_and_rejects_na():
    assert parsers.parse_meminfo("MemTotal:       31879168 kB\n") == 31132
    with pytest.raises(ParseError, match="MemTotal"):
        parsers.parse_meminfo("MemTotal:        [N/A]\n")


def test_os_release_quotes_and_id_like():
    os_release = parsers.parse_os_release('NAME="CachyOS Linux"\nID=cachyos\nID_LIKE="arch"\nPRETTY_NAME="CachyOS"\n')
    assert os_release == parsers.OsRelease(id="cachyos", id_like=("arch",), name="CachyOS", version_id=None)


@pytest.mark.parametrize(("text", "name"), [("qfox-1\n", "qfox-1"), ("Zephyrus.localdomain\n", "zephyrus")])
def test_hostname_is_short_and_lowercase(text, name):
    assert parsers.parse_hostname(text) == name


@pytest.mark.parametrize(
    ("slot", "normal"),
    [("01:00.0", "0000:01:00.0"), ("0000:0e:00.0", "0000:0e:00.0"), ("00000000:21:00.0", "0000:21:00.0"), ("[N/A]", None)],
)
def test_pci_slots_are_normalized_across_lspci_and_nvidia_smi(slot, normal):
    assert parsers.normalize_pci_slot(slot) == normal


def test_lspci_keeps_only_display_controllers():
    text = (FIXTURES / "multi-gpu-server" / "lspci").read_text()
    displays = parsers.parse_lspci(text)
    assert [(d.slot, d.class_code, d.vendor_id, d.device_id) for d in displays] == [
        ("0000:21:00.0", "0300", "10de", "2230"),
        ("0000:41:00.0", "0300", "10de", "2230"),
        ("0000:64:00.0", "0300", "1a03", "2000"),
    ]
    assert displays[0].device_name == "GA102GL [RTX A6000]"


def test_lspci_without_nn_still_finds_the_gpu_by_class_name():
    text = "Slot:\t00:02.0\nClass:\tVGA compatible controller\nVendor:\tIntel Corporation [8086]\nDevice:\tUHD Graphics 620\n\n"
    (display,) = parsers.parse_lspci(text)
    assert display.vendor_id == "8086" and display.class_code == "0300"


def test_lspci_of_a_machine_without_display_devices_is_an_empty_answer():
    assert parsers.parse_lspci("Slot:\t00:00.0\nClass:\tHost bridge [0600]\nVendor:\tIntel Corporation [8086]\nDevice:\t440FX [1237]\n") == ()


@pytest.mark.parametrize(
    "text",
    [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n",
        "No devices were found\n",
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.107\n",
        "",
    ],
)
def test_nvidia_smi_failure_messages_are_not_gpus(text):
    with pytest.raises(ParseError):
        parsers.parse_nvidia_smi(text)


def test_nvidia_smi_odd_values_keep_the_gpu_and_name_the_field():
    report = parsers.parse_nvidia_smi("0, Tesla T4, [N/A], [N/A], 00000000:00:06.0\n1, [N/A], 15360, 550.90.07, [N/A]\n")
    assert [(g.index, g.name, g.vram_mib, g.driver, g.pci_slot) for g in report.gpus] == [
        (0, "Tesla T4", None, None, "0000:00:06.0"),
        (1, "NVIDIA GPU", 15360, "550.90.07", None),
    ]
    assert dict(report.problems) == {
        "gpu 0 memory.total": "odd value '[N/A]'",
        "gpu 0 driver_version": "odd value '[N/A]'",
        "gpu 1 name": "odd value '[N/A]'",
        "gpu 1 pci.bus_id": "odd value '[N/A]'",
    }


def test_dri_ties_render_nodes_to_pci_slots_and_drops_stale_links():
    text = "card1\nrenderD128\nby-path/pci-0000:01:00.0-render -> ../renderD128\nby-path/pci-0000:02:00.0-render -> ../renderD130\n"
    dri = parsers.parse_dri(text)
    assert dri.render_nodes == ("renderD128",)
    assert dri.render_by_slot == {"0000:01:00.0": "renderD128"}


@pytest.mark.parametrize("text", ["", "by-path\n", "\n\n"])
def test_dri_without_any_node(text):
    with pytest.raises(ParseError, match="no card or render node"):
        parsers.parse_dri(text)


def test_vainfo_keeps_answering_nodes_and_names_failed_ones():
    va = parsers.parse_vainfo((FIXTURES / "qfox-1" / "vainfo").read_text())
    assert [d.render_node for d in va.devices] == ["renderD129"]
    assert va.devices[0].encode_profiles[:2] == ("VAProfileH264ConstrainedBaseline", "VAProfileH264Main")
    assert dict(va.problems) == {"renderD128": "vaInitialize failed with error code -1 (unknown libva error),exit"}


def test_vainfo_without_header_is_the_default_render_node():
    text = (FIXTURES / "intel-nuc" / "vainfo").read_text().split("\n", 1)[1]
    (device,) = parsers.parse_vainfo(text).devices
    assert device.render_node == "renderD128"
    assert device.jpeg_encode and "VAProfileHEVCMain" in device.encode_profiles


def test_lsblk_old_string_values_and_nested_mounts():
    old = {
        "blockdevices": [
            {
                "name": "sda",
                "type": "disk",
                "size": "500107862016",
                "rota": "1",
                "tran": "sata",
                "mountpoint": None,
                "children": [
                    {
                        "name": "sda1",
                        "type": "part",
                        "size": "500106813440",
                        "rota": "1",
                        "tran": None,
                        "mountpoint": None,
                        "children": [{"name": "vg-root", "type": "lvm", "size": "1", "rota": "1", "tran": None, "mountpoint": "/"}],
                    }
                ],
            },
            {"name": "zram0", "type": "disk", "size": "8589934592", "rota": "0", "tran": None, "mountpoint": "[SWAP]"},
            {"name": "sr0", "type": "rom", "size": "1073741312", "rota": "1", "tran": "sata", "mountpoint": None},
        ]
    }
    (disk,) = parsers.parse_lsblk(json.dumps(old))
    assert disk == parsers.BlockDisk("sda", 500107862016, True, "sata", ("/",))


def test_lsblk_mountpoints_list_of_newer_util_linux():
    doc = {
        "blockdevices": [
            {
                "name": "nvme0n1",
                "type": "disk",
                "size": 10,
                "rota": False,
                "tran": "nvme",
                "mountpoints": [None],
                "children": [{"name": "p1", "type": "part", "size": 9, "rota": False, "tran": None, "mountpoints": ["/home", "/"]}],
            }
        ]
    }
    (disk,) = parsers.parse_lsblk(json.dumps(doc))
    assert disk.mounts == ("/home", "/")


def test_ffmpeg_encoders_skip_the_legend_and_know_hardware_families():
    encoders = parsers.parse_ffmpeg_encoders((FIXTURES / "qfox-1" / "ffmpeg-encoders").read_text())
    names = {e.name: e for e in encoders}
    assert "=" not in names
    assert names["h264_nvenc"].family == "nvenc" and names["hevc_vaapi"].family == "vaapi"
    assert names["libx264"].family is None and names["aac"].kind == "A"
    assert parsers.Encoder("nvenc_hevc", "V").family == "nvenc"


def test_ffmpeg_failure_is_not_an_encoder_list():
    with pytest.raises(ParseError, match="Encoders:"):
        parsers.parse_ffmpeg_encoders("ffmpeg: error while loading shared libraries: libavdevice.so.60\n")


@pytest.mark.parametrize(("text", "resolution"), [("3840,2160\n", "3840x2160"), ("1024,768", "1024x768")])
def test_fb0(text, resolution):
    assert parsers.parse_fb0(text) == resolution


@pytest.mark.parametrize("text", ["0,0\n", "1920x1080\n", ""])
def test_fb0_rejects_odd_sizes(text):
    with pytest.raises(ParseError):
        parsers.parse_fb0(text)


def _status(peers, state="Running"):
    return json.dumps(
        {
            "BackendState": state,
            "Self": {"DNSName": "node.tail-abc123.ts.net.", "TailscaleIPs": ["100.64.0.9", "fd7a:115c:a1e0::9"]},
            "Peer": {f"nodekey:{i}": {"HostName": f"p{i}", **p} for i, p in enumerate(peers)},
        }
    )


@pytest.mark.parametrize(
    ("peers", "relayed"),
    [
        ([{"Online": True, "Active": True, "Relay": "nyc", "CurAddr": "192.0.2.1:41641"}], False),
        ([{"Online": True, "Active": True, "Relay": "nyc", "CurAddr": ""}], True),
        # One direct path proves this node's NAT lets paths through.
        (
            [
                {"Online": True, "Active": True, "Relay": "fra", "CurAddr": ""},
                {"Online": True, "Active": True, "Relay": "nyc", "CurAddr": "192.0.2.1:41641"},
            ],
            False,
        ),
        # A peer relay (tailscale >= 1.86) is not DERP, though CurAddr is empty and Relay set.
        ([{"Online": True, "Active": True, "Relay": "nyc", "CurAddr": "", "PeerRelay": "198.51.100.23:7777:vni:182"}], False),
        # Idle peers have no CurAddr whatever the path: they say nothing.
        ([{"Online": True, "Active": False, "Relay": "nyc", "CurAddr": ""}], None),
        ([{"Online": False, "Active": True, "Relay": "nyc", "CurAddr": ""}], None),
        ([], None),
    ],
)
def test_tailscale_relayed_is_judged_by_active_peers(peers, relayed):
    status = parsers.parse_tailscale_status(_status(peers))
    assert status.relayed is relayed
    assert status.dns_name == "node.tail-abc123.ts.net" and status.ipv4 == "100.64.0.9"


def test_a_status_whose_peers_all_go_through_a_peer_relay_is_not_derp_relayed():
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "tailscale" / "peer-relay-1.86.json").read_text()
    status = parsers.parse_tailscale_status(text)
    assert status.relayed is False and status.relayed_peers == ()


@pytest.mark.parametrize("state", ["NeedsLogin", "Stopped", "Starting", None])
def test_tailscale_not_running_is_no_identity(state):
    with pytest.raises(ParseError, match="not running"):
        parsers.parse_tailscale_status(_status([], state=state))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.sampled_from(["disk", "/", "Running", "nvme"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "blockdevices",
                    "children",
                    "name",
                    "type",
                    "size",
                    "rota",
                    "tran",
                    "mountpoint",
                    "mountpoints",
                    "BackendState",
                    "Self",
                    "Peer",
                    "DNSName",
                    "TailscaleIPs",
                    "Online",
                    "Active",
                    "Relay",
                    "CurAddr",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(raw=st.sampled_from(["lsblk.json", "tailscale.json"]), document=_JSON)
def test_json_of_any_shape_never_crashes_the_json_parsers(raw, document):
    try:
        PARSERS[raw](json.dumps(document))
    except ParseError:
        pass


# ---------------------------------------------------------------- sysfs-pci


def test_sysfs_pci_lines_parse_and_format_round_trip():
    fields = {"class": "0x030000\n", "vendor": "0x1002", "device": "0x73ff", "subsystem": "0x1da2:0xe448", "driver": "amdgpu"}
    line = parsers.format_sysfs_pci_line("0000:03:00.0", fields, ["renderD128", "card1", "card1-DP-1"])
    assert line == "0000:03:00.0 class=0x030000 vendor=0x1002 device=0x73ff subsystem=0x1da2:0xe448 driver=amdgpu drm=card1,renderD128\n"
    [device] = parsers.parse_sysfs_pci("# comment\n" + line).devices
    assert device == parsers.SysfsPciDevice("0000:03:00.0", "030000", "1002", "73ff", "1da2:e448", "amdgpu", ("card1", "renderD128"))
    assert device.display and device.render_node == "renderD128"
    # Absent fields are left out, not written empty.
    assert parsers.format_sysfs_pci_line("0000:00:01.0", {"class": "0x060400", "vendor": "0x8086", "device": "0x460d", "driver": None}, []) == (
        "0000:00:01.0 class=0x060400 vendor=0x8086 device=0x460d\n"
    )


def test_sysfs_pci_keeps_good_lines_and_names_bad_ones():
    text = "0000:03:00.0 class=0x030000 vendor=0x1002 device=0x73ff\n0000:04:00.0 class=0x03 vendor=0x1002 device=0x1681\nrubbish\n"
    parsed = parsers.parse_sysfs_pci(text)
    assert [d.slot for d in parsed.devices] == ["0000:03:00.0"]
    assert parsed.problems == (("line 2", "class is '0x03', not 6 hex digits"), ("line 3", "not a PCI slot: 'rubbish'"))
    with pytest.raises(ParseError, match="no device line understood"):
        parsers.parse_sysfs_pci("rubbish\n")
    # A PCI bus with no device on it (an ARM board) is an answer.
    assert parsers.parse_sysfs_pci("").devices == ()


@pytest.mark.parametrize(
    ("path", "slot"),
    [
        ("../../devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:00.0/0000:03:00.0/drm/card1", "0000:03:00.0"),
        ("../../devices/pci0000:00/0000:00:01.0/virtio0/drm/card0", "0000:00:01.0"),
        ("../../devices/platform/simple-framebuffer.0/drm/card0", None),
        ("../../devices/platform/gpu/drm/renderD128", None),
    ],
)
def test_the_pci_slot_of_a_drm_node_is_the_last_slot_on_its_path(path, slot):
    assert parsers.pci_slot_in_path(path) == slot
