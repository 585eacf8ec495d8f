"""Pure parsers: one raw probe output (text) in, one typed value out.

Every parser takes the exact text a command printed or a file held and either
returns a value or raises `ParseError` with a reason a human can act on. They
never raise anything else, whatever the text (a property test feeds them
random text), so an odd machine can never crash the probe: the caller records
the reason under `HostFacts.missing` instead.

Where one part of an output is odd but the rest is usable (one GPU reports
`[N/A]` for its memory, one render node's vainfo failed), the parser keeps the
usable part and lists the odd part in a `problems` tuple.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class ParseError(ValueError):
    """The output cannot be used; the message says why."""


def _first_line(text: str, limit: int = 160) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "(empty)"


def _nonempty(text: str, what: str) -> str:
    if not text.strip():
        raise ParseError(f"{what} is empty")
    return text


# --------------------------------------------------------------------------
# uname -m

# What `uname -m` may say, mapped to the fleet's arch names (model.ARCHES).
_ARCH_ALIASES = {
    "x86_64": "x86_64",
    "amd64": "x86_64",
    "aarch64": "aarch64",
    "arm64": "aarch64",
}
_ARCH_RE = re.compile(r"^[a-z0-9_]{2,16}$")


def parse_uname_m(text: str) -> str:
    value = _nonempty(text, "uname -m output").strip()
    if value in _ARCH_ALIASES:
        return _ARCH_ALIASES[value]
    # Another real machine name (riscv64, armv7l, ppc64le) is kept as is: the
    # scheduler simply finds no service built for it.
    if _ARCH_RE.match(value):
        return value
    raise ParseError(f"not a machine name: {_first_line(value)!r}")


# --------------------------------------------------------------------------
# /proc/cpuinfo

_PROCESSOR_RE = re.compile(r"^processor\s*:\s*\d+\s*$", re.M)


def parse_cpuinfo(text: str) -> int:
    """Logical CPUs: one `processor : N` stanza each (x86 and arm64 alike).

    Logical, not physical, because concurrency is what the scheduler sizes:
    two ffmpeg threads on one hyperthreaded core still run side by side.
    """
    count = len(_PROCESSOR_RE.findall(text))
    if count == 0:
        raise ParseError("no 'processor : N' entries")
    return count


# --------------------------------------------------------------------------
# /proc/meminfo

_MEMTOTAL_RE = re.compile(r"^MemTotal:\s+(\d+)\s+kB\s*$", re.M)


def parse_meminfo(text: str) -> int:
    """MemTotal in MiB."""
    match = _MEMTOTAL_RE.search(text)
    if match is None:
        raise ParseError("no 'MemTotal: N kB' line")
    mib = int(match.group(1)) // 1024
    if mib <= 0:
        raise ParseError(f"MemTotal is {match.group(1)} kB")
    return mib


# --------------------------------------------------------------------------
# /etc/os-release


@dataclass(frozen=True)
class OsRelease:
    id: str
    id_like: tuple[str, ...] = ()
    name: str | None = None
    version_id: str | None = None


_OS_LINE_RE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return re.sub(r"\\(.)", r"\1", value)


def parse_os_release(text: str) -> OsRelease:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        match = _OS_LINE_RE.match(line.strip())
        if match:
            fields[match.group(1)] = _unquote(match.group(2))
    os_id = fields.get("ID", "").strip().lower()
    if not re.match(r"^[a-z0-9._-]{1,64}$", os_id):
        raise ParseError("no usable ID= line")
    return OsRelease(
        id=os_id,
        id_like=tuple(w for w in fields.get("ID_LIKE", "").lower().split() if re.match(r"^[a-z0-9._-]{1,64}$", w)),
        name=(fields.get("PRETTY_NAME") or fields.get("NAME") or None),
        version_id=fields.get("VERSION_ID") or None,
    )


# --------------------------------------------------------------------------
# hostname

_HOST_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def parse_hostname(text: str) -> str:
    """The short host name, lowercased (`hostname` may print an FQDN)."""
    value = _nonempty(text, "hostname").strip().split(".")[0].lower()
    if not _HOST_RE.match(value):
        raise ParseError(f"not a host name: {_first_line(text)!r}")
    return value


# --------------------------------------------------------------------------
# lspci -vmm -nn


@dataclass(frozen=True)
class PciDisplay:
    """One display-class PCI device (VGA, 3D or display controller)."""

    slot: str  # domain:bus:device.function, e.g. 0000:01:00.0
    class_code: str  # 0300, 0302, 0380
    vendor_id: str  # 10de, 1002, 8086
    vendor_name: str
    device_id: str | None
    device_name: str

    @property
    def bus(self) -> str:
        return self.slot.split(":")[1]


_TRAILING_ID_RE = re.compile(r"^(.*?)\s*\[([0-9a-fA-F]{4})\]\s*$")
_SLOT_RE = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_pci_slot(value: str) -> str | None:
    """'01:00.0', '0000:01:00.0' and nvidia-smi's '00000000:01:00.0' -> '0000:01:00.0'."""
    match = _SLOT_RE.match(value.strip())
    if match is None:
        return None
    domain = (match.group(1) or "0").lower()
    return f"{int(domain, 16):04x}:{match.group(2).lower()}:{match.group(3).lower()}.{match.group(4)}"


def _split_id(value: str) -> tuple[str, str | None]:
    """'NVIDIA Corporation [10de]' -> ('NVIDIA Corporation', '10de')."""
    match = _TRAILING_ID_RE.match(value)
    if match is None:
        return value.strip(), None
    return match.group(1).strip(), match.group(2).lower()


def parse_lspci(text: str) -> tuple[PciDisplay, ...]:
    """Display controllers from `lspci -vmm -nn` (records split by blank lines).

    An empty result is a valid answer (a VPS may expose no display device);
    output without a single `Slot:` record is not lspci output.
    """
    records: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if current:
                records.append(current)
                current = {}
            continue
        # "Key:\tValue"; the value may hold colons itself (the slot does).
        key, sep, value = line.partition(":")
        if sep and re.match(r"^[A-Za-z]+$", key):
            current.setdefault(key, value.strip())
    if not any("Slot" in r for r in records):
        raise ParseError(f"no 'Slot:' records: {_first_line(text)!r}")
    displays = []
    for record in records:
        slot = normalize_pci_slot(record.get("Slot", ""))
        class_name, class_code = _split_id(record.get("Class", ""))
        if slot is None or class_code is None:
            # Without -nn the class has no code; fall back on its name.
            if slot is None or not re.search(r"VGA|3D|Display", class_name):
                continue
            class_code = "0300"
        if not class_code.startswith("03"):
            continue
        vendor_name, vendor_id = _split_id(record.get("Vendor", ""))
        device_name, device_id = _split_id(record.get("Device", ""))
        if vendor_id is None:
            continue
        displays.append(PciDisplay(slot, class_code, vendor_id, vendor_name, device_id, device_name))
    return tuple(displays)


# --------------------------------------------------------------------------
# sysfs PCI devices (the `sysfs-pci` raw file)
#
# One line a PCI device, as the collector writes it from sysfs:
#
#   0000:03:00.0 class=0x030000 vendor=0x1002 device=0x73ff subsystem=0x1da2:0xe448 driver=amdgpu drm=card1,renderD128
#
# the slot (the name in /sys/bus/pci/devices), then key=value fields: class,
# vendor and device as the sysfs files print them; subsystem is
# subsystem_vendor:subsystem_device; driver the name the device's `driver`
# link points at; drm the /sys/class/drm cards and render nodes whose device
# path runs through this slot. A field the kernel does not show (no driver
# bound, no DRM node) is left out. Lines starting with '#' are comments. An
# empty file is a valid answer: a PCI bus with no device on it.

_SYSFS_HEX = {"class": 6, "vendor": 4, "device": 4}
_SYSFS_FIELD_ORDER = ("class", "vendor", "device", "subsystem", "driver", "drm")
_DRM_NODE_RE = re.compile(r"^(card|renderD)(\d+)$")
_PATH_SLOT_RE = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_DRIVER_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class SysfsPciDevice:
    slot: str  # 0000:03:00.0
    class_code: str  # "030000": class, subclass, programming interface
    vendor_id: str  # "1002"
    device_id: str  # "73ff"
    subsystem: str | None = None  # "1da2:e448"
    driver: str | None = None  # "amdgpu", "i915", "xe", "nvidia", "nouveau", ...
    drm: tuple[str, ...] = ()  # ("card1", "renderD128")

    @property
    def display(self) -> bool:
        return self.class_code.startswith("03")

    @property
    def render_node(self) -> str | None:
        return next((n for n in self.drm if n.startswith("renderD")), None)

    @property
    def bus(self) -> str:
        return self.slot.split(":")[1]


@dataclass(frozen=True)
class SysfsPci:
    devices: tuple[SysfsPciDevice, ...]
    # (line N, reason) for each line that was not understood.
    problems: tuple[tuple[str, str], ...] = ()

    def displays(self) -> tuple[SysfsPciDevice, ...]:
        return tuple(d for d in self.devices if d.display)


def _drm_key(name: str) -> tuple[int, int]:
    match = _DRM_NODE_RE.match(name)
    return (0 if match.group(1) == "card" else 1, int(match.group(2))) if match else (2, 0)


def pci_slot_in_path(path: str) -> str | None:
    """The last PCI slot in a sysfs device path: '../../devices/pci0000:00/
    0000:00:01.1/0000:03:00.0/drm/card1' -> '0000:03:00.0' (bridges come
    before the device; a virtio GPU's 'virtio0' after it)."""
    slots = [part for part in path.split("/") if _PATH_SLOT_RE.match(part)]
    return normalize_pci_slot(slots[-1]) if slots else None


def format_sysfs_pci_line(slot: str, fields: dict[str, str | None], drm: list[str]) -> str:
    """One device's line, fields in a fixed order, absent ones left out (so a
    capture is the same text every time)."""
    values = {key: (value or "").strip() for key, value in fields.items()}
    nodes = sorted({n for n in drm if _DRM_NODE_RE.match(n)}, key=_drm_key)
    if nodes:
        values["drm"] = ",".join(nodes)
    parts = [slot.strip()]
    parts.extend(f"{key}={values[key]}" for key in _SYSFS_FIELD_ORDER if values.get(key) and " " not in values[key])
    return " ".join(parts) + "\n"


def _sysfs_hex(value: str | None, digits: int) -> str | None:
    if value is None:
        return None
    text = value.lower().removeprefix("0x")
    return text if re.match(rf"^[0-9a-f]{{{digits}}}$", text) else None


def _parse_sysfs_line(line: str) -> SysfsPciDevice:
    head, *rest = line.split()
    slot = normalize_pci_slot(head)
    if slot is None:
        raise ParseError(f"not a PCI slot: {head[:40]!r}")
    fields: dict[str, str] = {}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep:
            raise ParseError(f"not key=value: {part[:40]!r}")
        fields.setdefault(key, value)
    codes: dict[str, str] = {}
    for key, digits in _SYSFS_HEX.items():
        code = _sysfs_hex(fields.get(key), digits)
        if code is None:
            raise ParseError(f"{key} is {fields.get(key, '(none)')[:20]!r}, not {digits} hex digits")
        codes[key] = code
    subsystem = None
    vendor_part, _, device_part = fields.get("subsystem", "").partition(":")
    sub_vendor, sub_device = _sysfs_hex(vendor_part, 4), _sysfs_hex(device_part, 4)
    if sub_vendor and sub_device:
        subsystem = f"{sub_vendor}:{sub_device}"
    driver = fields.get("driver")
    drm = tuple(sorted({n for n in fields.get("drm", "").split(",") if _DRM_NODE_RE.match(n)}, key=_drm_key))
    return SysfsPciDevice(
        slot=slot,
        class_code=codes["class"],
        vendor_id=codes["vendor"],
        device_id=codes["device"],
        subsystem=subsystem,
        driver=driver if driver and _DRIVER_RE.match(driver) else None,
        drm=drm,
    )


def parse_sysfs_pci(text: str) -> SysfsPci:
    devices: list[SysfsPciDevice] = []
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            device = _parse_sysfs_line(line)
        except ParseError as exc:
            problems.append((f"line {number}", str(exc)))
            continue
        if device.slot in seen:
            problems.append((f"line {number}", f"{device.slot} listed twice"))
            continue
        seen.add(device.slot)
        devices.append(device)
    if problems and not devices:
        raise ParseError("no device line understood: " + "; ".join(f"{n}: {r}" for n, r in problems)[:200])
    return SysfsPci(tuple(devices), tuple(problems))


# --------------------------------------------------------------------------
# nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id
#            --format=csv,noheader,nounits

# nvidia-smi prints these (to stdout, exit 9/6) instead of CSV.
_NVIDIA_FAILURES = (
    "NVIDIA-SMI has failed",
    "No devices were found",
    "couldn't communicate with the NVIDIA driver",
    "Failed to initialize NVML",
    "Driver/library version mismatch",
)
_NOT_AVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "[Insufficient Permissions]", ""}


@dataclass(frozen=True)
class NvidiaGpu:
    index: int
    name: str
    vram_mib: int | None
    driver: str | None
    pci_slot: str | None


@dataclass(frozen=True)
class NvidiaReport:
    gpus: tuple[NvidiaGpu, ...]
    # Odd values kept out of the facts, as (subject, reason):
    # ("gpu 0 memory.total", "odd value '[N/A]'").
    problems: tuple[tuple[str, str], ...] = ()


def parse_nvidia_smi(text: str) -> NvidiaReport:
    for marker in _NVIDIA_FAILURES:
        if marker.lower() in text.lower():
            raise ParseError(_first_line(text, 200))
    gpus: list[NvidiaGpu] = []
    problems: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5 or not parts[0].isdigit():
            problems.append((f"line {number}", f"not understood: {line.strip()[:120]!r}"))
            continue
        index = int(parts[0])
        name, memory, driver, bus_id = parts[1:]
        if name in _NOT_AVAILABLE:
            problems.append((f"gpu {index} name", f"odd value {name!r}"))
            name = "NVIDIA GPU"
        vram: int | None = None
        if memory.isdigit() and int(memory) > 0:
            vram = int(memory)
        else:
            problems.append((f"gpu {index} memory.total", f"odd value {memory[:40]!r}"))
        if driver in _NOT_AVAILABLE or not re.match(r"^[0-9][0-9.]*$", driver):
            problems.append((f"gpu {index} driver_version", f"odd value {driver[:40]!r}"))
            driver_value = None
        else:
            driver_value = driver
        slot = normalize_pci_slot(bus_id)
        if slot is None:
            problems.append((f"gpu {index} pci.bus_id", f"odd value {bus_id[:40]!r}"))
        gpus.append(NvidiaGpu(index, name, vram, driver_value, slot))
    if not gpus:
        detail = "; ".join(f"{subject} {reason}" for subject, reason in problems) or "(empty)"
        raise ParseError(f"no GPU line understood: {detail[:200]}")
    return NvidiaReport(tuple(gpus), tuple(problems))


# --------------------------------------------------------------------------
# /dev/dri listing
#
# One name a line as in /dev/dri ("card0", "renderD128"). Entries of
# /dev/dri/by-path are written as "by-path/NAME -> TARGET" (the symlink as
# stored), which is how a render node is tied to its PCI device.

_BY_PATH_RE = re.compile(r"^by-path/pci-([0-9a-fA-F:.]+)-render\s*->\s*(?:\.\./)?(renderD\d+)$")


@dataclass(frozen=True)
class DriNodes:
    render_nodes: tuple[str, ...]  # "renderD128", numerically ordered
    cards: tuple[str, ...]
    render_by_slot: dict[str, str] = field(default_factory=dict)  # "0000:01:00.0" -> "renderD128"


def parse_dri(text: str) -> DriNodes:
    renders: set[str] = set()
    cards: set[str] = set()
    by_slot: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if re.match(r"^renderD\d+$", line):
            renders.add(line)
        elif re.match(r"^card\d+$", line):
            cards.add(line)
        elif line.startswith("by-path"):
            match = _BY_PATH_RE.match(line)
            if match:
                slot = normalize_pci_slot(match.group(1))
                if slot is not None:
                    by_slot[slot] = match.group(2)
        # Anything else in /dev/dri is not ours to judge.
    if not renders and not cards:
        raise ParseError("no card or render node")
    # A by-path link to a node the listing does not show is stale: drop it.
    by_slot = {slot: node for slot, node in by_slot.items() if node in renders}
    return DriNodes(
        render_nodes=tuple(sorted(renders, key=lambda n: int(n[len("renderD") :]))),
        cards=tuple(sorted(cards, key=lambda n: int(n[len("card") :]))),
        render_by_slot=by_slot,
    )


# --------------------------------------------------------------------------
# vainfo
#
# The probe runs `vainfo --display drm --device /dev/dri/renderDN` once per
# render node and keeps each output under a header line "### /dev/dri/renderDN".
# Output without any header is one plain `vainfo` run, which opens renderD128.

VAINFO_HEADER = "### "
_VA_ENTRY_RE = re.compile(r"^\s*(VAProfile\w+)\s*:\s*(VAEntrypoint\w+)\s*$")
_VA_DRIVER_RE = re.compile(r"Driver version:\s*(.+)$", re.M)
# Entrypoints that encode video (EncPicture is JPEG stills, not video).
VA_ENCODE_ENTRYPOINTS = ("VAEntrypointEncSlice", "VAEntrypointEncSliceLP")


@dataclass(frozen=True)
class VaDevice:
    render_node: str  # "renderD128"
    driver: str | None
    encode_profiles: tuple[str, ...]  # "VAProfileH264High", ...
    jpeg_encode: bool = False


@dataclass(frozen=True)
class VaInfo:
    devices: tuple[VaDevice, ...]
    # (render node or section, reason) for each device that did not answer.
    problems: tuple[tuple[str, str], ...] = ()

    def on(self, render_node: str | None) -> VaDevice | None:
        return next((d for d in self.devices if d.render_node == render_node), None)


def _parse_va_section(node: str, text: str) -> VaDevice:
    if "vaInitialize failed" in text or "Supported profile" not in text:
        failure = next(
            (ln.strip() for ln in text.splitlines() if "failed" in ln or "error" in ln.lower()),
            _first_line(text),
        )
        raise ParseError(failure[:200])
    driver_match = _VA_DRIVER_RE.search(text)
    encode: list[str] = []
    jpeg = False
    for line in text.splitlines():
        match = _VA_ENTRY_RE.match(line)
        if match is None:
            continue
        profile, entrypoint = match.groups()
        if entrypoint in VA_ENCODE_ENTRYPOINTS and profile not in encode:
            encode.append(profile)
        elif entrypoint == "VAEntrypointEncPicture":
            jpeg = True
    return VaDevice(node, driver_match.group(1).strip() if driver_match else None, tuple(encode), jpeg)


def parse_vainfo(text: str) -> VaInfo:
    _nonempty(text, "vainfo output")
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(VAINFO_HEADER):
            node = line[len(VAINFO_HEADER) :].strip().rsplit("/", 1)[-1]
            sections.append((node, []))
        else:
            if not sections:
                sections.append(("renderD128", []))
            sections[-1][1].append(line)
    devices: list[VaDevice] = []
    problems: list[tuple[str, str]] = []
    for node, lines in sections:
        if not re.match(r"^renderD\d+$", node):
            problems.append((node[:60], "section header is not a render node"))
            continue
        try:
            devices.append(_parse_va_section(node, "\n".join(lines)))
        except ParseError as exc:
            problems.append((node, str(exc)))
    if not devices:
        raise ParseError("; ".join(f"{n}: {r}" for n, r in problems) or "no device answered")
    return VaInfo(tuple(devices), tuple(problems))


# --------------------------------------------------------------------------
# stat --format=%G per render node
#
# The group that owns each render node, one `stat` run per node under the
# vainfo header lines. A unit's dynamic user opens /dev/dri/renderDN only
# through that group (mode 0660 root:render on Debian and Arch, root:video on
# older distributions), so the renderer gives GPU units exactly this group.

_GROUP_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$")


def parse_dri_groups(text: str) -> dict[str, str]:
    """{"renderD128": "render", ...}; a section whose group is not a plain group name is left out."""
    _nonempty(text, "stat output")
    groups: dict[str, str] = {}
    node: str | None = None
    for line in text.splitlines():
        if line.startswith(VAINFO_HEADER):
            node = line[len(VAINFO_HEADER) :].strip().rsplit("/", 1)[-1]
            continue
        name = line.strip()
        if node is not None and re.match(r"^renderD\d+$", node) and _GROUP_RE.match(name) and node not in groups:
            groups[node] = name
    if not groups:
        raise ParseError("no render node's group in the stat output")
    return groups


# --------------------------------------------------------------------------
# lsblk --json --bytes --output NAME,TYPE,SIZE,ROTA,TRAN,MOUNTPOINT


@dataclass(frozen=True)
class BlockDisk:
    name: str
    size_bytes: int
    rotational: bool | None
    transport: str | None
    # Mount points of the disk and everything on it (partitions, LVM, LUKS).
    mounts: tuple[str, ...]


def _as_bool(value: Any) -> bool | None:
    # util-linux before 2.33 printed "0"/"1" strings; later versions booleans.
    if isinstance(value, bool):
        return value
    if value in ("1", 1):
        return True
    if value in ("0", 0):
        return False
    return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _mounts(node: dict[str, Any]) -> list[str]:
    found: list[str] = []
    values: list[Any] = [node.get("mountpoint")]
    if isinstance(node.get("mountpoints"), list):
        values.extend(node["mountpoints"])
    for value in values:
        if isinstance(value, str) and value.startswith("/") and value not in found:
            found.append(value)
    children = node.get("children")
    if isinstance(children, list):
        for child in children:
            if isinstance(child, dict):
                found.extend(m for m in _mounts(child) if m not in found)
    return found


# Block devices that are not storage: compressed RAM, loop images, RAM disks.
_NOT_STORAGE_RE = re.compile(r"^(zram|loop|ram|nbd|fd)\d*")


def parse_lsblk(text: str) -> tuple[BlockDisk, ...]:
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ParseError(f"not JSON: {str(exc)[:120]}") from None
    devices = document.get("blockdevices") if isinstance(document, dict) else None
    if not isinstance(devices, list):
        raise ParseError("no 'blockdevices' list")
    try:
        return tuple(_disks(devices))
    except RecursionError:
        raise ParseError("nested too deeply") from None


def _disks(devices: list[Any]) -> list[BlockDisk]:
    disks = []
    for device in devices:
        if not isinstance(device, dict) or device.get("type") != "disk":
            continue
        name = device.get("name")
        size = _as_int(device.get("size"))
        if not isinstance(name, str) or _NOT_STORAGE_RE.match(name) or not size:
            continue
        transport = device.get("tran") if isinstance(device.get("tran"), str) else None
        disks.append(BlockDisk(name, size, _as_bool(device.get("rota")), transport, tuple(_mounts(device))))
    return disks


# --------------------------------------------------------------------------
# ffmpeg -hide_banner -encoders

# " V....D h264_nvenc           NVIDIA NVENC H.264 encoder (codec h264)"
_ENCODER_RE = re.compile(r"^\s([VAS])[F.][S.][X.][B.][D.]\s+(\S+)\s")

# Name parts that mark an encoder driven by hardware rather than the CPU.
HARDWARE_ENCODER_FAMILIES = (
    "nvenc",
    "vaapi",
    "qsv",
    "amf",
    "vulkan",
    "v4l2m2m",
    "omx",
    "rkmpp",
    "mediacodec",
    "videotoolbox",
    "mf",
    "d3d12va",
)


@dataclass(frozen=True)
class Encoder:
    name: str
    kind: str  # "V" video, "A" audio, "S" subtitle

    @property
    def family(self) -> str | None:
        """The hardware family ('nvenc', 'vaapi', ...) or None for a CPU encoder."""
        # "hevc_nvenc", "h264_vaapi"; the old bare aliases are "nvenc",
        # "nvenc_h264" and "nvenc_hevc".
        parts = self.name.split("_")
        return next((p for p in parts if p in HARDWARE_ENCODER_FAMILIES), None)

    @property
    def codec(self) -> str:
        """'h264_vaapi' -> 'h264'."""
        return self.name.split("_")[0]


def parse_ffmpeg_encoders(text: str) -> tuple[Encoder, ...]:
    if "Encoders:" not in text:
        raise ParseError(f"no 'Encoders:' list: {_first_line(text)!r}")
    encoders = []
    for line in text.split("Encoders:", 1)[1].splitlines():
        match = _ENCODER_RE.match(line)
        # The legend's own lines ("V..... = Video") are not encoders.
        if match and match.group(2) != "=":
            encoders.append(Encoder(match.group(2), match.group(1)))
    if not encoders:
        raise ParseError("the encoder list is empty")
    return tuple(encoders)


# --------------------------------------------------------------------------
# /sys/class/graphics/fb0/virtual_size: "3840,2160"

_FB_RE = re.compile(r"^\s*(\d{1,5}),(\d{1,5})\s*$")


def parse_fb0(text: str) -> str:
    match = _FB_RE.match(text)
    if match is None or int(match.group(1)) == 0 or int(match.group(2)) == 0:
        raise ParseError(f"not 'WIDTH,HEIGHT': {_first_line(text)!r}")
    return f"{int(match.group(1))}x{int(match.group(2))}"


# --------------------------------------------------------------------------
# tailscale status --json


@dataclass(frozen=True)
class TailscaleStatus:
    dns_name: str | None  # "qfox-1.tail-abc123.ts.net" (no trailing dot)
    ipv4: str | None
    # True when every active peer connection goes through a DERP relay (the
    # node sits behind a NAT that defeats hole punching), False when at least
    # one is direct, None when no peer connection is active to judge by.
    relayed: bool | None
    relayed_peers: tuple[str, ...] = ()


def parse_tailscale_status(text: str) -> TailscaleStatus:
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise ParseError(f"not JSON: {_first_line(text)!r}") from None
    if not isinstance(document, dict):
        raise ParseError("not a JSON object")
    state = document.get("BackendState")
    if state != "Running":
        raise ParseError(f"tailscale is not running (BackendState {str(state)[:40]!r})")
    me_entry = document.get("Self")
    me: dict[str, Any] = me_entry if isinstance(me_entry, dict) else {}
    dns = me.get("DNSName")
    dns_name = dns.rstrip(".").lower() if isinstance(dns, str) and dns.strip(".") else None
    addresses = me.get("TailscaleIPs") or document.get("TailscaleIPs") or []
    if not isinstance(addresses, list):
        addresses = []
    ipv4 = next((a for a in addresses if isinstance(a, str) and re.match(r"^\d+\.\d+\.\d+\.\d+$", a)), None)
    if ipv4 is None and dns_name is None:
        raise ParseError("no address and no DNS name for this node")
    peer_entry = document.get("Peer")
    peers: dict[str, Any] = peer_entry if isinstance(peer_entry, dict) else {}
    active = 0
    relayed_peers = []
    for peer in peers.values():
        # CurAddr is only filled in while a connection is in use, so only
        # active peers say anything about the path.
        if not isinstance(peer, dict) or not peer.get("Online") or not peer.get("Active"):
            continue
        active += 1
        # Relay is the peer's home DERP region, set whatever the path; the
        # path is DERP only when there is neither a direct address nor a peer
        # relay (tailscale >= 1.86: PeerRelay "ip:port:vni:N"), the rule of
        # tailscale's own CLI (cmd/tailscale/cli/status.go). A peer relay is a
        # UDP path through another node of the tailnet: not DERP's latency.
        if peer.get("Relay") and not peer.get("CurAddr") and not peer.get("PeerRelay"):
            relayed_peers.append(str(peer.get("HostName") or peer.get("DNSName") or "?")[:63])
    # A direct path to any peer shows this node's own NAT lets paths through;
    # a peer that is relayed is that peer's problem (its probe says so).
    relayed = None if active == 0 else len(relayed_peers) == active
    return TailscaleStatus(dns_name, ipv4, relayed, tuple(sorted(relayed_peers)))


def offline_peers(text: str, hosts: Iterable[str]) -> dict[str, str]:
    """`tailscale status --json` as a source of suspicion (issue 30): each of
    `hosts` (fabric host names) whose peer is in the status and not Online,
    with what tailscale says. A peer is matched by the first label of its
    DNSName, else its HostName (lowercased). Raises ParseError."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise ParseError(f"not JSON: {_first_line(text)!r}") from None
    if not isinstance(document, dict) or document.get("BackendState") != "Running":
        raise ParseError("tailscale is not running")
    wanted = set(hosts)
    peers = document.get("Peer")
    out: dict[str, str] = {}
    for peer in (peers if isinstance(peers, dict) else {}).values():
        if not isinstance(peer, dict) or peer.get("Online") is not False:
            continue
        dns = peer.get("DNSName")
        names = [dns.split(".", 1)[0].lower()] if isinstance(dns, str) and dns else []
        if isinstance(peer.get("HostName"), str):
            names.append(peer["HostName"].lower())
        host = next((n for n in names if n in wanted), None)
        if host is not None:
            seen = peer.get("LastSeen")
            out[host] = f"peer offline (last seen {str(seen)[:32]})" if isinstance(seen, str) and seen else "peer offline"
    return out
