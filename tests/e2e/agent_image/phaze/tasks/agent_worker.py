"""A stand-in for phaze's compute agent worker, for the e2e fleet's lane agents.

The rendered agent unit runs `python3 -m saq phaze.tasks.agent_worker.settings`
(or `uv run saq ...`) inside phaze's image, which this machine cannot pull; the
e2e test runs that same command with this directory's parent on PYTHONPATH and
the unit's own Environment= (tests/e2e/test_fleet_live.py,
test_agents_process_jobs_on_the_lanes_the_rules_chose). Like phaze's agent it
is a real SAQ worker on PostgreSQL: its queue is PHAZE_AGENT_QUEUE, the
broker's DSN is read from PHAZE_QUEUE_URL_FILE, and it refuses to start
without its token (PHAZE_AGENT_TOKEN_FILE). Processing a file is recording
which queue ran the job (FABRIC_E2E_PROCESSED_DIR/<job id> holds the queue's
name); SAQ then marks the job complete, and the dispatcher's next pass settles it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from saq.queue.postgres import PostgresQueue

QUEUE = os.environ["PHAZE_AGENT_QUEUE"]
if not Path(os.environ["PHAZE_AGENT_TOKEN_FILE"]).read_text().strip():
    raise SystemExit(f"agent for {QUEUE}: empty token file {os.environ['PHAZE_AGENT_TOKEN_FILE']}")
PROCESSED = Path(os.environ["FABRIC_E2E_PROCESSED_DIR"])


async def process_file(ctx: dict[str, Any], *, job_id: str, lane: str) -> str:
    (PROCESSED / job_id).write_text(f"{QUEUE}\n")
    return f"{job_id} processed on {QUEUE}"


settings = {
    "queue": PostgresQueue.from_url(Path(os.environ["PHAZE_QUEUE_URL_FILE"]).read_text().strip(), name=QUEUE, min_size=1, max_size=4),
    "functions": [("process_file", process_file)],
    "concurrency": int(os.environ.get("FABRIC_E2E_CONCURRENCY", "2")),
    # Beat every second (the stats live a second longer): a stopped agent's lane goes offline soon.
    "timers": {"worker_info": 1, "sweep": 1, "schedule": 1, "abort": 1},
    "dequeue_timeout": 0.2,
}
