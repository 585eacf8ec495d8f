"""What starting new services costs an activation: one batch against one at a time.

Run (root): .venv/bin/python bench/activation [--repeats N] [--grace S] [--sizes 1,4]

Boots one systemd container (tests/support/harness/systemd.py) with simple services
(`ExecStart=/bin/sleep infinity`, as an agent's unit is Type=simple) and, for
each size, starts that many through SystemdDbus with the startup grace the
pass uses (PassOptions.startup_grace, 1 s):

- batch: `run_jobs("start", units)`, what an activation does: every job queued
  at once, waited for together, one grace for all;
- one at a time, the baseline (activation before the batches): `run_jobs("start",
  [unit])` for each unit in turn, so each start is queued, waited for and
  watched through its own grace before the next is queued.

The services are stopped (untimed) after each start. The two ways alternate,
repeat after repeat, so drift in the machine's load hits both alike. Prints
best and median of each, the median ratio one-at-a-time / batch and what the
batch saves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters.systemd_dbus import SystemdDbus  # noqa: E402
from tests.support.harness.systemd import systemd_container  # noqa: E402

UNIT = "[Service]\nExecStart=/bin/sleep infinity\nRestart=on-failure\n"


def timed_start(systemd: SystemdDbus, units: list[str], *, batch: bool) -> float:
    t0 = time.perf_counter()
    outcomes = systemd.run_jobs("start", units) if batch else [o for unit in units for o in systemd.run_jobs("start", [unit])]
    elapsed = time.perf_counter() - t0
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"start failed: {failed}")
    stopped = systemd.run_jobs("stop", units)
    if not all(o.ok for o in stopped):
        raise SystemExit(f"stop failed: {stopped}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--grace", type=float, default=1.0, help="startup grace in seconds (the pass's default: 1)")
    parser.add_argument("--sizes", default="1,4", help="how many new services one activation starts, comma-separated")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    results: dict[int, dict[str, list[float]]] = {}
    with systemd_container() as container:
        names = [f"fabric-bench-service-{i}.service" for i in range(max(sizes))]
        for name in names:
            container.write_file(f"/etc/systemd/system/{name}", UNIT)
        with SystemdDbus(container.bus_address, startup_grace=args.grace) as systemd:
            systemd.daemon_reload()
            for size in sizes:
                units = names[:size]
                results[size] = {"one at a time": [], "batch": []}
                for _ in range(args.repeats):
                    results[size]["one at a time"].append(timed_start(systemd, units, batch=False))
                    results[size]["batch"].append(timed_start(systemd, units, batch=True))
    print(f"starting new simple services through SystemdDbus, startup grace {args.grace:g} s, {args.repeats} repeats, one systemd container")
    for size, ways in results.items():
        label = f"{size} service{'s' if size > 1 else ' '}"
        for way, values in ways.items():
            print(f"  {label} {way:<13} best {min(values) * 1000:7.0f} ms  median {statistics.median(values) * 1000:7.0f} ms")
        sequential, batch = statistics.median(ways["one at a time"]), statistics.median(ways["batch"])
        print(f"  {label} one at a time / batch, median: {sequential / batch:.2f}x (batch saves {(sequential - batch) * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
