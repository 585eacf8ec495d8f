"""What a no-op reconcile pass costs: the pass every host runs every 30 s.

Run: /tmp/venv/bin/python bench/reconcile_noop [--repeats N] [--host NAME]

Sets up a sandbox root with one `fabric reconcile --no-activate` pass of the
example fleet (hosts/), then times further passes, which find nothing to do
(`nothing to do` is checked), each a whole new process as the timer starts it:
wall time and peak resident memory (ru_maxrss of that child, from wait4).
Beside it, in the same run, the same figures for `python -c "import reconciler"`
(the floor: interpreter start-up plus the package) and for a pass that
replays a saved probe instead of probing this machine live.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FABRIC = [sys.executable, "-m", "reconciler"]


# Children compile to bytecode once, into a cache outside the tree, as an
# installed package would have it precompiled (this machine sets
# PYTHONDONTWRITEBYTECODE, which would otherwise charge every run for
# compiling every module from source).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(argv: list[str], expect_stdout: str | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=CHILD_ENV)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    out = proc.stdout.read().decode() if proc.stdout else ""
    err = proc.stderr.read().decode() if proc.stderr else ""
    proc.stdout and proc.stdout.close()
    proc.stderr and proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{err}")
    if expect_stdout is not None and not out.startswith(expect_stdout):
        raise SystemExit(f"{' '.join(argv)}: expected a no-op pass, got:\n{out}")
    return wall, usage.ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def row(label: str, samples: list[tuple[float, float]]) -> str:
    walls = [w for w, _ in samples]
    peak = max(m for _, m in samples)
    return f"{label:<44} wall median {statistics.median(walls) * 1000:7.1f} ms  min {min(walls) * 1000:7.1f} ms  peak RSS {peak:6.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--host", default="racknerd")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp:
        CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        measure([sys.executable, "-c", "import reconciler.cli.reconcile"])  # warm the bytecode cache
        root = Path(tmp) / "root"

        def pass_argv(sandbox: Path, *extra: str) -> list[str]:
            return [*FABRIC, "reconcile", "--desired", str(ROOT / "hosts"), "--host", args.host, "--root", str(sandbox), "--no-activate", *extra]

        base = pass_argv(root)
        replay = ["--replay", str(ROOT / "tests" / "golden" / "probe" / "x86_64"), "--plan-file", str(ROOT / "tests" / "golden" / "fleet-plan.json")]
        measure(base)  # the first pass writes generation 1
        replay_root = Path(tmp) / "replay-root"
        replay_base = pass_argv(replay_root, *replay)
        measure(replay_base)
        floor, live, replayed = [], [], []
        for _ in range(args.repeats):
            floor.append(measure([sys.executable, "-c", "import reconciler"]))
            live.append(measure(base, expect_stdout="nothing to do"))
            replayed.append(measure(replay_base, expect_stdout="nothing to do"))
        files = sum(1 for p in root.rglob("*") if p.is_file() and "generations" not in p.parts)
        print(f"no-op pass of host {args.host} of the example fleet ({files} files under the sandbox root), {args.repeats} runs each, this machine:")
        print(row('python -c "import reconciler"', floor))
        print(row("fabric reconcile --no-activate (live probe)", live))
        print(row("fabric reconcile --no-activate (replayed)", replayed))


if __name__ == "__main__":
    main()
