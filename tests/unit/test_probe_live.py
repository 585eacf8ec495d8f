"""The live probe of this very machine (real commands through SubprocessRunner,
real files through LocalFiles) and the `fabric probe` command line.

The machine running the tests may or may not have a GPU, ffmpeg or Tailscale;
every assertion compares the probe with an independent reading of the same
truth, so it holds on a bare container and on a GPU desktop alike.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
from pathlib import Path

import pytest

from reconciler.adapters.commands import SubprocessRunner
from reconciler.adapters.probe_io import LocalFiles
from reconciler.cli import main
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import facts_from_capture
from reconciler.core.probe.facts import FACTS, Command, Fact
from reconciler.core.probe.parsers import parse_uname_m
from reconciler.core.probe.raw import parse_capture
from reconciler.engine.probe import collect_live
from tests.support.probe_fixtures import FIXTURES, expected_facts


@pytest.fixture(scope="module")
def live_capture():
    return collect_live(SubprocessRunner(), LocalFiles())


def test_live_probe_of_this_machine(live_capture):
    facts = facts_from_capture(live_capture)
    hw = facts.hardware
    assert hw.arch == parse_uname_m(platform.machine())
    assert hw.cpu_cores == os.cpu_count()
    assert hw.memory_mib == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    assert facts.k3s_hostname == socket.gethostname().split(".")[0].lower()
    parsed = parse_capture(live_capture)
    for fact in FACTS:
        assert (fact.name in parsed.values) != (fact.name in facts.missing), fact.name
    if shutil.which("nvidia-smi") is None:
        assert facts.missing["nvidia"] == "nvidia-smi: not installed"
        assert all(g.vendor != "nvidia" for g in hw.gpus)
    if not Path("/dev/dri").exists():
        assert facts.missing["dri"] == "/dev/dri: No such file or directory"
        assert hw.gpus == []
    if not hw.gpus:
        assert facts.tier == ("cpu_ffmpeg" if shutil.which("ffmpeg") else "relay")
    assert facts.labels["topology.researchstack.io/tier"] == facts.tier


def test_the_kernels_files_say_what_hostname_and_uname_print(live_capture):
    """The live probe reads /proc/sys/kernel/{hostname,arch} (procfs refuses
    one read of the whole 4 MiB cap: LocalFiles reads in chunks) and runs
    neither program where they are there (arch: Linux 6.1 and later)."""
    files = LocalFiles()
    assert files.read_text("/proc/sys/kernel/hostname") == os.uname().nodename + "\n"
    assert live_capture.outputs["hostname"] == os.uname().nodename + "\n"
    if Path("/proc/sys/kernel/arch").exists():
        assert files.read_text("/proc/sys/kernel/arch") == os.uname().machine + "\n"
    assert live_capture.outputs["uname-m"] == os.uname().machine + "\n"


def test_local_files_read_a_large_file_whole_up_to_the_cap(tmp_path: Path) -> None:
    from reconciler.adapters.local_files import READ_CAP

    small = tmp_path / "small"
    small.write_text("x" * 200_000)
    assert LocalFiles().read_text(str(small)) == "x" * 200_000
    big = tmp_path / "big"
    big.write_text("y" * (READ_CAP + 10))
    assert LocalFiles().read_text(str(big)) == "y" * READ_CAP


def test_real_commands_that_are_missing_fail_or_hang_become_reasons():
    facts = (
        Fact("arch", "uname-m", (Command(("/nonexistent/uname",)),), parse_uname_m, "missing"),
        Fact("cpu", "cpuinfo", (Command(("false",)),), parse_uname_m, "failing"),
        Fact("memory", "meminfo", (Command(("sleep", "30"), timeout=0.3),), parse_uname_m, "hung"),
        Fact("os", "os-release", (Command(("echo", "not a machine")),), parse_uname_m, "odd"),
    )
    parsed = parse_capture(collect_live(SubprocessRunner(), LocalFiles(), facts), facts)
    assert parsed.values == {}
    assert parsed.missing == {
        "arch": "/nonexistent/uname: not installed",
        "cpu": "false: exit 1",
        "memory": "sleep: timed out",
        "os": "os-release: not a machine name: 'not a machine'",
    }


def test_cli_json_replay_is_the_expected_facts(capsys):
    assert main(["probe", "--replay", str(FIXTURES / "qfox-1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == expected_facts("qfox-1")


def test_cli_summary_names_everything_and_every_missing_reason(capsys):
    assert main(["probe", "--replay", str(FIXTURES / "nvidia-driver-failed")]) == 0
    out = capsys.readouterr().out
    for needle in (
        "arch         x86_64",
        "cpu          16 threads",
        "tier         cpu_ffmpeg",
        "topology.researchstack.io/tier=cpu_ffmpeg",
        "8 tasks at once (ceiling 15)",
        "gpu 0000:2b:00.0: NVIDIA GeForce RTX 3060 Lite Hash Rate: no working NVIDIA driver",
        "tailscale: no 'tailscale.json' in the capture",
    ):
        assert needle in out


def test_cli_capture_then_replay_gives_the_same_facts(tmp_path, capsys):
    target = tmp_path / "capture"
    assert main(["probe", "--capture", str(target), "--json"]) == 0
    captured = json.loads(capsys.readouterr().out)
    assert (target / "uname-m").is_file() and (target / "cpuinfo").is_file()
    assert main(["probe", "--replay", str(target), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == captured
    HostFacts.model_validate(captured)


def test_cli_host_option_names_the_fleet_host(capsys):
    assert main(["probe", "--replay", str(FIXTURES / "intel-nuc"), "--host", "lux", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["k3s_hostname"] == "lux"
    assert facts["labels"]["topology.researchstack.io/role"] == "auto:lux"


def test_cli_refuses_bad_directories_with_status_2_and_changes_nothing(tmp_path, capsys):
    assert main(["probe", "--replay", str(tmp_path / "nope")]) == 2
    assert "nope: not a directory" in capsys.readouterr().err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["probe", "--capture", str(occupied)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--host", "Bad Name"],
        ["probe", "--capture", "/tmp/a", "--replay", "/tmp/b"],
    ],
)
def test_cli_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_a_program_not_on_path_is_missing_without_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe asks for programs most hosts lack (nvidia-smi, tailscale,
    ffmpeg) every pass: one not on the PATH the child would search is
    reported missing as its exec would be, and no process is started."""
    import subprocess

    started: list[object] = []
    real_run = subprocess.run

    def run(*args: object, **kwargs: object) -> object:
        started.append(args[0])
        return real_run(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "run", run)
    empty = tmp_path / "bin"
    empty.mkdir()
    runner = SubprocessRunner({"PATH": str(empty)})
    result = runner.run(("uname", "-m"))
    assert result.missing and result.failure() == "uname: not installed"
    assert started == []
    # On the PATH, or named by a path: run (a path that is not there: exec's own answer).
    assert SubprocessRunner().run(("uname", "-m")).stdout == os.uname().machine + "\n"
    missing = SubprocessRunner().run((str(empty / "uname"),))
    assert missing.missing and len(started) == 2
