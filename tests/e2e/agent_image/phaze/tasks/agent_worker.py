"""A stand-in for phaze's compute agent worker, for the fleet's lane agents.

The rendered agent unit runs `python3 -m saq phaze.tasks.agent_worker.settings`
(or `uv run saq ...`) inside phaze's image, which this machine cannot pull; the
tests run that same command with this directory's parent on PYTHONPATH and
the unit's own Environment= (tests/e2e/test_fleet_live.py,
tests/integration/test_phaze_agent_standin.py). At its edges it does what
phaze's agent does (phaze a3fd169, tasks/agent_worker.py, config.py,
schemas/agent_tasks.py), with phaze's own messages:

- at import: PHAZE_AGENT_QUEUE is required (the base queue
  phaze-agent-<agent id>); PHAZE_AGENT_LANE, when set, is one of phaze's
  lanes and the worker consumes `<base>-<lane>` with that lane's concurrency
  (PHAZE_LANE_<LANE>_CONCURRENCY, at most WORKER_MAX_JOBS), else the bare base;
- at start: refuses without PHAZE_ROLE=agent, without PHAZE_AGENT_API_URL or
  its token (PHAZE_AGENT_TOKEN or PHAZE_AGENT_TOKEN_FILE), without a readable
  CA file (PHAZE_AGENT_CA_FILE, default /certs/phaze-ca.crt) or its models
  (MODELS_PATH, default /models); asks phaze's agent API who it is
  (GET /api/internal/agent/whoami, tests/e2e/phaze_api_stub.py) and refuses a
  queue that is not phaze-agent-<that agent id>;
- process_file validates its kwargs as phaze's ProcessFilePayload (file_id a
  UUID, original_path, file_type, agent_id, models_path; expected_sha256 and
  scratch_path optional; the legacy fine_cap/coarse_cap dropped; any other
  field refused) and records the file as processed
  (FABRIC_E2E_PROCESSED_DIR/<file_id> holds the queue's name);
- a real SAQ worker on PostgreSQL (the DSN from PHAZE_QUEUE_URL or
  PHAZE_QUEUE_URL_FILE) beating its stats every second.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from saq.queue.postgres import PostgresQueue

LANES = ("analyze", "meta", "io")
LANE_TASKS = {"analyze": {"process_file"}, "meta": set(), "io": set()}
PAYLOAD_REQUIRED = ("file_id", "original_path", "file_type", "agent_id", "models_path")
PAYLOAD_OPTIONAL = ("expected_sha256", "scratch_path")
LEGACY_DROPPED = ("fine_cap", "coarse_cap")


def _secret(name: str) -> str:
    """phaze's <VAR>_FILE convention: the direct variable wins, else the file's text, stripped."""
    if os.environ.get(name):
        return os.environ[name]
    path = os.environ.get(f"{name}_FILE")
    return Path(path).read_text().strip() if path else ""


_base = os.environ.get("PHAZE_AGENT_QUEUE")
if not _base:
    raise RuntimeError("PHAZE_AGENT_QUEUE env var is required for agent_worker. Expected form: phaze-agent-<agent_id>. See Phase 26 D-16.")
_lane = os.environ.get("PHAZE_AGENT_LANE") or None
if _lane is not None and _lane not in LANES:
    raise RuntimeError(f"invalid PHAZE_AGENT_LANE={_lane!r}; valid lanes are {list(LANES)} (or unset for all-mode).")
_max_jobs = int(os.environ.get("WORKER_MAX_JOBS", "8"))
if _lane is not None:
    QUEUE = f"{_base}-{_lane}"
    _concurrency = min(int(os.environ.get(f"PHAZE_LANE_{_lane.upper()}_CONCURRENCY", "4")), _max_jobs)
else:
    QUEUE = _base
    _concurrency = _max_jobs
PROCESSED = Path(os.environ.get("FABRIC_E2E_PROCESSED_DIR", "/tmp"))


def _settings_errors() -> None:
    """AgentSettings' validators (config.py), in phaze's words."""
    if not os.environ.get("PHAZE_AGENT_API_URL"):
        raise ValueError("PHAZE_AGENT_API_URL is required when PHAZE_ROLE=agent")
    if not _secret("PHAZE_AGENT_TOKEN"):
        raise ValueError("PHAZE_AGENT_TOKEN is required when PHAZE_ROLE=agent")
    if os.environ.get("PHAZE_AGENT_KIND", "fileserver") != "compute" and not os.environ.get("PHAZE_AGENT_SCAN_ROOTS"):
        raise ValueError("AgentSettings.scan_roots is required when PHAZE_ROLE=agent (set PHAZE_AGENT_SCAN_ROOTS=/path1,/path2)")


def _whoami() -> dict[str, Any]:
    request = urllib.request.Request(
        os.environ["PHAZE_AGENT_API_URL"].rstrip("/") + "/api/internal/agent/whoami",
        headers={"Authorization": f"Bearer {_secret('PHAZE_AGENT_TOKEN')}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            identity = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise RuntimeError("agent /whoami probe rejected by server (401/403); auth invalid; check PHAZE_AGENT_TOKEN") from None
        raise
    missing = [key for key in ("agent_id", "name", "scan_roots", "created_at") if key not in identity]
    if missing:
        raise RuntimeError(f"agent /whoami answer lacks {missing}")
    return identity


async def startup(ctx: dict[str, Any]) -> None:
    if os.environ.get("PHAZE_ROLE", "control") != "agent":
        raise RuntimeError("agent_worker requires PHAZE_ROLE=agent; get_settings() returned ControlSettings")
    _settings_errors()
    ca_file = os.environ.get("PHAZE_AGENT_CA_FILE", "/certs/phaze-ca.crt")
    try:
        readable = bool(Path(ca_file).read_bytes())
    except OSError:
        readable = False
    if not readable:
        raise RuntimeError(f"CA file empty or unreadable: {ca_file}")
    identity = _whoami()
    models = Path(os.environ.get("MODELS_PATH", "/models"))
    if not models.is_dir():
        raise RuntimeError(f"Model download failed: {models} is not a directory")
    expected_base = f"phaze-agent-{identity['agent_id']}"
    if _base != expected_base:
        raise RuntimeError(
            f"queue/token mismatch: token resolves to agent_id={identity['agent_id']} "
            f"(expected PHAZE_AGENT_QUEUE={expected_base}), but env PHAZE_AGENT_QUEUE={_base}. "
            "Operator misconfiguration -- exiting non-zero."
        )
    print(f"agent {identity['agent_id']}: consuming {QUEUE} with concurrency {_concurrency}", flush=True)


def validate_payload(kwargs: dict[str, Any]) -> dict[str, Any]:
    """phaze's ProcessFilePayload.model_validate (extra="forbid"), as a plain check."""
    payload = {key: value for key, value in kwargs.items() if key not in LEGACY_DROPPED}
    extra = sorted(set(payload) - set(PAYLOAD_REQUIRED) - set(PAYLOAD_OPTIONAL))
    missing = [key for key in PAYLOAD_REQUIRED if key not in payload]
    if extra or missing:
        raise ValueError(f"1 validation error for ProcessFilePayload: missing {missing}, extra fields not permitted {extra}")
    uuid.UUID(str(payload["file_id"]))
    for key in PAYLOAD_REQUIRED[1:]:
        if not isinstance(payload[key], str):
            raise ValueError(f"1 validation error for ProcessFilePayload: {key} must be a string")
    return payload


async def process_file(ctx: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    payload = validate_payload(kwargs)
    (PROCESSED / str(payload["file_id"])).write_text(f"{QUEUE}\n")
    return {"file_id": str(payload["file_id"]), "status": "analyzed"}


_functions = [("process_file", process_file)] if _lane is None or "process_file" in LANE_TASKS[_lane] else []

settings = {
    "queue": PostgresQueue.from_url(_secret("PHAZE_QUEUE_URL"), name=QUEUE, min_size=1, max_size=4),
    "functions": _functions,
    "concurrency": _concurrency,
    "startup": startup,
    # Beat every second (the stats live a second longer): a stopped agent's lane goes offline soon.
    "timers": {"worker_info": 1, "sweep": 1, "schedule": 1, "abort": 1},
    "dequeue_timeout": 0.2,
}
