"""A stand-in for one of phaze's lane workers, for scripts/demo: a real SAQ
worker on one lane's queue whose `process_file` takes HOLD seconds (a long
file), beating its stats every 2 s.

    python scripts/lane_worker.py DSN_FILE QUEUE CONCURRENCY HOLD_S

The DSN is read from DSN_FILE (as phaze's workers read PHAZE_QUEUE_URL_FILE).
SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from saq import Worker
from saq.queue.postgres import PostgresQueue


async def main(dsn_file: str, queue_name: str, concurrency: int, hold_s: float) -> None:
    async def process_file(ctx: dict, *, job_id: str, lane: str) -> str:
        await asyncio.sleep(hold_s)
        return f"{job_id} processed on {queue_name}"

    queue = PostgresQueue.from_url(Path(dsn_file).read_text().strip(), name=queue_name, min_size=1, max_size=4)
    worker = Worker(queue, functions=[("process_file", process_file)], concurrency=concurrency, timers={"worker_info": 2}, dequeue_timeout=0.5)
    await queue.connect()
    await worker.start()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
