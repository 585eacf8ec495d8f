"""The catalogue of probe facts: each one a (source, pure parser) pair.

A fact names where its raw text comes from (a command or a file, with fallbacks
tried in order), the fixed file name that text is kept under in a capture
directory (DESIGN.md "Probe"), and the parser that turns it into a value. The
live collector (`reconciler.engine.probe`) reads the sources; a replay reads
the capture directory; both then parse the same text the same way, so any
capture replays to exactly the facts the live probe reported.

Pure data: nothing here runs a command or opens a file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from reconciler.core.probe import parsers


class Inputs(NamedTuple):
    """What a command's output is a function of, beside the program itself
    (its real path on PATH and the stat of that file): a pass whose memo
    holds the output the command gave when all of them were as they are now
    may reuse it instead of running the command (the memoized pass's probe,
    reconciler.engine.probe.collect_live_reusing). Only commands that print
    what files say, never a live state of their own, declare them; a full
    pass always runs every command.

    raws: raw outputs of this probe, by content (collected first);
    files: each by stat (size, mtime, ctime, inode; absent counts);
    contents: each by content (procfs files, whose stat never changes);
    entries: (directory, names): every entry of the directory, by name and
    link target, with each of `names` under it by content;
    block_mounts: mountinfo files, by their lines of block devices' file
    systems alone (a device number of a major other than 0, or a source
    under /dev/): a container's overlay, a tmpfs, a network file system
    mounted or gone is none of lsblk's business.

    A NamedTuple, not a dataclass: every memoized pass imports the
    catalogue, and a frozen dataclass costs its import half a millisecond."""

    raws: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    contents: tuple[str, ...] = ()
    entries: tuple[tuple[str, tuple[str, ...]], ...] = ()
    block_mounts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    # A probe must never hang a reconcile pass. nvidia-smi can take several
    # seconds to wake a GPU without persistence mode; the rest answer at once.
    timeout: float = 10.0
    # None: the command answers a live state (a driver that works, a
    # tailnet's peers): every probe runs it.
    inputs: Inputs | None = None


# Where lspci finds the names it prints beside the ids: pci.ids (Debian,
# Fedora, Arch, Alpine; gzipped on some) and udev's hwdb. On NixOS they are
# in the store, and a new one is a new lspci (its real path).
PCI_NAMES = (
    "/usr/share/misc/pci.ids",
    "/usr/share/misc/pci.ids.gz",
    "/usr/share/hwdata/pci.ids",
    "/usr/share/hwdata/pci.ids.gz",
    "/usr/share/pci.ids",
    "/usr/share/pci.ids.gz",
    "/etc/udev/hwdb.bin",
    "/usr/lib/udev/hwdb.bin",
    "/lib/udev/hwdb.bin",
)
# lspci -vmm -nn prints each device's ids (class, vendor, device, subsystem;
# sysfs-pci has them, and the driver, for every device) and their names.
LSPCI_INPUTS = Inputs(raws=("sysfs-pci",), files=PCI_NAMES)
# lsblk prints the block devices (/proc/partitions: every disk and
# partition and its size), where each sits (its /sys/block link: the
# transport), whether it rotates, and where each is mounted.
LSBLK_INPUTS = Inputs(contents=("/proc/partitions",), entries=(("/sys/block", ("queue/rotational",)),), block_mounts=("/proc/self/mountinfo",))
# ffmpeg -encoders prints what its libraries were built with: the program
# and the libraries it loads (a library installed or replaced runs
# ldconfig, which rewrites its cache; on NixOS a new library is a new
# ffmpeg store path).
FFMPEG_INPUTS = Inputs(files=("/etc/ld.so.cache",))


@dataclass(frozen=True)
class File:
    path: str


@dataclass(frozen=True)
class DriListing:
    """The names in /dev/dri, with /dev/dri/by-path links as "by-path/N -> T"."""

    path: str = "/dev/dri"


@dataclass(frozen=True)
class PerRenderNode:
    """A command run once per render node found by the `dri` fact; `{device}`
    in argv is replaced by the node's path. Outputs are joined, each under a
    header line `### /dev/dri/renderDN` (parsers.VAINFO_HEADER)."""

    argv: tuple[str, ...]
    timeout: float = 10.0


@dataclass(frozen=True)
class SysfsPci:
    """Every PCI device of /sys/bus/pci/devices (class, vendor, device,
    subsystem ids, bound driver) with the DRM nodes of /sys/class/drm that sit
    on it, one line a device (parsers.format_sysfs_pci_line). Needs no
    pciutils: Debian does not install lspci everywhere."""

    devices: str = "/sys/bus/pci/devices"
    drm: str = "/sys/class/drm"


Source = Command | File | DriListing | PerRenderNode | SysfsPci


@dataclass(frozen=True)
class Fact:
    name: str  # key in HostFacts.missing and in parsed values
    raw: str  # file name in a capture directory (fixed by DESIGN.md)
    sources: tuple[Source, ...]  # tried in order; the first that answers wins
    parser: Callable[[str], Any]
    description: str


FACTS: tuple[Fact, ...] = (
    # The kernel's files first: what `uname -m` and `hostname` print (the
    # UTS machine and node names), without a process each. /proc/sys/kernel/arch
    # is Linux 6.1's; an older kernel runs uname. (Under a 32-bit personality,
    # which no pass runs in, uname -m would say i686 where the file says x86_64.)
    Fact("arch", "uname-m", (File("/proc/sys/kernel/arch"), Command(("uname", "-m"))), parsers.parse_uname_m, "CPU architecture"),
    Fact("cpu", "cpuinfo", (File("/proc/cpuinfo"),), parsers.parse_cpuinfo, "logical CPU count"),
    Fact("memory", "meminfo", (File("/proc/meminfo"),), parsers.parse_meminfo, "total memory"),
    Fact(
        "os",
        "os-release",
        (File("/etc/os-release"), File("/usr/lib/os-release")),
        parsers.parse_os_release,
        "operating system",
    ),
    Fact(
        "hostname",
        "hostname",
        (File("/proc/sys/kernel/hostname"), Command(("hostname",))),
        parsers.parse_hostname,
        "host name",
    ),
    Fact("pci", "lspci", (Command(("lspci", "-vmm", "-nn"), inputs=LSPCI_INPUTS),), parsers.parse_lspci, "PCI display devices"),
    Fact("pci_sysfs", "sysfs-pci", (SysfsPci(),), parsers.parse_sysfs_pci, "PCI devices and their DRM nodes from sysfs"),
    Fact(
        "nvidia",
        "nvidia-smi",
        (
            Command(
                (
                    "nvidia-smi",
                    "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
                    "--format=csv,noheader,nounits",
                ),
                timeout=20.0,
            ),
        ),
        parsers.parse_nvidia_smi,
        "NVIDIA GPUs with a working driver",
    ),
    Fact("dri", "dri", (DriListing(),), parsers.parse_dri, "DRM render nodes"),
    Fact(
        "vainfo",
        "vainfo",
        (PerRenderNode(("vainfo", "--display", "drm", "--device", "{device}")),),
        parsers.parse_vainfo,
        "VA-API encode entrypoints per render node",
    ),
    Fact(
        "dri_groups",
        "dri-groups",
        (PerRenderNode(("stat", "--format=%G", "{device}")),),
        parsers.parse_dri_groups,
        "the group that may open each render node",
    ),
    Fact(
        "storage",
        "lsblk.json",
        (Command(("lsblk", "--json", "--bytes", "--output", "NAME,TYPE,SIZE,ROTA,TRAN,MOUNTPOINT"), inputs=LSBLK_INPUTS),),
        parsers.parse_lsblk,
        "disks",
    ),
    Fact(
        "ffmpeg",
        "ffmpeg-encoders",
        (Command(("ffmpeg", "-hide_banner", "-encoders"), inputs=FFMPEG_INPUTS),),
        parsers.parse_ffmpeg_encoders,
        "ffmpeg encoders",
    ),
    Fact("framebuffer", "fb0", (File("/sys/class/graphics/fb0/virtual_size"),), parsers.parse_fb0, "framebuffer"),
    Fact(
        "tailscale",
        "tailscale.json",
        (Command(("tailscale", "status", "--json"), timeout=10.0),),
        parsers.parse_tailscale_status,
        "Tailscale identity and paths",
    ),
)

RAW_NAMES: tuple[str, ...] = tuple(f.raw for f in FACTS)
# Beside the raw files a capture may hold the reason each absent one is absent.
ERRORS_FILE = "errors.json"
