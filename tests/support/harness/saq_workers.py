"""Real SAQ workers (`saq.Worker` on `saq.queue.postgres.PostgresQueue`) standing in for phaze's lane agents.

    workers = LaneWorkers(dsn)          # an asyncio loop on a thread of its own
    workers.start("phaze-agent-a1-arm64", concurrency=2)
    workers.finish("job-1")             # the job's function returns: SAQ marks it complete
    workers.finish("job-2", ok=False)   # ... raises: SAQ marks it failed
    workers.stop("phaze-agent-a1-arm64")
    workers.close()

Each worker runs the function phaze's lanes run (`process_file`, the default
[phaze] job_function, called with job_id and lane) until the test decides
how that job ends, so a job holds its lane slot as long as a test wants,
exactly like a long file. `ran` records which queue ran which job. The
workers beat their stats every `heartbeat_s` (saq's `worker_info` timer; the
stats live one second longer), so a stopped worker's lane goes offline soon.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from saq import Worker
from saq.queue.postgres import PostgresQueue


class LaneWorkers:
    def __init__(self, dsn: str, *, heartbeat_s: int = 1) -> None:
        self._dsn = dsn
        self._heartbeat_s = heartbeat_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="saq-workers", daemon=True)
        self._thread.start()
        self._workers: dict[str, tuple[Worker, PostgresQueue, asyncio.Task[None]]] = {}
        self._decided: dict[str, bool] = {}
        # Queues whose worker is stopping: a job of theirs still undecided ends as failed.
        self._stopping: set[str] = set()
        self._lock = threading.Lock()
        self.ran: dict[str, str] = {}  # job id -> the queue whose worker ran it

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, queue: str, concurrency: int = 4) -> None:
        async def process_file(ctx: dict, **kwargs: Any) -> str:
            # The fabric's own lane job ({job_id, lane}), or phaze's payload
            # (`enqueue_as_phaze`): the file's id is the job's.
            job_id = str(kwargs["job_id"] if "job_id" in kwargs else kwargs["file_id"])
            with self._lock:
                self.ran[job_id] = queue
            while True:
                with self._lock:
                    ok = self._decided.get(job_id)
                    if ok is None and queue in self._stopping:
                        ok = False
                if ok is not None:
                    break
                await asyncio.sleep(0.02)
            if not ok:
                raise RuntimeError(f"{job_id} failed on {queue}")
            return f"{job_id} done on {queue}"

        async def run() -> None:
            saq_queue = PostgresQueue.from_url(self._dsn, name=queue, min_size=1, max_size=4)
            worker = Worker(
                saq_queue,
                functions=[("process_file", process_file)],
                concurrency=concurrency,
                timers={"worker_info": self._heartbeat_s, "sweep": 1, "schedule": 1, "abort": 1},
                dequeue_timeout=0.2,
            )
            worker.SIGNALS = []  # type: ignore[misc]  # not the main thread: no signal handlers
            await saq_queue.connect()
            task = asyncio.get_running_loop().create_task(worker.start())
            self._workers[queue] = (worker, saq_queue, task)
            # Up once its first heartbeat is written (the lane counts it from then on).
            while not (await saq_queue.info())["workers"]:
                await asyncio.sleep(0.05)

        self._call(run())

    def finish(self, job_id: str, *, ok: bool = True) -> None:
        with self._lock:
            self._decided[job_id] = ok

    def running(self) -> dict[str, str]:
        with self._lock:
            return {job: queue for job, queue in self.ran.items() if job not in self._decided}

    def stop(self, queue: str) -> None:
        worker, saq_queue, task = self._workers.pop(queue)
        # Its jobs still undecided end now (as failed): a worker stops only
        # after its running jobs, which would otherwise wait for the test's
        # word until saq's grace period, longer than a loaded machine allows.
        # That includes a job the worker dequeued but had not begun when the
        # stop came (not in `ran` yet): it ends as soon as it begins (a
        # rehearsal's teardown hung 60 s on one).
        with self._lock:
            self._stopping.add(queue)
            for job, ran_on in self.ran.items():
                if ran_on == queue:
                    self._decided.setdefault(job, False)

        async def run() -> None:
            await worker.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await saq_queue.disconnect()

        try:
            self._call(run())
        finally:
            with self._lock:
                self._stopping.discard(queue)

    def close(self) -> None:
        for queue in list(self._workers):
            self.stop(queue)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# phaze's process_file payload (schemas/agent_tasks.py ProcessFilePayload at
# phaze a3fd169; extra fields forbidden) and how its enqueue_process_file
# (services/analysis_enqueue.py) puts it on an agent's analyze queue.
PHAZE_PAYLOAD_FIELDS = ("file_id", "original_path", "file_type", "agent_id", "models_path", "expected_sha256", "scratch_path")


def phaze_payload(file_id: str, agent_id: str, scratch_dir: str = "/var/lib/phaze/scratch", models_path: str = "/models") -> dict[str, Any]:
    """What phaze's report_pushed enqueues for a compute agent (agent_push.py)."""
    return {
        "file_id": file_id,
        "original_path": f"/music/{file_id}.flac",
        "file_type": "flac",
        "agent_id": agent_id,
        "models_path": models_path,
        "expected_sha256": "0" * 64,
        "scratch_path": f"{scratch_dir}/{file_id}.flac",
    }


def enqueue_as_phaze(dsn: str, queue: str, payloads: list[dict[str, Any]]) -> None:
    """Enqueue process_file jobs as phaze's control plane does: key
    process_file:<file_id>, timeout 0, heartbeat 3600 (2 x its analysis stall
    timeout), 2 retries, the payload as the function's kwargs."""

    async def run() -> None:
        saq_queue = PostgresQueue.from_url(dsn, name=queue, min_size=1, max_size=2)
        await saq_queue.connect()
        try:
            for payload in payloads:
                await saq_queue.enqueue("process_file", key=f"process_file:{payload['file_id']}", timeout=0, heartbeat=3600, retries=2, **payload)
        finally:
            await saq_queue.disconnect()

    asyncio.run(run())
