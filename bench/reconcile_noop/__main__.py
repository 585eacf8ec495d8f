"""What a no-op reconcile pass costs: the pass every host runs every 30 s.

Run: .venv/bin/python bench/reconcile_noop [--repeats N] [--host NAME] [--fleet-size N] [--no-full]

Sets up a sandbox root with one `fabric reconcile --no-activate` pass of the
example fleet (hosts/), then times further passes, which find nothing to do
(`nothing to do` is checked), each a whole new process as the timer starts it:
wall time and peak resident memory (ru_maxrss of that child, from wait4).
Beside it, in the same run, the same figures for `python -c "import reconciler"`
(the floor: interpreter start-up plus the package), for a pass that replays a
saved probe instead of probing this machine live, for a live one with a
plan file (no registry, so no heartbeat), and for the first two over the
example fleet grown to --fleet-size declared hosts (generated into a temp dir).
Both fleets are git checkouts, as `fabric pull` keeps the desired state on a host;
and each again as a plain directory (no .git) and as a Nix store path
(`nix-store --add` of that directory, as a NixOS module would ship it),
the no-op pass of each timed too: the memo keys those from a few stats
(issue 34), never a stat of every host file.
Then a FULL pass (the pass memo dropped before each run, so the pass loads,
renders and compares everything, as after a new plan or drift) of --host and of
--full-host (a host that neither leads nor serves the edge) over both fleets,
at a desired-state commit an earlier pass has already seen, and over the
example fleet once more with the compiled templates dropped before each run.

The goals, checked on the medians of this run:
  a no-op pass <= 2x the import floor (issue 34; issue 18's was 4x), for a
  git checkout, a plain directory and a Nix store path, at either fleet size;
  peak RSS <= 40 MiB;
  a no-op pass of the big fleet <= 1.3x the same pass of the example fleet;
  a full pass of --host (the edge, by default) and of --full-host at the big
  fleet <= 1.3x the same host's full pass at the example fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def grow_fleet(directory: Path, size: int) -> None:
    """The example fleet plus compute hosts up to `size` declared hosts, one file each (hosts/ layout)."""
    shutil.copytree(ROOT / "hosts", directory)
    sub = directory / "hosts"
    sub.mkdir()
    for n in range(size - sum(1 for p in directory.glob("*.toml") if p.name != "fabric.toml")):
        name = f"bench-{n:05d}"
        (sub / f"{name}.toml").write_text(
            f'[host]\nname = "{name}"\nroles = ["compute"]\naddress = "100.64.{n // 250}.{n % 250 + 1}"\n\n[limits]\nmax_concurrent_tasks = 1\n'
        )


def git_checkout(directory: Path) -> None:
    """Commit `directory` as its own repository: the desired state as `fabric pull` keeps it on a host."""
    git = ["git", "-C", str(directory), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fleet"]):
        subprocess.run([*git, *argv], check=True)


def plain_copy(directory: Path, target: Path) -> Path:
    """`directory` without its .git: a desired state that is not a checkout."""
    shutil.copytree(directory, target, ignore=shutil.ignore_patterns(".git"))
    return target


def store_path(directory: Path) -> Path | None:
    """`directory` added to the Nix store (None, said, without nix-store)."""
    nix_store = shutil.which("nix-store")
    if nix_store is None:
        print(f"nix-store not found: no Nix store case for {directory.name}")
        return None
    out = subprocess.run([nix_store, "--add", str(directory)], check=True, capture_output=True, text=True).stdout.strip()
    return Path(out)


def median(samples: list[tuple[float, float]]) -> float:
    return statistics.median(w for w, _ in samples)


def peak(samples: list[tuple[float, float]]) -> float:
    return max(m for _, m in samples)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def full_passes(args: argparse.Namespace, tmp: str, example: Path, big: Path) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Wall and peak RSS of full passes (the memo removed before each), per
    (host, fleet); "example, compiling" also removes the templates the passes
    keep compiled in the state directory, so each pass compiles them anew."""
    cases: dict[tuple[str, str], tuple[list[str], Path, bool]] = {}
    for host in dict.fromkeys((args.host, args.full_host)):
        for fleet, desired, compiling in (("example", example, False), ("example, compiling", example, True), (f"{args.fleet_size}", big, False)):
            root = Path(tmp) / f"full-{host}-{fleet.replace(', ', '-')}"
            argv = [*FABRIC, "reconcile", "--desired", str(desired), "--host", host, "--root", str(root), "--no-activate"]
            measure(argv)  # generation 1, and the commit seen
            cases[(host, fleet)] = (argv, root, compiling)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {which: [] for which in cases}
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine falls on every case
        for which, (argv, root, compiling) in cases.items():
            state = root / "var/lib/fabric"
            (state / "pass-memo.json").unlink(missing_ok=True)
            if compiling:
                shutil.rmtree(state / "templates-compiled", ignore_errors=True)
            samples[which].append(measure(argv, expect_stdout="nothing to do"))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--host", default="racknerd")
    parser.add_argument("--fleet-size", type=int, default=10_000, help="declared hosts of the big fleet (default 10000)")
    parser.add_argument("--full-host", default="x86-spill", help="a host that neither leads nor serves the edge, for the full pass")
    parser.add_argument("--no-full", action="store_true", help="skip the full passes (the no-op passes only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp:
        CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        measure([sys.executable, "-c", "import reconciler.cli.reconcile"])  # warm the bytecode cache
        example = Path(tmp) / "example-fleet"
        shutil.copytree(ROOT / "hosts", example)
        git_checkout(example)
        big = Path(tmp) / "big-fleet"
        grow_fleet(big, args.fleet_size)
        git_checkout(big)
        plan_file = ["--plan-file", str(ROOT / "tests" / "golden" / "fleet-plan.json")]
        replay = ["--replay", str(ROOT / "tests" / "golden" / "probe" / "x86_64"), *plan_file]

        def pass_argv(desired: Path, sandbox: str, *extra: str) -> list[str]:
            root = Path(tmp) / sandbox
            return [*FABRIC, "reconcile", "--desired", str(desired), "--host", args.host, "--root", str(root), "--no-activate", *extra]

        passes = {
            ("example", "live"): pass_argv(example, "root"),
            ("example", "replayed"): pass_argv(example, "replay-root", *replay),
            # The live probe without the registry's heartbeat (which builds a NodeRecord model):
            # what the probe alone costs a hit.
            ("example", "live+plan"): pass_argv(example, "live-plan-root", *plan_file),
            (f"{args.fleet_size}", "live"): pass_argv(big, "big-root"),
            (f"{args.fleet_size}", "replayed"): pass_argv(big, "big-replay-root", *replay),
        }
        # The same fleets as a plain directory and as a Nix store path (issue 34).
        for fleet, checkout in (("example", example), (f"{args.fleet_size}", big)):
            plain = plain_copy(checkout, Path(tmp) / f"{checkout.name}-plain")
            passes[(fleet, "live, plain")] = pass_argv(plain, f"{checkout.name}-plain-root")
            stored = store_path(plain)
            if stored is not None:
                passes[(fleet, "live, store")] = pass_argv(stored, f"{checkout.name}-store-root")

        def memo_written(argv: list[str]) -> str:
            memo = Path(argv[argv.index("--root") + 1]) / "var/lib/fabric/pass-memo.json"
            return json.loads(memo.read_text())["written_at"] if memo.exists() else ""

        first: dict[tuple[str, str], tuple[float, float]] = {}
        for which, argv in passes.items():
            first[which] = measure(argv)  # the first pass writes generation 1 (and the pass memo)
        floor: list[tuple[float, float]] = []
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {which: [] for which in passes}
        # A no-op pass that rewrote the memo was a full one (the memo's max
        # age: the edge runs one every node timeout); counted, and kept in the medians.
        full: dict[tuple[str, str], int] = dict.fromkeys(passes, 0)
        for _ in range(args.repeats):
            floor.append(measure([sys.executable, "-c", "import reconciler"]))
            for which, argv in passes.items():
                before = memo_written(argv)
                samples[which].append(measure(argv, expect_stdout="nothing to do"))
                full[which] += memo_written(argv) != before
        print(f"no-op pass of host {args.host}, {args.repeats} runs each, this machine:")
        print(row('python -c "import reconciler"', floor))
        for (fleet, probe), got in samples.items():
            label = f"{'example fleet (5 hosts)' if fleet == 'example' else fleet + ' hosts'}, {probe}"
            print(row(label, got) + f"  ({full[(fleet, probe)]} of {len(got)} full)")
        print("first pass of each (full: validate, render, write generation 1):")
        for (fleet, probe), (wall, rss) in first.items():
            print(f"  {fleet:>8} {probe:<9} {wall * 1000:7.1f} ms  peak RSS {rss:6.1f} MiB")
        full_samples = {} if args.no_full else full_passes(args, tmp, example, big)
        print(f"full pass (pass memo dropped), live, {args.repeats} runs each, commit already seen:")
        for (host, fleet), got in full_samples.items():
            label = fleet + " hosts" if fleet[0].isdigit() else fleet.replace("example", "example fleet (5 hosts)")
            print(row(f"{host}, {label}", got))
        for host in dict.fromkeys(h for h, _ in full_samples):
            small, grown = full_samples[(host, "example")], full_samples[(host, f"{args.fleet_size}")]
            compiling = full_samples[(host, "example, compiling")]
            print(
                f"  {host}: full pass {args.fleet_size} hosts / 5 hosts wall {median(grown) / median(small):5.2f}x, "
                f"peak RSS {peak(grown) / peak(small):5.2f}x ({peak(grown):.1f} / {peak(small):.1f} MiB); "
                f"compiled templates kept / compiled anew {median(small) / median(compiling):5.2f}x"
            )
        print("goals (issues 18 and 34), medians of this run:")
        base = median(floor)
        for (fleet, probe), got in samples.items():
            ratio = median(got) / base
            label = "example fleet" if fleet == "example" else f"{fleet} hosts"
            print(f"  {label:<13}, {probe:<11} no-op / import floor {ratio:5.2f}x (goal <= 2.00x)    {verdict(ratio <= 2.0)}")
            if fleet != "example":
                continue
            print(f"  {label:<13}, {probe:<11} peak RSS {peak(got):6.1f} MiB (goal <= 40 MiB)        {verdict(peak(got) <= 40.0)}")
            if (f"{args.fleet_size}", probe) not in samples:
                continue
            big_ratio = median(samples[(f"{args.fleet_size}", probe)]) / median(got)
            print(f"  {args.fleet_size} hosts / 5 hosts, {probe:<11} {big_ratio:5.2f}x (goal <= 1.30x)      {verdict(big_ratio <= 1.3)}")
        for host in dict.fromkeys(h for h, _ in full_samples):
            ratio = median(full_samples[(host, f"{args.fleet_size}")]) / median(full_samples[(host, "example")])
            print(f"  full pass of {host}, {args.fleet_size} hosts / 5 hosts {ratio:5.2f}x (goal <= 1.30x)      {verdict(ratio <= 1.3)}")


if __name__ == "__main__":
    main()
