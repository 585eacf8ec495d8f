"""`fabric leader run` as bench/churn starts it: the real command (reconciler.cli.main)
with the registry's etcd requests recorded (tests/support/harness/etcd_requests)
and their figures written to STATS (JSON) every second, so the bench can print
the leader's request sizes. Run: python leader_child.py STATS -- leader run ...
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from reconciler.adapters import registry_etcd  # noqa: E402
from reconciler.cli import main  # noqa: E402
from tests.support.harness.etcd_requests import SeenRequests, recording_requests  # noqa: E402


class Totals:
    """Every request's bytes, beside SeenRequests' largest."""

    def __init__(self) -> None:
        self.bytes = 0
        self.writes = 0


def dump(stats: Path, seen: SeenRequests, totals: Totals, stop: threading.Event) -> None:
    while True:
        data = {
            "count": seen.count,
            "transactions": seen.transactions,
            "largest_txn_ops": seen.largest_txn_ops,
            "largest_request_bytes": seen.largest_request_bytes,
            "largest_request": seen.largest_request,
            "bytes": totals.bytes,
            "writes": totals.writes,
            "full_reads": sum(r.full_reads for r in registries),
            "view_reads": sum(r.view_reads for r in registries),
        }
        tmp = stats.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, stats)
        if stop.wait(1.0):
            return


registries: list = []


def profile_steps(path: Path) -> None:
    """FABRIC_BENCH_PROFILE=PATH: each leader step's wall time appended to
    PATH.steps (one line: start, seconds), each step's cProfile to PATH.N
    (pstats; N counts the steps from 1)."""
    import cProfile
    import itertools
    import time

    from reconciler.engine import leader

    step = leader.LeaderLoop.step
    lines = open(path.with_suffix(".steps"), "w")  # noqa: SIM115 - open for the process's life
    count = itertools.count(1)

    def timed(self) -> None:
        profile = cProfile.Profile()
        t, w = time.perf_counter(), time.time()
        profile.enable()
        try:
            step(self)
        finally:
            profile.disable()
            lines.write(f"{w:.3f} {time.perf_counter() - t:.3f}\n")
            lines.flush()
            profile.dump_stats(f"{path}.{next(count)}")

    leader.LeaderLoop.step = timed  # type: ignore[method-assign]


def run() -> int:
    stats = Path(sys.argv[1])
    if os.environ.get("FABRIC_BENCH_PROFILE"):
        profile_steps(Path(os.environ["FABRIC_BENCH_PROFILE"]))
    # `kill -USR1 PID` writes every thread's stack beside the stats (where is the leader?).
    stacks = open(stats.with_suffix(".stacks"), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    argv = sys.argv[sys.argv.index("--") + 1 :]
    totals = Totals()
    init = registry_etcd.EtcdRegistry.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        registries.append(self)

    registry_etcd.EtcdRegistry.__init__ = tracked  # type: ignore[method-assign]
    with recording_requests() as seen:
        note = seen.note

        def counted(method: str, request) -> None:
            note(method, request)
            totals.bytes += request.ByteSize()
            totals.writes += method in ("Put", "DeleteRange", "Txn")

        seen.note = counted  # type: ignore[method-assign]
        stop = threading.Event()
        dumper = threading.Thread(target=dump, args=(stats, seen, totals, stop), daemon=True)
        dumper.start()
        try:
            return main(argv)
        finally:
            stop.set()
            dumper.join()


if __name__ == "__main__":
    sys.exit(run())
