"""What a pass costs in CPU on its way to activation, and how many modules it imports.

Run: .venv/bin/python bench/pass_cpu [--repeats N] [--registry sqlite|etcd] [--against DIR]

Why: a new plan must be applied by every affected host within a second of
its publication, and the affected hosts' passes start together and share the
machine's cores, so what a pass spends before it activates is what counts.

The example fleet (hosts/, a git checkout with throwaway plan keys), phaze's
broker (a throwaway PostgreSQL, tests/support/harness/postgres.py, as [phaze]
queue_url_file) and a registry: one sqlite file for every host (as
scripts/demo runs them) or, with --registry etcd, one etcd member over TLS
(tests/support/harness/etcd.py), as the fleet runs it. lux leads once and publishes
the plan; a1-arm64 (a compute lane's host: its heartbeat counts its lane's
jobs on the broker) and racknerd (the edge: neither a lane's host nor a
leader candidate) each run `fabric reconcile --no-activate` into a sandbox
root from their recorded probes (--replay), every pass a new process, as the
timer or the watcher starts it. Then, --repeats times:

  new plan   the registry's epoch moves (a campaign and a resignation): each
             host's pass finds its memo vouching for everything else and runs
             whole; it writes and activates nothing (the plan did not move
             its work), as the hosts a plan does not concern
  memo hit   nothing changed: each host's pass is the memo's

Printed per case, medians over the repeats: the CPU seconds of the process
(user + system, from wait4), the CPU seconds when activation would start (on
entering the applier, `Applier.run`; a memo hit never gets there) and the
modules the pass imported (sys.modules, beyond the interpreter's own start),
at activation and at the end; beside them, in the same run, the interpreter
alone and `import reconciler`, and each case's CPU as a multiple of the
interpreter's. Each checkout's package is imported as installed: from a
site directory holding a link to it beside a dist-info of its version (as
pip and Nix's Python builder leave a wheel), first on the children's
sys.path. --against DIR runs every case a second time with the `reconciler`
package of another checkout (the sandbox, the registry and the broker are
this run's), and prints that checkout's figures and the ratio of this one's
to them. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.harness.pass_child import CHILD  # noqa: E402
from tests.support.harness.postgres import postgres_server  # noqa: E402
from tests.support.plan_keys import signed_example_fleet  # noqa: E402

PROBES = ROOT / "tests" / "fixtures" / "probe"
HOSTS = ("a1-arm64", "racknerd")

# Children compile to bytecode once, into a cache outside the tree, as an
# installed package would have it precompiled (see bench/reconcile_noop).
CHILD_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}


@dataclass(frozen=True)
class Sample:
    cpu_s: float  # user + system of the whole process (wait4)
    cpu_at_activation_s: float | None
    modules: int
    modules_at_activation: int | None


def run_child(site: Path, argv: list[str], report: Path, *, full: bool | None = None) -> Sample:
    """One child, `fabric ARGV` with the reconciler installed in `site`; `full`: its log
    must (True) or must not (False) say the memo made way for a full pass."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(site), str(report), *argv], cwd="/", capture_output=True, text=True, env=CHILD_ENV)
    # run() has reaped the child: its usage is what RUSAGE_CHILDREN grew by.
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"fabric {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    if full is not None and ("full pass" in proc.stderr) != full:
        raise SystemExit(f"fabric {' '.join(argv)}: expected {'a full pass' if full else 'a memo hit'}, got:\n{proc.stderr}")
    seen = json.loads(report.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    at_start = len(seen["at_start"])
    at_activation = len(seen["at_activation"]) - at_start if "at_activation" in seen else None
    return Sample(cpu, seen.get("cpu_at_activation"), len(seen["at_end"]) - at_start, at_activation)


def installed_layout(code_dir: Path, site: Path) -> Path:
    """`site` holding `code_dir`'s package beside a dist-info of its version, as an installed wheel's."""
    import tomllib

    version = tomllib.loads((code_dir / "pyproject.toml").read_text())["project"]["version"]
    site.mkdir(parents=True)
    (site / "reconciler").symlink_to(code_dir / "reconciler")
    dist_info = site / f"fabric_reconciler-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fabric-reconciler\nVersion: {version}\n")
    return site


def git_checkout(directory: Path) -> None:
    git = ["git", "-C", str(directory), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fleet"]):
        subprocess.run([*git, *argv], check=True)


def with_section_lines(text: str, section: str, lines: dict[str, str]) -> str:
    """fabric.toml's text with `lines` (key -> TOML value) set in [section]:
    existing keys (or a commented-out `# key = ...`) replaced, the others added."""
    out, inside, done = [], False, set()
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            if inside:
                out.extend(f"{k} = {v}" for k, v in lines.items() if k not in done)
            inside = stripped == f"[{section}]"
        key = re.match(r"#?\s*([a-z_]+)\s*=", stripped) if inside else None
        if key and key.group(1) in lines:
            if key.group(1) not in done:
                out.append(f"{key.group(1)} = {lines[key.group(1)]}")
                done.add(key.group(1))
            continue
        out.append(line)
    return "\n".join(out) + "\n"


@contextmanager
def etcd_registry(tmp: Path) -> Iterator[dict[str, str]]:
    from tests.support.harness.etcd import etcd_cluster

    with etcd_cluster(members=1, tls=True) as cluster:
        tls = cluster.tls_settings("bench")
        settings = {"backend": '"etcd"', "endpoints": json.dumps(cluster.endpoints), "prefix": '"/bench"'}
        settings.update({k: json.dumps(v) for k, v in tls.items()})
        yield settings


def bump_epoch(desired: Path, registry_file: Path | None) -> None:
    """A won campaign and a resignation: the registry's epoch moves on, the plan stays."""
    from reconciler.core.desired.load import load_desired
    from reconciler.wiring import open_registry

    registry = open_registry(load_desired(desired).fleet, sqlite_path=registry_file)
    try:
        leadership = registry.campaign("lux", 30.0)
        assert leadership is not None, "somebody leads"
        registry.resign(leadership)
    finally:
        registry.close()


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--registry", choices=("sqlite", "etcd"), default="sqlite")
    parser.add_argument("--against", type=Path, help="another checkout whose reconciler package runs the same cases (e.g. main's)")
    args = parser.parse_args()
    trees: dict[str, Path] = {"this": ROOT}
    if args.against is not None:
        trees["against"] = args.against.resolve()
    with tempfile.TemporaryDirectory(prefix="fabric-bench-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        CHILD_ENV["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
        report = tmp / "child.json"
        sites = {tree: installed_layout(code, tmp / "site" / tree) for tree, code in trees.items()}
        fleet = signed_example_fleet(tmp)
        desired = fleet.desired
        pg = stack.enter_context(postgres_server())
        queue_url = tmp / "queue_url"
        queue_url.write_text(pg.database("phaze") + "\n")
        queue_url.chmod(0o600)
        fleet_toml = desired / "fabric.toml"
        text = with_section_lines(fleet_toml.read_text(), "phaze", {"queue_url_file": json.dumps(str(queue_url))})
        registry_file: Path | None = tmp / "registry.sqlite"
        if args.registry == "etcd":
            text = with_section_lines(text, "registry", stack.enter_context(etcd_registry(tmp)))
            registry_file = None
        fleet_toml.write_text(text)
        git_checkout(desired)

        def pass_argv(host: str, tree: str) -> list[str]:
            argv = ["reconcile", "--desired", str(desired), "--host", host, "--root", str(tmp / tree / host)]
            argv += ["--replay", str(PROBES / host), "--no-activate"]
            if host == "lux":  # the leader candidate, which leads once
                argv += ["--plan-key-file", str(fleet.key_file("lux"))]
            return argv + (["--registry-path", str(registry_file)] if registry_file is not None else [])

        # lux leads once and publishes the plan; each host's first pass writes generation 1 and its memo.
        for tree in trees:
            for host in ("lux", *HOSTS):
                run_child(sites[tree], pass_argv(host, tree), report)
            run_child(sites[tree], [], report)  # warm the bytecode cache of both trees
        cases = ("interpreter", "import reconciler", *(f"{h}, {c}" for c in ("new plan", "memo hit") for h in HOSTS))
        samples: dict[tuple[str, str], list[Sample]] = {(tree, case): [] for tree in trees for case in cases}
        for _ in range(args.repeats):  # interleaved: a busy moment of the machine falls on every case
            for tree in trees:
                samples[(tree, "interpreter")].append(run_child(sites[tree], [], report))
                samples[(tree, "import reconciler")].append(run_child(sites[tree], ["--import", "reconciler"], report))
                bump_epoch(desired, registry_file)
                for host in HOSTS:
                    samples[(tree, f"{host}, new plan")].append(run_child(sites[tree], pass_argv(host, tree), report, full=True))
                for host in HOSTS:
                    samples[(tree, f"{host}, memo hit")].append(run_child(sites[tree], pass_argv(host, tree), report, full=False))
        print(f"CPU of one process, median of {args.repeats}; {args.registry} registry, phaze's broker on PostgreSQL, --no-activate, --replay:")
        for tree in trees:
            print(f"{trees[tree]}{' (this checkout)' if tree == 'this' else ''}:")
            floor = median([s.cpu_s for s in samples[(tree, "interpreter")]])
            print(f"  {'case':<22} {'CPU s':>7} {'x interp.':>9} {'CPU s to activation':>20} {'modules':>8} {'to activation':>14}")
            for case in cases:
                got = samples[(tree, case)]
                cpu = median([s.cpu_s for s in got])
                at = [s.cpu_at_activation_s for s in got if s.cpu_at_activation_s is not None]
                mods_at = [s.modules_at_activation for s in got if s.modules_at_activation is not None]
                print(
                    f"  {case:<22} {cpu:7.3f} {cpu / floor:8.2f}x {(f'{median(at):.3f}' if at else '-'):>20}"
                    f" {int(median([s.modules for s in got])):>8} {(str(int(median(mods_at))) if mods_at else '-'):>14}"
                )
        if "against" in trees:
            print("this checkout / the other, medians:")
            for case in cases[2:]:
                mine, theirs = samples[("this", case)], samples[("against", case)]
                cpu = median([s.cpu_s for s in mine]) / median([s.cpu_s for s in theirs])
                modules = median([s.modules for s in mine]) / median([s.modules for s in theirs])
                at_mine = [s.cpu_at_activation_s for s in mine if s.cpu_at_activation_s is not None]
                at_theirs = [s.cpu_at_activation_s for s in theirs if s.cpu_at_activation_s is not None]
                to_activation = f", to activation {median(at_mine) / median(at_theirs):5.2f}x" if at_mine and at_theirs else ""
                print(f"  {case:<22} CPU {cpu:5.2f}x{to_activation}, modules {modules:5.2f}x")
        shutil.rmtree(tmp / "pycache", ignore_errors=True)


if __name__ == "__main__":
    main()
