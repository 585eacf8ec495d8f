"""A memoized pass's probe reuses what lspci, lsblk and ffmpeg printed while their inputs are unchanged.

Those commands print what files say (core.probe.facts.Inputs): the PCI
devices of sysfs and the names databases, the block devices and the mounts,
the libraries ffmpeg was built with. `collect_live_reusing` stamps those
inputs (and the program's real path and stat) before running each, and a
probe given an earlier probe's stamps and outputs (the pass memo's) takes
the output instead of running the command when the stamp is the same.
Every other command runs on every probe; a full pass runs them all.

Here: the collector on a fake machine (every input changed once), the memo's
side of a pass on fake ports (what it lends the probe, and the full pass's
fresh probe), and whole passes with a counting lspci on PATH.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from reconciler.core.probe.facts import FACTS, FFMPEG_INPUTS, LSBLK_INPUTS, LSPCI_INPUTS, PCI_NAMES, Command
from reconciler.engine.pass_memo import MEMO_FILE, MemoSeed, PassMemo
from reconciler.engine.probe import collect_live, collect_live_reusing, reusable_inputs
from reconciler.ports import CommandResult
from tests.conftest import REPO
from tests.support.cli import fabric
from tests.support.memo_sandbox import GOLDEN, STATE, MemoFilesInMemory, Sandbox, audit_on_stderr, memoized

__all__ = ["audit_on_stderr"]  # its autouse fixture applies here

REUSED = {"lspci", "lsblk.json", "ffmpeg-encoders"}
LSPCI_OUTPUT = REPO / "tests" / "fixtures" / "probe" / "x86-spill" / "lspci"


class Machine:
    """A CommandRunner and ProbeFiles: programs answer fixed text; files,
    links, stats and directories are dicts the tests change."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.programs = {name: f"/usr/bin/{name}:1:1:1:1" for name in ("lspci", "lsblk", "ffmpeg", "tailscale", "nvidia-smi", "uname", "hostname")}
        self.answers = {
            "lspci": "Slot:\t00:02.0\nClass:\tVGA compatible controller [0300]\nVendor:\tIntel Corporation [8086]\nDevice:\tUHD [9a49]\n",
            "lsblk": '{"blockdevices": [{"name": "nvme0n1", "type": "disk", "size": 512110190592, "rota": false, "tran": "nvme", "mountpoint": "/"}]}',
            "ffmpeg": "Encoders:\n V....D libx264              libx264 H.264\n",
            "tailscale": '{"Self": {"DNSName": "edge.tail-1.ts.net.", "TailscaleIPs": ["100.64.0.1"]}}',
        }
        self.files = {
            "/sys/bus/pci/devices/0000:00:02.0/class": "0x030000\n",
            "/sys/bus/pci/devices/0000:00:02.0/vendor": "0x8086\n",
            "/sys/bus/pci/devices/0000:00:02.0/device": "0x9a49\n",
            "/proc/partitions": "major minor  #blocks  name\n 259 0 500107608 nvme0n1\n",
            "/proc/self/mountinfo": "22 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw\n",
            "/sys/block/nvme0n1/queue/rotational": "0\n",
            "/proc/sys/kernel/hostname": "edge\n",
            "/proc/sys/kernel/arch": "x86_64\n",
        }
        self.links = {"/sys/block/nvme0n1": "../devices/pci0000:00/0000:00:06.0/nvme/nvme0/nvme0n1"}
        self.dirs = {"/sys/bus/pci/devices": ["0000:00:02.0"], "/sys/block": ["nvme0n1"]}
        self.stats = {"/usr/share/misc/pci.ids": "1:1:1:1", "/etc/ld.so.cache": "2:2:2:2"}

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        self.calls.append(argv[0])
        if argv[0] not in self.answers:
            return CommandResult(argv, None, missing=True)
        return CommandResult(argv, 0, self.answers[argv[0]])

    def read_text(self, path: str) -> str:
        if path not in self.files:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return self.files[path]

    def list_dir(self, path: str) -> list[str]:
        if path not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return sorted(self.dirs[path])

    def read_link(self, path: str) -> str:
        if path not in self.links:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return self.links[path]

    def stat(self, path: str) -> str:
        if path not in self.stats:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return self.stats[path]

    def program(self, name: str) -> str | None:
        return self.programs.get(name)


def runs(machine: Machine, reuse: dict | None) -> list[str]:  # type: ignore[type-arg]
    machine.calls.clear()
    collect_live_reusing(machine, machine, reuse)
    return sorted(set(machine.calls))


def test_the_catalogue_declares_inputs_for_lspci_lsblk_and_ffmpeg_alone() -> None:
    """Only commands that print what files say may be reused: tailscale's and
    nvidia-smi's answers are live states (a tailnet's, a driver that works)."""
    declared = {fact.raw for fact in FACTS if reusable_inputs(fact) is not None}
    assert declared == REUSED
    sources = [s for f in FACTS for s in f.sources if isinstance(s, Command) and s.inputs is not None]
    assert {s.argv[0] for s in sources} == {"lspci", "lsblk", "ffmpeg"}


def test_a_probe_reusing_nothing_runs_every_command_and_gives_collect_lives_capture() -> None:
    machine = Machine()
    plain = collect_live(machine, machine)
    machine.calls.clear()
    live = collect_live_reusing(machine, machine, None)
    assert live.capture == plain and live.reused == ()
    assert set(live.stamps) == REUSED
    assert {"lspci", "lsblk", "ffmpeg", "tailscale", "nvidia-smi"} <= set(machine.calls)
    # The kernel's files answer for hostname and uname -m.
    assert "hostname" not in machine.calls and "uname" not in machine.calls


def test_an_unchanged_machine_runs_no_command_that_declares_its_inputs() -> None:
    machine = Machine()
    first = collect_live_reusing(machine, machine, None)
    machine.calls.clear()
    second = collect_live_reusing(machine, machine, first.reusable())
    assert sorted(second.reused) == sorted(REUSED)
    assert second.capture == first.capture and second.stamps == first.stamps
    # Commands without declared inputs still run: a tailnet, a driver, change by themselves.
    assert sorted(set(machine.calls)) == ["nvidia-smi", "tailscale"]


def test_a_missing_programs_error_is_reused_as_it_was() -> None:
    machine = Machine()
    del machine.answers["ffmpeg"]
    machine.programs.pop("ffmpeg")
    first = collect_live_reusing(machine, machine, None)
    assert first.capture.errors["ffmpeg-encoders"] == "ffmpeg: not installed"
    second = collect_live_reusing(machine, machine, first.reusable())
    assert "ffmpeg-encoders" in second.reused and second.capture == first.capture


# Each change of an input the catalogue declares, and the command it makes run again.
CHANGES = {
    "a PCI device added (sysfs)": (
        lambda m: (m.dirs["/sys/bus/pci/devices"].append("0000:01:00.0"), m.files.update({"/sys/bus/pci/devices/0000:01:00.0/class": "0x030200\n"})),
        "lspci",
    ),
    "a PCI device's driver bound (sysfs)": (lambda m: m.links.update({"/sys/bus/pci/devices/0000:00:02.0/driver": "../../i915"}), "lspci"),
    "pci.ids updated": (lambda m: m.stats.update({"/usr/share/misc/pci.ids": "1:5:5:1"}), "lspci"),
    "hwdb.bin appeared": (lambda m: m.stats.update({"/etc/udev/hwdb.bin": "9:9:9:9"}), "lspci"),
    "lspci upgraded": (lambda m: m.programs.update({"lspci": "/usr/bin/lspci:2:2:2:7"}), "lspci"),
    "a disk added or resized": (lambda m: m.files.update({"/proc/partitions": m.files["/proc/partitions"] + " 8 0 1000 sda\n"}), "lsblk"),
    "a file system mounted": (
        lambda m: m.files.update({"/proc/self/mountinfo": m.files["/proc/self/mountinfo"] + "30 22 8:1 / /data rw - ext4 /dev/sda1 rw\n"}),
        "lsblk",
    ),
    "a btrfs subvolume mounted (anonymous device, /dev/ source)": (
        lambda m: m.files.update({"/proc/self/mountinfo": m.files["/proc/self/mountinfo"] + "31 22 0:45 /@home /home rw - btrfs /dev/sda2 rw\n"}),
        "lsblk",
    ),
    "a disk moved to another bus": (lambda m: m.links.update({"/sys/block/nvme0n1": "../devices/usb1/1-1/nvme0n1"}), "lsblk"),
    "a disk's rotational flag": (lambda m: m.files.update({"/sys/block/nvme0n1/queue/rotational": "1\n"}), "lsblk"),
    "a block device appeared": (lambda m: m.dirs["/sys/block"].append("sda"), "lsblk"),
    "a library installed (ldconfig)": (lambda m: m.stats.update({"/etc/ld.so.cache": "2:3:3:2"}), "ffmpeg"),
    "ffmpeg replaced (a new real path)": (lambda m: m.programs.update({"ffmpeg": "/nix/store/abc-ffmpeg/bin/ffmpeg:1:1:1:1"}), "ffmpeg"),
    "ffmpeg removed": (lambda m: m.programs.pop("ffmpeg"), "ffmpeg"),
}


@pytest.mark.parametrize(
    "mount",
    [
        "40 22 0:51 / /var/lib/containers/storage/overlay/abc/merged rw - overlay overlay rw,lowerdir=/x",
        "41 22 0:52 / /run/user/1000 rw - tmpfs tmpfs rw",
        "42 22 0:53 / /mnt/share rw - nfs4 nas:/export rw",
    ],
)
def test_a_mount_of_no_block_device_runs_no_lsblk(mount: str) -> None:
    """A container's overlay, a tmpfs, a network share: none is a disk's mount point."""
    machine = Machine()
    first = collect_live_reusing(machine, machine, None)
    machine.files["/proc/self/mountinfo"] += mount + "\n"
    assert "lsblk" not in runs(machine, first.reusable())


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_input_runs_its_command_again_and_only_it(change: str) -> None:
    machine = Machine()
    first = collect_live_reusing(machine, machine, None)
    alter, command = CHANGES[change]
    alter(machine)
    assert runs(machine, first.reusable()) == sorted({command, "nvidia-smi", "tailscale"})


def test_the_declared_inputs_are_what_the_catalogue_says() -> None:
    """The stamps above read these; a new input declared is a new case there."""
    assert LSPCI_INPUTS.raws == ("sysfs-pci",) and set(LSPCI_INPUTS.files) == set(PCI_NAMES)
    assert LSBLK_INPUTS.contents == ("/proc/partitions",)
    assert LSBLK_INPUTS.block_mounts == ("/proc/self/mountinfo",)
    assert LSBLK_INPUTS.entries == (("/sys/block", ("queue/rotational",)),)
    assert FFMPEG_INPUTS.files == ("/etc/ld.so.cache",)


# ---------------------------------------------------------------------------
# The memo's side: what it lends the probe, and the full pass's fresh probe.


class FullPassStarted(Exception):
    pass


class World:
    """The MemoReader port of an unchanged world: stat fingerprints are constants, nothing drifted."""

    def read(self, path: str) -> bytes | None:
        return b""

    def unit_state(self) -> None:
        return None

    def nft_digest(self) -> None:
        return None

    def fingerprint(self, paths: object) -> str:
        return "stat"

    def git_commit(self, directory: Path) -> str | None:
        return None

    def tree_stamp(self, directory: Path, files: object, since: float | None = None) -> str | None:
        return "stat"

    def which(self, program: str) -> str | None:
        return None


def memo_probes(tmp_path: Path, *, age_s: float, same_inputs: bool) -> list[object]:
    """The arguments of each probe call of one pass whose memo (with a probe
    reuse) is `age_s` old; the full pass, when it comes, is noted and stopped."""
    from contextlib import contextmanager

    from reconciler.engine.memoized_pass import MemoPorts, pass_inputs, run_memoized_pass
    from reconciler.engine.pass_memo import inputs_key
    from reconciler.engine.pass_options import PassOptions, PlanFile
    from tests.support.audit import RecordingAudit
    from tests.support.clock import FakeClock

    machine = Machine()
    first = collect_live_reusing(machine, machine, None)
    calls: list[object] = []
    options = PassOptions(desired=tmp_path / "desired", host="racknerd", root=tmp_path / "root", plan=PlanFile(tmp_path / "plan.json"))
    world = World()
    key = inputs_key(pass_inputs(options, first.capture, world)) if same_inputs else "another key"
    seed = MemoSeed(generation=1, files=(), units=(), node_record=None, registry_epoch=None, may_lead=False)
    memo = PassMemo(key=key, written_at=1000.0, seed=seed, probe_reuse=first.reusable())
    store = MemoFilesInMemory({options.root / STATE / MEMO_FILE: memo.to_json().encode()})

    def probe(reuse):  # type: ignore[no-untyped-def]
        calls.append("reuse" if reuse == first.reusable() else reuse)
        return collect_live_reusing(machine, machine, reuse)

    @contextmanager
    def full_pass_ports(options: PassOptions):  # type: ignore[no-untyped-def]
        calls.append("full pass")
        raise FullPassStarted
        yield

    ports = MemoPorts(
        store=store, world=world, audit=RecordingAudit(), clock=FakeClock(1000.0 + age_s), probe=probe, open_registry=lambda reach: None
    )  # type: ignore[arg-type,return-value]
    try:
        report = run_memoized_pass(options, ports, full_pass_ports)
        calls.append("memoized" if report.memoized else report.outcome)
    except FullPassStarted:
        pass
    return calls


def test_a_young_memo_lends_its_probe_outputs_and_a_hit_probes_once(tmp_path: Path) -> None:
    assert memo_probes(tmp_path, age_s=10.0, same_inputs=True) == ["reuse", "memoized"]


def test_a_miss_after_a_reused_probe_probes_again_running_everything_before_the_full_pass(tmp_path: Path) -> None:
    """The full pass acts on the machine as it is: no output of the memo's."""
    assert memo_probes(tmp_path, age_s=10.0, same_inputs=False) == ["reuse", None, "full pass"]


def test_a_memo_too_old_to_stand_lends_nothing(tmp_path: Path) -> None:
    """A memo older than its max age makes a full pass: every command runs once, then."""
    from reconciler.engine.pass_memo import MAX_AGE_S

    assert memo_probes(tmp_path, age_s=MAX_AGE_S + 1, same_inputs=True) == [None, "full pass"]


# ---------------------------------------------------------------------------
# Whole passes, live probe, a counting lspci on PATH.


@pytest.fixture
def counting_lspci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An lspci on PATH that notes each run in a log and prints a recorded output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "lspci.log"
    lspci = bin_dir / "lspci"
    lspci.write_text(f"#!/bin/sh\necho run >> {log}\ncat {LSPCI_OUTPUT}\n")
    lspci.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lspci, log


def lspci_runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_memoized_pass_runs_no_lspci_until_its_inputs_change(
    tmp_path: Path, counting_lspci: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    lspci, log = counting_lspci
    s = Sandbox(tmp_path)
    argv = [a for a in s.argv("--plan-file", str(GOLDEN / "fleet-plan.json")) if a not in ("--replay", str(s.capture))]
    code, out, err = fabric(capsys, *argv)
    assert code == 0 and "generation 1 written" in out, err
    assert lspci_runs(log) == 1
    memo = json.loads(s.memo_file.read_text())
    assert set(memo["probe_reuse"]) == REUSED
    assert memo["probe_reuse"]["lspci"]["output"] == LSPCI_OUTPUT.read_text()
    code, out, err = fabric(capsys, *argv)
    assert (code, out) == (0, "nothing to do (generation 1)\n") and memoized(err), err
    assert lspci_runs(log) == 1  # reused
    # lspci replaced (its stat changes): it runs again; it prints the same, so the pass is still the memo's.
    lspci.write_text(lspci.read_text() + "\n")
    code, out, err = fabric(capsys, *argv)
    assert (code, out) == (0, "nothing to do (generation 1)\n") and memoized(err), err
    assert lspci_runs(log) == 2


def test_a_full_pass_runs_lspci_even_when_the_memo_could_lend_it(
    tmp_path: Path, counting_lspci: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, log = counting_lspci
    s = Sandbox(tmp_path)
    argv = [a for a in s.argv("--plan-file", str(GOLDEN / "fleet-plan.json")) if a not in ("--replay", str(s.capture))]
    assert fabric(capsys, *argv)[0] == 0
    assert lspci_runs(log) == 1
    host_file = s.desired / "hosts" / f"{s.host}.toml"
    if not host_file.exists():
        host_file = s.desired / f"{s.host}.toml"
    host_file.write_text(host_file.read_text() + "\n# edited\n")  # an input changed: a full pass
    code, out, err = fabric(capsys, *argv)
    assert code == 0 and not memoized(err), err
    # Probed with the memo's lspci output (the key), then again with every command for the full pass.
    assert lspci_runs(log) == 2
