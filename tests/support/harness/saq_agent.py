"""A lane agent as its own process: one real `saq.Worker` on one lane queue, killable with SIGKILL.

    python -m tests.support.harness.saq_agent --dsn DSN --queue Q --log FILE [--concurrency N]
        [--beat S] [--touch S] [--duration S | --spread LOW,HIGH]

Its `process_file(ctx, *, job_id, lane)` (the function the fabric's lane
jobs run) appends a line to FILE when a run begins and when it ends, then
returns (SAQ marks the job complete):

    {"ev": "start", "job": ..., "key": ..., "agent": <pid>, "worker": ..., "t": <epoch s>}
    {"ev": "end", ...}

FILE is opened O_APPEND and each line is one write(2), so what a SIGKILLed
agent logged is all there. A run lasts `--duration` seconds, or a time in
`--spread` derived from the job id alone (the same on every run and every
machine); it touches its SAQ job (`await job.update()`, saq's job heartbeat)
every `--touch` seconds when > 0. The worker writes its stats every `--beat`
seconds (saq's worker_info; they live 1 s longer), sweeps its queue every
second and polls for jobs (no LISTEN, which a broker restart would end).
The first line is {"ev": "ready", ...}, once its first stats row is written.

`AgentProcess` starts one (by PID), `kill()` SIGKILLs it, `stop()` ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path


def run_seconds(job_id: str, spread: tuple[float, float]) -> float:
    """A run's length in `spread`, from the job id alone."""
    low, high = spread
    return low + (zlib.crc32(job_id.encode()) % 1000) / 1000 * (high - low)


def _line(fd: int, **fields: object) -> None:
    os.write(fd, (json.dumps({**fields, "agent": os.getpid(), "t": time.time()}) + "\n").encode())


async def _main(args: argparse.Namespace) -> None:
    from saq import Worker
    from saq.queue.postgres import PostgresQueue

    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    spread = tuple(float(x) for x in args.spread.split(",")) if args.spread else (args.duration, args.duration)

    async def process_file(ctx: dict, *, job_id: str, lane: str) -> str:
        job = ctx["job"]
        _line(fd, ev="start", job=job_id, key=job.key, lane=lane, worker=str(job.worker_id))
        end = time.monotonic() + run_seconds(job_id, spread)  # type: ignore[arg-type]
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, args.touch) if args.touch > 0 else left)
            if args.touch > 0 and end - time.monotonic() > 0:
                try:
                    await job.update()
                except Exception:  # the broker restarting: the work goes on, the next touch tells
                    pass
        _line(fd, ev="end", job=job_id, key=job.key, lane=lane, worker=str(job.worker_id))
        return "done"

    queue = PostgresQueue.from_url(args.dsn, name=args.queue, min_size=1, max_size=4)
    worker = Worker(
        queue,
        functions=[("process_file", process_file)],
        concurrency=args.concurrency,
        timers={"worker_info": args.beat, "sweep": 1, "schedule": 1, "abort": 1},
        poll_interval=0.1,
        dequeue_timeout=1.0,
    )
    await queue.connect()  # saq's tables: another agent may be making them at once (saq then skips), see below
    started = asyncio.get_running_loop().create_task(worker.start())
    while True:
        try:
            if str(worker.id) in {str(w) for w in (await queue.info())["workers"]}:
                break
        except Exception:  # the tables another agent is making, a broker starting
            pass
        await asyncio.sleep(0.05)
    _line(fd, ev="ready", worker=str(worker.id), queue=args.queue)
    await started


def main() -> None:
    parser = argparse.ArgumentParser(prog="saq_agent")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--beat", type=int, default=1)
    parser.add_argument("--touch", type=float, default=0.0)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--spread", default=None)
    asyncio.run(_main(parser.parse_args()))


@dataclass
class AgentProcess:
    """One agent process (see the module docstring); `log` is its run log."""

    dsn: str
    queue: str
    log: Path
    concurrency: int = 1
    beat: int = 1
    touch: float = 0.0
    duration: float = 3600.0
    spread: tuple[float, float] | None = None
    process: subprocess.Popen | None = None
    # When each of its processes was killed or found dead (pid -> epoch s).
    ended: dict[int, float] = field(default_factory=dict)

    def start(self) -> None:
        repo = Path(__file__).resolve().parents[3]  # tests/support/harness/ -> the checkout
        argv = [sys.executable, "-m", "tests.support.harness.saq_agent", "--dsn", self.dsn, "--queue", self.queue, "--log", str(self.log)]
        argv += ["--concurrency", str(self.concurrency), "--beat", str(self.beat), "--touch", str(self.touch)]
        argv += ["--spread", f"{self.spread[0]},{self.spread[1]}"] if self.spread else ["--duration", str(self.duration)]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        self.process = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{self.log}.stderr", "ab"))

    def ready(self) -> bool:
        """Its current process wrote its ready line."""
        if self.process is None:
            return False
        pid = self.process.pid
        return any(e["ev"] == "ready" and e["agent"] == pid for e in read_log(self.log))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> float:
        """SIGKILL its process (by PID); returns when, in epoch seconds."""
        assert self.process is not None
        at = time.time()
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.ended.setdefault(self.process.pid, at)
        return at

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            if self.process is not None:
                self.ended.setdefault(self.process.pid, time.time())
            return
        self.kill()


def read_log(path: Path) -> list[dict]:
    """The complete lines of an agent log (a line cut by a kill is dropped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


if __name__ == "__main__":
    main()
