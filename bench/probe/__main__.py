"""What a probe costs inside a reconcile pass (every 30 s on every host).

Run: /tmp/venv/bin/python bench/probe [--repeats N]

Prints:
  - the live collection on this machine (real commands and files, through
    SubprocessRunner and LocalFiles): wall time of each source and in total,
    best of --repeats, and which facts it could not get;
  - parsing + tiering of every fixture machine (pure): microseconds per probe,
    best of --repeats batches;
  - the size of each fixture capture on disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reconciler.adapters.commands import SubprocessRunner  # noqa: E402
from reconciler.adapters.probe_io import CaptureDirectory, LocalFiles  # noqa: E402
from reconciler.core.probe import RawCapture, facts_from_capture  # noqa: E402
from reconciler.core.probe.facts import FACTS  # noqa: E402
from reconciler.engine.probe import collect_live  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "probe"


def live(repeats: int) -> None:
    runner, files = SubprocessRunner(), LocalFiles()
    print("live collection on this machine (best of", repeats, "runs)")
    total_best = float("inf")
    per_fact: dict[str, float] = {}
    capture = None
    for _ in range(repeats):
        for fact in FACTS:
            t0 = time.perf_counter()
            collect_live(runner, files, (fact,))
            per_fact[fact.name] = min(per_fact.get(fact.name, float("inf")), time.perf_counter() - t0)
        t1 = time.perf_counter()
        capture = collect_live(runner, files)
        total_best = min(total_best, time.perf_counter() - t1)
    for name, seconds in per_fact.items():
        print(f"  {name:<12} {seconds * 1000:8.2f} ms")
    print(f"  {'all':<12} {total_best * 1000:8.2f} ms")
    assert capture is not None
    facts = facts_from_capture(capture)
    print(f"  tier {facts.tier}; absent here: {', '.join(sorted(facts.missing)) or 'nothing'}")


def parsing(repeats: int) -> None:
    store = CaptureDirectory()
    print("parse + tier per fixture machine (pure; best of", repeats, "batches of 200)")
    for machine in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        outputs, errors = store.load(str(machine))
        capture = RawCapture(outputs, errors)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(200):
                facts_from_capture(capture)
            best = min(best, (time.perf_counter() - t0) / 200)
        size = sum(len(text.encode()) for text in outputs.values())
        print(f"  {machine.name:<22} {best * 1e6:9.1f} us   capture {size / 1024:6.1f} KiB   tier {facts_from_capture(capture).tier}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    live(args.repeats)
    print()
    parsing(args.repeats)


if __name__ == "__main__":
    main()
