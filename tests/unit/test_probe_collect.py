"""The live collector, driven through the ports by a fake machine (no subprocess).

`FakeMachine` plays back a fixture directory as a live machine would answer:
commands through `CommandRunner`, files through `FileReader`, and the failures
errors.json records (not installed, exit status, timed out, no such file) as
the real adapters report them. So collecting it and capturing the result must
give back the fixture byte for byte, and the facts in expected.json.
"""

from __future__ import annotations

import errno
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from reconciler.adapters.probe_io import CaptureDirectory
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.core.probe.facts import ERRORS_FILE, FACTS, RAW_NAMES, Command, File, PerRenderNode, SysfsPci
from reconciler.core.probe.parsers import VAINFO_HEADER, parse_dri
from reconciler.engine.probe import collect_live
from reconciler.ports import CaptureError, CommandResult
from tests.support.probe_fixtures import FIXTURES, MACHINES, expected_facts, load_capture

# Program -> raw file, from the catalogue itself.
_PROGRAM_RAW = {s.argv[0]: f.raw for f in FACTS for s in f.sources if isinstance(s, Command | PerRenderNode)}
PER_RENDER_NODE = {f.raw for f in FACTS for s in f.sources if isinstance(s, PerRenderNode)}
_FILE_RAW = {s.path: f.raw for f in FACTS for s in f.sources if isinstance(s, File)}
SYSFS = next(s for f in FACTS for s in f.sources if isinstance(s, SysfsPci))


class FakeMachine:
    """A CommandRunner and FileReader answering from one fixture's raw files."""

    def __init__(self, capture: RawCapture) -> None:
        self.capture = capture
        self.calls: list[tuple[str, ...]] = []

    def _failure(self, raw: str) -> CommandResult | None:
        reason = self.capture.errors.get(raw)
        return reason

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        self.calls.append(argv)
        assert timeout > 0
        raw = _PROGRAM_RAW.get(argv[0])
        if raw is None:
            return CommandResult(argv, None, missing=True)
        text = self.capture.outputs.get(raw)
        reason = self.capture.errors.get(raw, "")
        if reason.endswith("timed out"):
            return CommandResult(argv, None, timed_out=True)
        exit_match = re.match(r"^\S+: exit (\d+): ", reason)
        if exit_match:
            return CommandResult(argv, int(exit_match.group(1)), "", text or "")
        if text is None:
            return CommandResult(argv, None, missing=True)
        if raw in PER_RENDER_NODE:
            return CommandResult(argv, 0, self._vainfo_section(text, argv[-1]))
        return CommandResult(argv, 0, text)

    @staticmethod
    def _vainfo_section(text: str, device: str) -> str:
        sections = re.split(r"^" + re.escape(VAINFO_HEADER), text, flags=re.M)
        for section in sections:
            head, _, body = section.partition("\n")
            if head.strip() == device:
                return body
        return "vaInitialize failed with error code -1 (unknown libva error),exit\n"

    # sysfs, rebuilt from the fixture's sysfs-pci lines as the kernel shows it:
    # /sys/bus/pci/devices/SLOT/{class,vendor,device,subsystem_*} and a
    # driver link; /sys/class/drm/NODE links into the device's path, plus the
    # connectors and "version" that the collector must skip.
    def _sysfs(self) -> dict[str, object]:
        if "sysfs-pci" not in self.capture.outputs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", SYSFS.devices)
        files: dict[str, str] = {}
        links: dict[str, str] = {}
        slots: list[str] = []
        drm: list[str] = ["version"]
        # Read leniently, field by field, so odd values (odd-values) come back
        # as the odd file contents that produced them.
        for line in self.capture.outputs["sysfs-pci"].splitlines():
            if not line.strip():
                continue
            slot, *parts = line.split()
            fields = dict(part.partition("=")[::2] for part in parts)
            base = f"{SYSFS.devices}/{slot}"
            slots.append(slot)
            for key in ("class", "vendor", "device"):
                if key in fields:
                    files[f"{base}/{key}"] = fields[key] + "\n"
            if "subsystem" in fields:
                vendor, _, sub = fields["subsystem"].partition(":")
                files[f"{base}/subsystem_vendor"] = f"{vendor}\n"
                files[f"{base}/subsystem_device"] = f"{sub}\n"
            if "driver" in fields:
                links[f"{base}/driver"] = f"../../../bus/pci/drivers/{fields['driver']}"
            for node in filter(None, fields.get("drm", "").split(",")):
                drm.append(node)
                links[f"{SYSFS.drm}/{node}"] = f"../../devices/pci0000:00/0000:00:01.0/{slot}/drm/{node}"
                if node.startswith("card"):
                    drm.append(f"{node}-HDMI-A-1")
                    links[f"{SYSFS.drm}/{node}-HDMI-A-1"] = links[f"{SYSFS.drm}/{node}"] + f"/{node}-HDMI-A-1"
        return {"files": files, "links": links, "slots": sorted(slots), "drm": sorted(drm)}

    def read_text(self, path: str) -> str:
        if path.startswith("/sys/bus/pci/"):
            files = self._sysfs()["files"]
            assert isinstance(files, dict)
            if path not in files:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return files[path]
        raw = _FILE_RAW.get(path)
        if raw is None or raw not in self.capture.outputs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return self.capture.outputs[raw]

    def _dri(self) -> tuple[list[str], dict[str, str]]:
        text = self.capture.outputs.get("dri")
        if text is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/dri")
        names, links = [], {}
        for line in text.splitlines():
            if line.startswith("by-path/"):
                link, _, target = line[len("by-path/") :].partition(" -> ")
                links[link] = target
            elif line:
                names.append(line)
        return names, links

    def list_dir(self, path: str) -> list[str]:
        if path == SYSFS.devices:
            return list(self._sysfs()["slots"])  # type: ignore[call-overload]
        if path == SYSFS.drm:
            return list(self._sysfs()["drm"])  # type: ignore[call-overload]
        names, links = self._dri()
        if path == "/dev/dri":
            return sorted(names + (["by-path"] if links else []))
        if path == "/dev/dri/by-path":
            return sorted(links)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def read_link(self, path: str) -> str:
        if path.startswith("/sys/"):
            links = self._sysfs()["links"]
            assert isinstance(links, dict)
            if path not in links:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
            return links[path]
        return self._dri()[1][path.rsplit("/", 1)[-1]]


def _complete(machine: str) -> bool:
    """Written as `fabric probe --capture` writes: every absent file says why."""
    capture = load_capture(machine)
    return all(raw in capture.outputs or raw in capture.errors for raw in RAW_NAMES)


COMPLETE = [m for m in MACHINES if _complete(m)]


def test_most_fixtures_are_complete_captures():
    assert len(COMPLETE) >= 10 and {"qfox-1", "a1-arm64", "x86-spill", "lux", "racknerd"} <= set(COMPLETE)


@pytest.mark.parametrize("machine", COMPLETE)
def test_live_collection_captures_the_fixture_byte_for_byte(machine, tmp_path):
    fixture = load_capture(machine)
    fake = FakeMachine(fixture)
    collected = collect_live(fake, fake)
    assert collected.outputs == fixture.outputs
    assert collected.errors == fixture.errors

    target = tmp_path / "capture"
    CaptureDirectory().save(str(target), collected.outputs, collected.errors)
    for name in RAW_NAMES:
        assert (target / name).is_file() == (name in fixture.outputs)
        if name in fixture.outputs:
            assert (target / name).read_bytes() == (FIXTURES / machine / name).read_bytes()
    if fixture.errors:
        assert json.loads((target / ERRORS_FILE).read_text()) == fixture.errors

    # And the replay of that capture is the machine's expected facts.
    outputs, errors = CaptureDirectory().load(str(target))
    assert facts_from_capture(RawCapture(outputs, errors)).model_dump(mode="json") == expected_facts(machine)


def test_vainfo_runs_once_per_render_node_with_its_device():
    fake = FakeMachine(load_capture("qfox-1"))
    collect_live(fake, fake)
    vainfo = [c for c in fake.calls if c[0] == "vainfo"]
    assert vainfo == [
        ("vainfo", "--display", "drm", "--device", "/dev/dri/renderD128"),
        ("vainfo", "--display", "drm", "--device", "/dev/dri/renderD129"),
    ]


def test_no_render_node_means_vainfo_is_not_run():
    fake = FakeMachine(load_capture("x86-spill"))
    capture = collect_live(fake, fake)
    assert not [c for c in fake.calls if c[0] == "vainfo"]
    assert capture.errors["vainfo"] == "no render node in /dev/dri"


class ScriptedRunner:
    """Answers every command with one fixed result kind."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def run(self, argv, *, timeout=10.0, stdin=None):
        argv = tuple(argv)
        if self.answer == "missing":
            return CommandResult(argv, None, missing=True)
        if self.answer == "hung":
            return CommandResult(argv, None, stdout="partial out", timed_out=True)
        if self.answer == "fails":
            return CommandResult(argv, 3, "", "something broke\nmore detail")
        return CommandResult(argv, 0, "\x00\xff garbage {]\n")


class NoFiles:
    def read_text(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    def list_dir(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    def read_link(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", path)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("missing", "lspci: not installed"),
        ("hung", "lspci: timed out"),
        ("fails", "lspci: exit 3: something broke"),
        ("garbage", "lspci: no 'Slot:' records: '\\x00\xff garbage {]'"),
    ],
)
def test_a_machine_where_everything_goes_wrong_still_probes(answer, reason):
    capture = collect_live(ScriptedRunner(answer), NoFiles())
    facts = facts_from_capture(capture)
    assert isinstance(facts, HostFacts)
    assert facts.tier == "relay"
    assert facts.missing["pci"] == reason
    assert facts.missing["cpu"] == "/proc/cpuinfo: Permission denied"
    assert facts.missing["dri"] == "/dev/dri: Permission denied"
    # The hostname and the arch fall back from the kernel's files to the
    # commands, and say why the first source failed when both do (a command
    # that answered garbage: the parser's reason).
    if answer == "garbage":
        assert facts.missing["hostname"].startswith("hostname: not a host name: ")
    else:
        assert facts.missing["hostname"] == "/proc/sys/kernel/hostname: Permission denied"
        assert facts.missing["arch"] == "/proc/sys/kernel/arch: Permission denied"
    # Every fact of the catalogue is accounted for.
    assert {f.name for f in FACTS} <= set(facts.missing)


def test_a_failed_command_keeps_its_own_words_in_the_capture():
    capture = collect_live(ScriptedRunner("fails"), NoFiles())
    assert capture.outputs["lspci"] == "something broke\nmore detail"
    assert capture.errors["lspci"] == "lspci: exit 3: something broke"


class CountingRunner(ScriptedRunner):
    def __init__(self, answer: str) -> None:
        super().__init__(answer)
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv, *, timeout=10.0, stdin=None):
        self.calls.append(tuple(argv))
        return super().run(argv, timeout=timeout, stdin=stdin)


def test_hostname_and_arch_are_the_kernel_files_without_a_process():
    """What `hostname` and `uname -m` print is the kernel's UTS node and
    machine name: read from /proc/sys/kernel, neither program runs."""

    class Kernel(NoFiles):
        def read_text(self, path):
            answers = {"/proc/sys/kernel/hostname": "edge-7\n", "/proc/sys/kernel/arch": "aarch64\n"}
            return answers[path] if path in answers else super().read_text(path)

    runner = CountingRunner("missing")
    capture = collect_live(runner, Kernel())
    assert (capture.outputs["hostname"], capture.outputs["uname-m"]) == ("edge-7\n", "aarch64\n")
    assert "hostname" not in capture.errors and "uname-m" not in capture.errors
    assert not [argv for argv in runner.calls if argv[0] in ("hostname", "uname")]
    facts = facts_from_capture(capture)
    assert (facts.k3s_hostname, facts.hardware.arch) == ("edge-7", "aarch64")


def test_hostname_and_arch_fall_back_to_the_commands():
    """A kernel older than 6.1 has no /proc/sys/kernel/arch: uname -m runs."""

    class Answering(ScriptedRunner):
        def run(self, argv, *, timeout=10.0, stdin=None):
            return CommandResult(tuple(argv), 0, {"uname": "x86_64\n", "hostname": "Edge-8.example\n"}.get(argv[0], ""))

    capture = collect_live(Answering("ok"), NoFiles())
    assert (capture.outputs["hostname"], capture.outputs["uname-m"]) == ("Edge-8.example\n", "x86_64\n")
    facts = facts_from_capture(capture)
    assert (facts.k3s_hostname, facts.hardware.arch) == ("edge-8", "x86_64")


def test_capture_never_overwrites_and_leaves_nothing_behind(tmp_path):
    store = CaptureDirectory()
    target = tmp_path / "cap"
    target.mkdir()
    (target / "keep").write_text("mine")
    with pytest.raises(CaptureError, match="not an empty directory"):
        store.save(str(target), {"uname-m": "x86_64\n"}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]
    assert [p.name for p in target.iterdir()] == ["keep"]


def test_capture_into_an_empty_directory_and_a_bad_name_is_refused(tmp_path):
    store = CaptureDirectory()
    empty = tmp_path / "empty"
    empty.mkdir()
    store.save(str(empty), {"uname-m": "x86_64\n"}, {"fb0": "no such file"})
    assert sorted(p.name for p in empty.iterdir()) == ["errors.json", "uname-m"]
    with pytest.raises(CaptureError, match="not raw probe names: ../escape"):
        store.save(str(tmp_path / "other"), {"../escape": "x"}, {})
    assert not (tmp_path / "other").exists() and not (tmp_path / "escape").exists()


def test_a_failed_write_leaves_no_partial_capture(tmp_path, monkeypatch):
    store = CaptureDirectory()
    target = tmp_path / "cap"
    real_fsync = __import__("os").fsync
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr("reconciler.adapters.probe_io.os.fsync", failing_fsync)
    outputs = {name: "x\n" for name in RAW_NAMES}
    with pytest.raises(CaptureError, match="Input/output error"):
        store.save(str(target), outputs, {})
    assert list(tmp_path.iterdir()) == []


def test_replay_of_a_directory_without_raw_files_is_refused(tmp_path):
    with pytest.raises(CaptureError, match="no raw probe file"):
        CaptureDirectory().load(str(tmp_path))
    with pytest.raises(CaptureError, match="not a directory"):
        CaptureDirectory().load(str(tmp_path / "nope"))
    (tmp_path / "uname-m").write_text("x86_64\n")
    (tmp_path / ERRORS_FILE).write_text("[1, 2]")
    with pytest.raises(CaptureError, match="must map raw file names"):
        CaptureDirectory().load(str(tmp_path))


def test_dri_listing_from_collection_parses_to_render_nodes_by_slot():
    fake = FakeMachine(load_capture("multi-gpu-server"))
    capture = collect_live(fake, fake)
    dri = parse_dri(capture.outputs["dri"])
    assert dri.render_by_slot == {"0000:21:00.0": "renderD128", "0000:41:00.0": "renderD129"}
    assert Path("/dev/dri").name == "dri"


def test_the_group_of_each_render_node_is_read_by_stat_once_per_node():
    fake = FakeMachine(load_capture("qfox-1"))
    collected = collect_live(fake, fake)
    assert [c for c in fake.calls if c[0] == "stat"] == [
        ("stat", "--format=%G", "/dev/dri/renderD128"),
        ("stat", "--format=%G", "/dev/dri/renderD129"),
    ]
    assert collected.outputs["dri-groups"] == "### /dev/dri/renderD128\nrender\n### /dev/dri/renderD129\nrender\n"
