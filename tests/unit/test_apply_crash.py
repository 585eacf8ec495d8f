"""Crash consistency: a pass SIGKILLed at any step leaves the old or the new
generation, and the next pass converges.

A real reconcile pass runs in a subprocess (this file run as a script: the
engine's `run_pass` with FakeMachine wired in, whose state is a JSON file, so
it survives the kill). The script's step argument K wires a checkpoint into
the pass's ports that SIGKILLs the process at the pass's K-th step (every
staged file, the publish, the pointer switch, every installed file, every
activation call: one per kind of unit job, marking good); the product has no
such hook of its own. For every K until the pass completes unharmed:

1. after the kill, `current` names the old or the new generation, and that
   generation is complete (manifest present, every file matching its hash);
2. the next pass (no kill) exits 0 and leaves everything converged: the
   current generation's files on disk and running, nothing else running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as the killed pass: make `tests` importable
    sys.path.insert(0, str(REPO))

from collections.abc import Callable  # noqa: E402

from reconciler.adapters.files import LocalTree  # noqa: E402
from reconciler.engine.apply import GenerationStore, no_checkpoint  # noqa: E402
from reconciler.engine.pass_options import PlanFile  # noqa: E402
from reconciler.engine.reconcile import run_pass  # noqa: E402
from tests.support.audit import RecordingAudit  # noqa: E402
from tests.support.fleet import GOLDEN, copy_fleet, fake_pass_ports, pass_options  # noqa: E402
from tests.support.machine import FakeMachine, FakeVerifier, assert_converged  # noqa: E402


def kill_at_step(target: int) -> Callable[[str], None]:
    """A checkpoint that SIGKILLs this process at the pass's `target`-th step."""
    count = 0

    def checkpoint(step: str) -> None:
        nonlocal count
        count += 1
        if count == target:
            os.kill(os.getpid(), signal.SIGKILL)

    return checkpoint


def one_pass(desired: Path, root: Path, machine_file: Path, plan_file: Path, checkpoint: Callable[[str], None] = no_checkpoint) -> int:
    """A pass of racknerd with FakeMachine; its exit status."""
    machine = FakeMachine(root, machine_file)
    ports = fake_pass_ports(root, machine, FakeVerifier(), RecordingAudit())
    ports.checkpoint = checkpoint
    report = run_pass(pass_options(desired, root, "racknerd", plan=PlanFile(plan_file)), ports)
    assert report.outcome != "bad-input", report.stderr
    return report.exit_status


def killed_pass(desired: Path, root: Path, machine_file: Path, plan_file: Path, step: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # Compile to bytecode once for all the killed passes, outside the tree.
    env.update({"PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": str(desired.parent / "pycache")})
    proc = subprocess.run(
        [sys.executable, __file__, str(desired), str(root), str(machine_file), str(plan_file), str(step)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return proc.returncode


def assert_whole_generation(root: Path, allowed: set[int | None]) -> None:
    store = GenerationStore(LocalTree(root))
    current = store.current()
    assert current in allowed, f"current is {current}, expected one of {allowed}"
    if current is None:
        return
    manifest = store.manifest(current)
    assert manifest is not None, f"generation {current} has no manifest"
    for artifact, entry in zip(store.artifacts(current), manifest.entries, strict=True):
        assert artifact.sha256 == entry.sha256, f"generation {current}: {entry.path} does not match its manifest"


def second_plan(tmp_path: Path) -> Path:
    """The golden plan with vaapi-encode moved from qfox-1 to x86-spill (a Caddy change)."""
    text = (GOLDEN / "fleet-plan.json").read_text()
    old = '{"service": "vaapi-encode", "replica": 0, "node": "qfox-1"'
    assert old in text
    path = tmp_path / "plan-2.json"
    path.write_text(text.replace(old, '{"service": "vaapi-encode", "replica": 0, "node": "x86-spill"').replace('"epoch": 7', '"epoch": 8'))
    return path


def change_desired(desired: Path) -> None:
    """One port map changed (restart), one removed (stop), one added (start)."""
    path = desired / "fabric.toml"
    text = path.read_text()
    text = text.replace("target_port = 22\n", "target_port = 2022\n")
    block = text[text.index('[[port_maps]]\nname = "lux-smb"') :]
    text = text.replace(block, block.replace("lux-smb", "lux-nfs").replace("4445", "2049").replace("445", "2049"))
    path.write_text(text)


def sweep_kills(tmp_path: Path, base_root: Path | None, base_machine: Path | None, desired: Path, plan_file: Path, allowed: set[int | None]) -> int:
    """Kill at every step in turn; returns how many steps the pass has."""
    step = 1
    while True:
        work = tmp_path / f"k{step}"
        root, machine_file = work / "root", work / "machine.json"
        work.mkdir()
        if base_root is not None and base_machine is not None:
            shutil.copytree(base_root, root, symlinks=True)
            shutil.copy(base_machine, machine_file)
        else:
            root.mkdir()
        code = killed_pass(desired, root, machine_file, plan_file, step)
        assert_whole_generation(root, allowed)
        # The next pass, not killed, converges.
        assert one_pass(desired, root, machine_file, plan_file) == 0
        assert_converged(FakeMachine(root, machine_file), root)
        store = GenerationStore(LocalTree(root))
        assert store.manifest(store.current()).host == "racknerd"  # type: ignore[union-attr]
        shutil.rmtree(work)
        if code == 0:
            return step - 1
        step += 1


def test_sigkill_at_every_step_of_a_changing_pass_then_convergence(tmp_path: Path) -> None:
    desired = copy_fleet(tmp_path)
    base = tmp_path / "base"
    base.mkdir()
    base_root, base_machine = base / "root", base / "machine.json"
    base_root.mkdir()
    assert one_pass(desired, base_root, base_machine, GOLDEN / "fleet-plan.json") == 0
    change_desired(desired)
    plan_file = second_plan(tmp_path)
    steps = sweep_kills(tmp_path, base_root, base_machine, desired, plan_file, allowed={1, 2})
    # stage 6 files + manifest, publish, switch, 4 writes + 1 removal,
    # daemon-reload, nft, stop, restart, start, caddy, mark good.
    assert steps >= 20


def test_sigkill_at_every_step_of_a_first_pass_then_convergence(tmp_path: Path) -> None:
    desired = copy_fleet(tmp_path)
    steps = sweep_kills(tmp_path, None, None, desired, GOLDEN / "fleet-plan.json", allowed={None, 1})
    assert steps >= 15


if __name__ == "__main__":  # the killed pass: DESIRED ROOT MACHINE_FILE PLAN_FILE STEP
    desired_dir, root_dir, machine_path, plan_path = map(Path, sys.argv[1:5])
    sys.exit(one_pass(desired_dir, root_dir, machine_path, plan_path, kill_at_step(int(sys.argv[5]))))
