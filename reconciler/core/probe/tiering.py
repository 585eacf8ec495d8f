"""Parsed facts -> `HostFacts`: GPUs, tier, labels, limitations (pure).

Tier rule (the seed's tiers, best first; the node takes its best GPU's tier):

- gpu_cuda:   an NVIDIA GPU that nvidia-smi lists (the driver answers).
- gpu_vaapi:  a discrete AMD/Intel GPU with a render node whose VA-API driver
              offers video encode entrypoints (EncSlice / EncSliceLP).
- gpu_apu:    an integrated AMD/Intel GPU with a render node. A discrete one
              with a render node but no VA-API encode (vainfo missing, or a
              driver without encode) also lands here: it still computes through
              its render node like an iGPU, it just cannot be trusted to encode.
- cpu_ffmpeg: no usable GPU, but ffmpeg answers.
- framebuffer: nothing above, but a usable /dev/fb0 (see `framebuffer_usable`).
- relay:      nothing above.

GPUs come from `lspci` when it answers, else from sysfs (`sysfs-pci`: PCI
class 0x03xxxx, vendor and device ids, the bound driver and the DRM nodes on
the device), so a machine without pciutils still finds its GPUs. sysfs also
ties each render node to its PCI slot (the kernel's own link), ahead of
/dev/dri/by-path. Without lspci a GPU's name comes from its VA-API driver
string ("... for AMD Radeon RX 6600 (radeonsi, navi23, ...)"), else its ids.

A GPU that lspci shows but that cannot be used (an NVIDIA card whose driver
does not answer, a card with no render node) is not listed under
`hardware.gpus`; `missing["gpu <slot>"]` says what it is and why it is unusable.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from reconciler.core.desired.model import (
    TIER_SCORE,
    Framebuffer,
    Gpu,
    GpuVendor,
    Hardware,
    HostFacts,
    Limitations,
    OperatingSystem,
    Storage,
    StorageType,
    Tier,
)
from reconciler.core.probe.parsers import (
    BlockDisk,
    DriNodes,
    Encoder,
    NvidiaReport,
    OsRelease,
    PciDisplay,
    SysfsPci,
    TailscaleStatus,
    VaInfo,
)
from reconciler.core.probe.raw import ParsedFacts

LABEL_PREFIX = "topology.researchstack.io/"

_VENDORS: dict[str, GpuVendor] = {"10de": "nvidia", "1002": "amd", "8086": "intel"}
_VENDOR_DISPLAY = {"nvidia": "NVIDIA", "amd": "AMD", "intel": "Intel"}

# AMD APU graphics as pci.ids names them (Ryzen mobile and desktop APUs, the
# Steam Deck, older A-series). Matched as words in the lspci device name.
_AMD_APU_RE = re.compile(
    r"\b(raphael|rembrandt|renoir|cezanne|lucienne|barcelo|picasso|raven|phoenix\d?|hawk ?point\d?|"
    r"strix|krackan|van ?gogh|mendocino|granite ridge|kaveri|carrizo|stoney|mullins|kabini|wani|"
    r"trinity|richland|beavercreek|sumo|wrestler)\b",
    re.I,
)


# AMD APUs by PCI device id (pci.ids), for a machine without lspci's names:
# Raven, Picasso, Renoir, Cezanne, Lucienne, Barcelo, Rembrandt, Raphael,
# Granite Ridge, Mendocino, Van Gogh, Phoenix1, Phoenix2, Strix, Strix Halo, Krackan.
_AMD_APU_DEVICE_IDS = frozenset(
    {"15dd", "15d8", "1636", "1638", "164c", "15e7", "1681", "164e", "13c0", "1506", "163f", "15bf", "15c8", "150e", "1586", "1114"}
)

# What Mesa's radeonsi VA-API driver string says of an APU: its codename
# (`rembrandt`, `raphael_mendocino`, `gfx1103_r1` for Phoenix/780M, `gfx1150`
# for Strix) or its marketing name (`Radeon 780M`, `Radeon Vega 8`). Matched
# as tokens (underscores split them), so `navi23` or `RX Vega 56` never match.
_AMD_APU_VA_RE = re.compile(
    r"(?<![a-z0-9])(raven2?|picasso|renoir|cezanne|lucienne|barcelo|rembrandt|raphael|mendocino|vangogh|phoenix\d?|"
    r"hawk ?point\d?|strix|krackan|gfx90c|gfx1035|gfx1036|gfx1037|gfx1103|gfx115\d|stoney|carrizo|kaveri|kabini|mullins|"
    r"radeon(?:\(tm\))? \d{3}m|radeon(?:\(tm\))? \d{4}s|radeon vega \d+)(?![a-z0-9])",
    re.I,
)
# "Mesa Gallium driver 24.2.7 for AMD Radeon RX 6600 (radeonsi, navi23, LLVM ...)"
_MESA_DRIVER_RE = re.compile(r"^Mesa Gallium driver \S+ for (.+?) \(([^()]*)\)")
_GENERIC_NAMES = {"amd radeon graphics", "amd radeon(tm) graphics", "radeon graphics"}

# Emulated display adapters of virtual machines (QEMU std VGA, Cirrus,
# virtio-gpu, QXL, VMware SVGA, VirtualBox): their /dev/fb0 is a console
# nobody looks at.
_EMULATED_DISPLAY_VENDORS = frozenset({"1234", "1013", "1af4", "1b36", "15ad", "80ee"})


# --------------------------------------------------------------------------
# GPUs


def _marketing_name(device_name: str) -> str:
    """'AD104 [GeForce RTX 4070]' -> 'GeForce RTX 4070'; 'Raphael' -> 'Raphael'."""
    match = re.search(r"\[([^\]]+)\]\s*$", device_name)
    return match.group(1).strip() if match else device_name.strip()


def is_integrated(device: PciDisplay, va_driver: str | None = None) -> bool:
    """From what the machine says: Intel's iGPU sits on the root bus; an AMD
    APU is named so by pci.ids (lspci), by its PCI id, or by its VA-API driver
    string (codename or marketing name)."""
    vendor = _VENDORS.get(device.vendor_id)
    if vendor == "intel":
        # Intel's iGPU always sits on the root bus (00:02.0); Arc cards never do.
        return device.bus == "00"
    if vendor == "amd":
        return bool(
            _AMD_APU_RE.search(device.device_name) or device.device_id in _AMD_APU_DEVICE_IDS or (va_driver and _AMD_APU_VA_RE.search(va_driver))
        )
    return False


def va_gpu_name(va_driver: str | None) -> str | None:
    """The GPU Mesa's VA-API driver names: 'AMD Radeon RX 6600'; a generic
    'AMD Radeon Graphics' gets its codename: 'AMD Radeon Graphics (gfx1103_r1)'.
    Intel's iHD names no GPU ('Intel(R) Gen Graphics'): None."""
    match = _MESA_DRIVER_RE.search(va_driver or "")
    if match is None:
        return None
    name = match.group(1).strip()
    details = [p.strip() for p in match.group(2).split(",")]
    codename = next((p for p in details if p and p != "radeonsi" and not re.match(r"^(LLVM|DRM|ACO)\b", p) and " " not in p), None)
    if name.lower() in _GENERIC_NAMES and codename:
        return f"{name} ({codename})"
    return name or None


def _pci_displays(parsed: ParsedFacts) -> list[PciDisplay]:
    """Display devices from lspci, else from sysfs (lspci's names win; a
    device only sysfs shows is added). Names from sysfs are empty."""
    pci: tuple[PciDisplay, ...] = parsed.get("pci") or ()
    sysfs: SysfsPci | None = parsed.get("pci_sysfs")
    displays = {d.slot: d for d in pci}
    if sysfs is not None:
        for device in sysfs.displays():
            if device.slot not in displays:
                displays[device.slot] = PciDisplay(device.slot, device.class_code[:4], device.vendor_id, "", device.device_id, "")
    return sorted(displays.values(), key=lambda d: d.slot)


def _render_nodes(displays: list[PciDisplay], dri: DriNodes | None, sysfs: SysfsPci | None) -> tuple[dict[str, str], list[str]]:
    """PCI slot -> render node, and notes on how they were matched."""
    if dri is None:
        return {}, []
    # sysfs's link from the render node to its device is the kernel's own
    # word; by-path links are udev's. A node /dev/dri does not show (a
    # container given no access to it) is not usable from here.
    from_sysfs = {d.slot: node for d in (sysfs.devices if sysfs else ()) if (node := d.render_node) and node in dri.render_nodes}
    if dri.render_by_slot or from_sysfs:
        return {**dri.render_by_slot, **from_sysfs}, []
    # No /dev/dri/by-path (some containers): the kernel numbers render nodes
    # in probe order, which follows the PCI order when every display device
    # has one. Anything less would be a guess, so then nothing is matched.
    slots = sorted(d.slot for d in displays)
    if slots and len(slots) == len(dri.render_nodes):
        return dict(zip(slots, dri.render_nodes, strict=True)), ["render nodes matched to GPUs by PCI order (no /dev/dri/by-path)"]
    if dri.render_nodes:
        return {}, ["render nodes cannot be matched to GPUs (no /dev/dri/by-path and counts differ)"]
    return {}, []


def collect_gpus(parsed: ParsedFacts) -> tuple[list[Gpu], dict[str, str], list[str]]:
    """(usable GPUs best first, missing entries, notes)."""
    nvidia: NvidiaReport | None = parsed.get("nvidia")
    dri: DriNodes | None = parsed.get("dri")
    va: VaInfo | None = parsed.get("vainfo")
    groups: dict[str, str] = parsed.get("dri_groups") or {}
    sysfs: SysfsPci | None = parsed.get("pci_sysfs")
    drivers = {d.slot: d.driver for d in (sysfs.devices if sysfs else ()) if d.driver}
    missing: dict[str, str] = {f"pci_sysfs {subject}": reason for subject, reason in (sysfs.problems if sysfs else ())}

    displays = [d for d in _pci_displays(parsed) if d.vendor_id in _VENDORS]
    render_by_slot, notes = _render_nodes(displays, dri, sysfs)
    gpus: list[Gpu] = []
    claimed: set[str] = set()

    if nvidia is not None:
        for subject, reason in nvidia.problems:
            missing[f"nvidia {subject}"] = reason
        for smi in nvidia.gpus:
            if smi.pci_slot is not None:
                claimed.add(smi.pci_slot)
            gpus.append(
                Gpu(
                    vendor="nvidia",
                    model=smi.name,
                    vram_mib=smi.vram_mib,
                    # nvidia-smi lists only NVIDIA's own (discrete) GPUs.
                    integrated=False,
                    tier="gpu_cuda",
                    pci_slot=smi.pci_slot,
                    render_node=(node := render_by_slot.get(smi.pci_slot) if smi.pci_slot else None),
                    render_group=groups.get(node) if node else None,
                    driver=smi.driver,
                )
            )

    for device in displays:
        if device.slot in claimed:
            continue
        vendor = _VENDORS[device.vendor_id]
        node = render_by_slot.get(device.slot)
        va_device = va.on(node) if va is not None and node is not None else None
        va_driver = va_device.driver if va_device else None
        if device.device_name:
            model = f"{_VENDOR_DISPLAY[vendor]} {_marketing_name(device.device_name)}"
        else:
            # No lspci: the VA-API driver's name for it, else its PCI ids.
            model = va_gpu_name(va_driver) or f"{_VENDOR_DISPLAY[vendor]} GPU [{device.vendor_id}:{device.device_id}]"
        if vendor == "nvidia":
            why = parsed.missing.get("nvidia", "nvidia-smi does not list it")
            missing[f"gpu {device.slot}"] = f"{model}: no working NVIDIA driver ({why})"
            continue
        if node is None:
            driver = drivers.get(device.slot)
            reason = f"driver {driver} bound but no render node in /dev/dri" if driver else "no render node in /dev/dri (no kernel driver bound)"
            missing[f"gpu {device.slot}"] = f"{model}: {reason}"
            continue
        integrated = is_integrated(device, va_driver)
        encodes = bool(va_device and va_device.encode_profiles)
        tier: Tier = "gpu_vaapi" if encodes and not integrated else "gpu_apu"
        if not integrated and not encodes:
            why_not = parsed.missing.get("vainfo", "no vainfo output") if va is None else dict(va.problems).get(node, "no encode entrypoints")
            notes.append(f"{model}: discrete but no VA-API encode ({why_not}); counted as gpu_apu")
        gpus.append(
            Gpu(
                vendor=vendor,
                model=model,
                vram_mib=None,
                integrated=integrated,
                tier=tier,
                pci_slot=device.slot,
                render_node=node,
                render_group=groups.get(node),
                driver=va_device.driver if va_device else None,
            )
        )
    if not displays and not gpus and dri is not None and va is not None:
        gpus += _gpus_from_render_nodes(dri, va, groups, notes)
    gpus.sort(key=lambda g: (-TIER_SCORE[g.tier], -(g.vram_mib or 0), g.pci_slot or ""))
    return gpus, missing, notes


def va_vendor(va_driver: str | None) -> GpuVendor:
    """The vendor a VA-API driver string names: Mesa's radeonsi is AMD's,
    iHD and i965 are Intel's, nouveau and nvidia-vaapi-driver NVIDIA's."""
    text = (va_driver or "").lower()
    if "radeonsi" in text or " amd " in f" {text} " or "radeon" in text:
        return "amd"
    if "intel" in text or "ihd" in text or "i965" in text:
        return "intel"
    if "nouveau" in text or "nvidia" in text or "nvdec" in text:
        return "nvidia"
    return "other"


def _gpus_from_render_nodes(dri: DriNodes, va: VaInfo, groups: dict[str, str], notes: list[str]) -> list[Gpu]:
    """GPUs seen only through /dev/dri and VA-API: a container or VM given a
    render node, whose /sys/bus/pci and lspci show no display device. Each
    render node whose VA-API driver answered is a GPU; its vendor and name
    come from that driver, its tier from its encode entry points. Intel's iHD
    does not say whether it drives an iGPU or an Arc card, so an Intel GPU
    counts as integrated (gpu_apu): a tier too low only leaves work elsewhere,
    one too high would take work it cannot do."""
    found: list[Gpu] = []
    for node in dri.render_nodes:
        va_device = va.on(node)
        if va_device is None:
            continue
        vendor = va_vendor(va_device.driver)
        model = va_gpu_name(va_device.driver) or f"{_VENDOR_DISPLAY.get(vendor, 'Unknown')} GPU on {node}"
        integrated = vendor == "intel" or bool(vendor == "amd" and va_device.driver and _AMD_APU_VA_RE.search(va_device.driver))
        tier: Tier = "gpu_vaapi" if va_device.encode_profiles and not integrated else "gpu_apu"
        notes.append(f"{model}: no PCI device shows it (a container or VM given {node}?); taken from its render node and VA-API driver")
        found.append(
            Gpu(
                vendor=vendor,
                model=model,
                vram_mib=None,
                integrated=integrated,
                tier=tier,
                pci_slot=None,
                render_node=node,
                render_group=groups.get(node),
                driver=va_device.driver,
            )
        )
    return found


# --------------------------------------------------------------------------
# Storage


def storage_type(disk: BlockDisk) -> StorageType:
    if disk.transport == "nvme" or disk.name.startswith("nvme"):
        return "nvme"
    # Virtual disks (virtio, Xen) and network block devices report a
    # rotational flag that says nothing about the medium behind them.
    if disk.transport in ("iscsi", "fc", "nbd") or re.match(r"^(vd|xvd)[a-z]", disk.name):
        return "other"
    if disk.rotational is False:
        return "ssd"
    if disk.rotational is True:
        return "hdd"
    return "other"


def collect_storage(disks: Iterable[BlockDisk]) -> list[Storage]:
    result = []
    for disk in disks:
        mount = "/" if "/" in disk.mounts else (disk.mounts[0] if disk.mounts else None)
        result.append(Storage(name=disk.name, mount=mount, type=storage_type(disk), size_gib=disk.size_bytes // 2**30))
    return result


_STORAGE_LABEL = {"nvme": "nvme-ssd", "ssd": "ssd", "hdd": "hdd", "other": "other"}


def storage_tier_label(storage: list[Storage]) -> str | None:
    """The class of the disk holding '/', else of the first mounted disk."""
    root = next((s for s in storage if s.mount == "/"), None) or next((s for s in storage if s.mount), None)
    return _STORAGE_LABEL[root.type] if root else None


# --------------------------------------------------------------------------
# ffmpeg

# VA-API profile name prefix per ffmpeg codec name.
_VA_CODEC_PROFILE = {
    "h264": "VAProfileH264",
    "hevc": "VAProfileHEVC",
    "av1": "VAProfileAV1",
    "vp9": "VAProfileVP9",
    "vp8": "VAProfileVP8",
    "mpeg2": "VAProfileMPEG2",
}


def usable_hardware_encoders(encoders: Iterable[Encoder], gpus: list[Gpu], va: VaInfo | None) -> list[str]:
    """ffmpeg's hardware encoders whose hardware this probe saw answer.

    ffmpeg lists what it was built with (a VPS's ffmpeg lists h264_nvenc), so
    each family is kept only with its hardware: nvenc with a CUDA GPU; vaapi
    per codec with a render node whose VA driver encodes that codec; qsv with
    an Intel GPU; vulkan with any GPU that has a render node or CUDA. Families
    whose hardware the probe cannot see (amf's runtime, v4l2m2m devices,
    videotoolbox, mf, ...) are left out rather than guessed.
    """
    cuda = any(g.tier == "gpu_cuda" for g in gpus)
    render_nodes = {g.render_node for g in gpus if g.render_node}
    intel = any(g.vendor == "intel" and g.render_node for g in gpus)
    va_profiles: set[str] = set()
    va_jpeg = False
    if va is not None:
        for device in va.devices:
            if device.render_node in render_nodes:
                va_profiles.update(device.encode_profiles)
                va_jpeg = va_jpeg or device.jpeg_encode
    usable = []
    for encoder in encoders:
        family = encoder.family
        if encoder.kind != "V" or family is None:
            continue
        if family == "nvenc":
            ok = cuda
        elif family == "vaapi":
            if encoder.codec == "mjpeg":
                ok = va_jpeg
            else:
                prefix = _VA_CODEC_PROFILE.get(encoder.codec)
                ok = prefix is not None and any(p.startswith(prefix) for p in va_profiles)
        elif family == "qsv":
            ok = intel
        elif family == "vulkan":
            ok = cuda or bool(render_nodes)
        else:
            ok = False
        if ok and encoder.name not in usable:
            usable.append(encoder.name)
    return sorted(usable)


# --------------------------------------------------------------------------
# Tier, labels, limitations


def node_tier(gpus: list[Gpu], ffmpeg_present: bool, framebuffer: bool = False) -> Tier:
    if gpus:
        return max(gpus, key=lambda g: TIER_SCORE[g.tier]).tier
    if ffmpeg_present:
        return "cpu_ffmpeg"
    return "framebuffer" if framebuffer else "relay"


def framebuffer_usable(resolution: str | None, parsed: ParsedFacts) -> tuple[bool, str | None]:
    """(usable, why not) for the framebuffer tier.

    Usable means /sys/class/graphics/fb0/virtual_size gave a real WIDTH,HEIGHT
    (parse_fb0 refuses "0,0" and odd text), so the kernel has a framebuffer to
    draw on: a Pi's or a thin client's panel, efifb/simpledrm on a box whose GPU
    has no driver. It is not usable when every display device the PCI sources
    show is a virtual machine's emulated adapter (QEMU VGA, Cirrus, virtio-gpu,
    QXL, VMware, VirtualBox): that fb0 is a console nobody sees. Without PCI
    facts (an ARM board with no PCI bus) fb0 is taken at its word.
    """
    if resolution is None:
        return False, None
    displays = _pci_displays(parsed)
    if displays and all(d.vendor_id in _EMULATED_DISPLAY_VENDORS for d in displays):
        slots = ", ".join(f"{d.vendor_id}:{d.device_id or '?'}" for d in displays)
        return False, f"framebuffer {resolution} belongs to an emulated display adapter ({slots}): not counted as the framebuffer tier"
    return True, None


_LABEL_BAD_RE = re.compile(r"[^a-z0-9_.:-]+")


def label_value(text: str) -> str:
    """Lowercased and cut to the label-value rules of model.py (63 characters,
    letters, digits, '-', '_', '.', ':', alphanumeric at both ends)."""
    value = _LABEL_BAD_RE.sub("-", text.lower())[:63]
    return re.sub(r"^[^a-z0-9]+|[^a-z0-9]+$", "", value)


_BRAND_WORDS = {"nvidia", "geforce", "amd", "ati", "radeon", "intel", "graphics", "corporation", "(r)", "(tm)"}


def gpu_slug(model: str) -> str:
    """'NVIDIA GeForce RTX 4070' -> 'rtx4070'; 'AMD Radeon RX 6600/6600 XT' -> 'rx6600';
    'Intel Iris Xe Graphics' -> 'irisxe'; 'AMD Raphael' -> 'raphael'."""
    first = model.split("/")[0]
    words = [w for w in re.split(r"\s+", first.lower()) if w]
    kept = [w for w in words if w not in _BRAND_WORDS] or words
    return label_value("".join(kept)) or "unknown"


def build_labels(
    host: str | None,
    tier: str,
    arch: str | None,
    gpus: list[Gpu],
    storage_label: str | None,
    tailscale: bool,
    pci_known: bool,
) -> dict[str, str]:
    labels: dict[str, str] = {}
    if host:
        labels[f"{LABEL_PREFIX}role"] = label_value(f"auto:{host}")
    labels[f"{LABEL_PREFIX}tier"] = tier
    if gpus:
        best = gpus[0]
        labels[f"{LABEL_PREFIX}gpu"] = label_value(f"{best.vendor}:{gpu_slug(best.model)}")
    elif pci_known:
        labels[f"{LABEL_PREFIX}gpu"] = "none"
    if arch:
        labels[f"{LABEL_PREFIX}arm64"] = "true" if arch == "aarch64" else "false"
    if storage_label:
        labels[f"{LABEL_PREFIX}storage-tier"] = storage_label
    labels[f"{LABEL_PREFIX}network"] = "tailscale" if tailscale else "none"
    return labels


# One task is sized as one ffmpeg/compute job: it keeps two hardware threads
# busy, needs about 2 GiB of RAM (decode surfaces, buffers, the interpreter)
# and, on a CUDA node, about 2 GiB of VRAM (NVENC/NVDEC surfaces plus a
# kernel's working set). 1 GiB of RAM stays with the OS and the fabric itself.
THREADS_PER_TASK = 2
MEMORY_MIB_PER_TASK = 2048
OS_RESERVE_MIB = 1024
VRAM_MIB_PER_TASK = 2048


def limitations_for(cpu_cores: int | None, memory_mib: int | None, tier: str, gpus: list[Gpu]) -> Limitations:
    """How many tasks at once by default, and the most vertical scaling may go to.

    Default = min(cores / 2, usable RAM / 2 GiB, CUDA VRAM / 2 GiB): every
    task gets its full share. Ceiling = min(cores, usable RAM / 2 GiB, CUDA
    VRAM / 2 GiB): one task per hardware thread is the most the CPU can
    interleave, and memory and VRAM never overcommit (an OOM kill or a CUDA
    out-of-memory fails the task instead of slowing it).
    """
    notes: list[str] = []
    if cpu_cores:
        cpu_default, cpu_ceiling = max(1, cpu_cores // THREADS_PER_TASK), cpu_cores
        notes.append(f"cpu: {cpu_cores} threads / {THREADS_PER_TASK} per task = {cpu_default} (ceiling {cpu_ceiling})")
    else:
        cpu_default = cpu_ceiling = 1
        notes.append("cpu: thread count unknown, 1 task")
    if memory_mib:
        mem_slots = max(1, (memory_mib - OS_RESERVE_MIB) // MEMORY_MIB_PER_TASK)
        notes.append(f"memory: ({memory_mib} - {OS_RESERVE_MIB}) MiB / {MEMORY_MIB_PER_TASK} MiB per task = {mem_slots}")
    else:
        mem_slots = 1
        notes.append("memory: size unknown, 1 task")
    default = min(cpu_default, mem_slots)
    ceiling = min(cpu_ceiling, mem_slots)
    vram_total: int | None = None
    if tier == "gpu_cuda":
        cuda = [g for g in gpus if g.tier == "gpu_cuda"]
        known = [g.vram_mib for g in cuda if g.vram_mib]
        if known:
            vram_total = sum(known)
            vram_slots = max(1, sum(v // VRAM_MIB_PER_TASK for v in known))
            notes.append(f"vram: {vram_total} MiB on {len(known)} CUDA GPU(s) / {VRAM_MIB_PER_TASK} MiB per task = {vram_slots}")
            default = min(default, vram_slots)
            ceiling = min(ceiling, vram_slots)
        else:
            notes.append("vram: unknown, not a bound")
    return Limitations(
        max_concurrent_tasks=max(1, default),
        max_concurrent_ceiling=max(1, default, ceiling),
        vram_mib=vram_total,
        notes=notes,
    )


# --------------------------------------------------------------------------
# Everything together


def build_node_facts(parsed: ParsedFacts, host: str | None = None) -> HostFacts:
    """The probe's answer. `host` is the fabric host name to report (the
    desired state's name); without it the machine's own host name is used."""
    missing = dict(parsed.missing)
    arch: str | None = parsed.get("arch")
    cores: int | None = parsed.get("cpu")
    memory: int | None = parsed.get("memory")
    hostname = host or parsed.get("hostname")

    gpus, gpu_missing, gpu_notes = collect_gpus(parsed)
    missing.update(gpu_missing)
    storage = collect_storage(parsed.get("storage") or ())
    encoders: tuple[Encoder, ...] | None = parsed.get("ffmpeg")
    ffmpeg = usable_hardware_encoders(encoders or (), gpus, parsed.get("vainfo"))
    resolution: str | None = parsed.get("framebuffer")
    framebuffer = Framebuffer(device="/dev/fb0", resolution=resolution) if resolution else None

    tailscale: TailscaleStatus | None = parsed.get("tailscale")
    if tailscale is not None and tailscale.relayed is None:
        missing["tailscale_relayed"] = "no active peer connection to judge the path by"

    fb_usable, fb_note = framebuffer_usable(resolution, parsed)
    tier = node_tier(gpus, encoders is not None, fb_usable)
    if fb_note and not gpus and encoders is None:
        # Only where it decided the tier: elsewhere a better tier wins anyway.
        gpu_notes.append(fb_note)
    limitations = limitations_for(cores, memory, tier, gpus)
    if gpu_notes:
        limitations = limitations.model_copy(update={"notes": [*limitations.notes, *gpu_notes]})
    os_release: OsRelease | None = parsed.get("os")
    pci_known = parsed.get("pci") is not None or parsed.get("pci_sysfs") is not None

    return HostFacts(
        tailnet_name=(tailscale.dns_name if tailscale and tailscale.dns_name else None) or hostname or "unknown",
        tailscale_ip=tailscale.ipv4 if tailscale else None,
        tailscale_relayed=tailscale.relayed if tailscale else None,
        k3s_hostname=hostname or "unknown",
        hardware=Hardware(
            arch=arch,
            cpu_cores=cores,
            memory_mib=memory,
            gpus=gpus,
            storage=storage,
            ffmpeg=ffmpeg,
            framebuffer=framebuffer,
        ),
        tier=tier,
        labels=build_labels(hostname, tier, arch, gpus, storage_tier_label(storage), tailscale is not None, pci_known),
        limitations=limitations,
        missing=dict(sorted(missing.items())),
        os=(
            OperatingSystem(id=os_release.id, id_like=list(os_release.id_like), name=os_release.name, version_id=os_release.version_id)
            if os_release
            else None
        ),
    )
