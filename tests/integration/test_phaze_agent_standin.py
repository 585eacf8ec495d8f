"""The fleet's phaze agent stand-in (tests/e2e/agent_image) started with the rendered unit's environment.

The a1-arm64 agent unit of the example fleet is rendered by the real render
code (its [phaze] api_url pointed at a stub of phaze's agent API,
tests/e2e/phaze_api_stub.py), and its command runs
(`python3 -m saq phaze.tasks.agent_worker.settings`) with the unit's
Environment=, its files (token, broker DSN, CA) and its models directory
standing where the container would see them. With all of it the agent asks
phaze's API who it is, beats on phaze-agent-a1-arm64-analyze and processes
phaze-format process_file jobs (refusing any other payload); without any one
of what phaze's agent needs, it refuses to start with phaze's message. Every
agent process is stopped by its PID.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import render
from tests.conftest import EXAMPLE_FLEET, REPO
from tests.e2e.phaze_api_stub import serve
from tests.support.harness.saq_workers import enqueue_as_phaze, phaze_payload
from tests.support.harness.waiting import wait_until

pytestmark = pytest.mark.integration

AGENT_IMAGE = REPO / "tests" / "e2e" / "agent_image"
QUEUE = "phaze-agent-a1-arm64-analyze"
TOKENS = {"token-of-a1": "a1-arm64", "token-of-x86": "x86-spill"}
START_S = 30.0


@pytest.fixture
def api() -> Iterator[tuple[str, list[str]]]:
    server, url, asked = serve(TOKENS)
    try:
        yield url, asked
    finally:
        server.shutdown()
        server.server_close()


def rendered_environment(tmp_path: Path, api_url: str) -> tuple[list[str], dict[str, str]]:
    """The a1-arm64 agent unit's command (after its image) and Environment=."""
    fleet = tmp_path / "fleet"
    shutil.copytree(EXAMPLE_FLEET, fleet)
    toml = fleet / "fabric.toml"
    text = toml.read_text()
    toml.write_text(re.sub(r'(?m)^api_url = ".*"$', f'api_url = "{api_url}"', text, count=1))
    facts = HostFacts(node_id="a1-arm64", k3s_hostname="a1-arm64", hardware=Hardware(arch="aarch64"), tier="cpu_ffmpeg")  # type: ignore[arg-type]
    plan = FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())
    unit = next(a.content for a in render(load_desired(fleet), "a1-arm64", facts, plan).artifacts if a.path.endswith("fabric-agent-a1-arm64.service"))
    environment: dict[str, str] = {}
    command: list[str] = []
    for line in unit.splitlines():
        key, _, value = line.partition("=")
        if key == "Environment" and value.startswith('"'):
            name, _, setting = shlex.split(value)[0].partition("=")
            environment[name] = setting
        elif key == "ExecStart":
            argv = shlex.split(value)
            after_run = argv[argv.index("run") + 1 :]
            image = next(i for i, arg in enumerate(after_run) if not arg.startswith("-"))
            command = after_run[image + 1 :]
    assert command[:2] == ["python3", "-m"], command
    return [sys.executable, "-m", *command[2:]], environment


def host_side(environment: dict[str, str], tmp_path: Path, dsn: str, token: str = "token-of-a1") -> dict[str, str]:
    """The unit's files where the container would read them: each *_FILE's
    content in a file of its own here, the models directory bound at MODELS_PATH."""
    contents = {"PHAZE_AGENT_TOKEN_FILE": token + "\n", "PHAZE_QUEUE_URL_FILE": dsn + "\n", "PHAZE_AGENT_CA_FILE": "a CA\n"}
    env = dict(environment)
    files = tmp_path / "files"
    files.mkdir(exist_ok=True)
    for name in [n for n in env if n.endswith("_FILE")]:
        path = files / name.lower()
        path.write_text(contents[name])
        env[name] = str(path)
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    env["MODELS_PATH"] = str(models)
    return env


@contextmanager
def agent(command: list[str], env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    processed = tmp_path / "processed"
    processed.mkdir(exist_ok=True)
    full = {"PATH": os.environ["PATH"], **env, "PYTHONPATH": str(AGENT_IMAGE), "FABRIC_E2E_PROCESSED_DIR": str(processed)}
    process = subprocess.Popen(command, env=full, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def refusal(command: list[str], env: dict[str, str], tmp_path: Path) -> str:
    """Start the agent; it must exit non-zero; its output."""
    with agent(command, env, tmp_path) as process:
        try:
            out, _ = process.communicate(timeout=START_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the agent started although it should have refused")
        assert process.returncode != 0, out
        return out


def fresh_workers(dsn: str, queue: str) -> int:
    with psycopg.connect(dsn) as conn:
        try:
            row = conn.execute("SELECT count(*) FROM saq_stats WHERE queue_key = %s AND expire_at >= EXTRACT(EPOCH FROM NOW())", (queue,)).fetchone()
        except psycopg.errors.UndefinedTable:
            return 0
    return int(row[0]) if row else 0


def statuses(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT key, status FROM saq_jobs").fetchall())


def test_the_agent_with_the_rendered_environment_asks_who_it_is_beats_on_its_lane_queue_and_takes_only_phazes_payload(
    tmp_path: Path, broker_dsn: str, api: tuple[str, list[str]]
) -> None:
    url, asked = api
    command, environment = rendered_environment(tmp_path, url)
    env = host_side(environment, tmp_path, broker_dsn)
    good = phaze_payload("00000000-0000-4000-8000-000000000001", "a1-arm64")
    extra = {**phaze_payload("00000000-0000-4000-8000-000000000002", "a1-arm64"), "lane": "a1-arm64"}  # what the fabric used to send
    missing = {k: v for k, v in phaze_payload("00000000-0000-4000-8000-000000000003", "a1-arm64").items() if k != "models_path"}
    with agent(command, env, tmp_path) as process:
        wait_until(lambda: fresh_workers(broker_dsn, QUEUE) > 0 or process.poll() is not None, timeout=START_S, what=f"the agent beating on {QUEUE}")
        assert process.poll() is None, process.communicate()[0]
        assert asked == ["a1-arm64"]
        enqueue_as_phaze(broker_dsn, QUEUE, [good, extra, missing])
        keys = [f"process_file:{p['file_id']}" for p in (good, extra, missing)]
        wait_until(
            lambda: all(statuses(broker_dsn).get(k) in ("complete", "failed") for k in keys),
            timeout=START_S,
            what="the agent ending phaze's three jobs",
        )
        assert [statuses(broker_dsn)[k] for k in keys] == ["complete", "failed", "failed"]
        assert (tmp_path / "processed" / good["file_id"]).read_text() == f"{QUEUE}\n"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"PHAZE_ROLE": None}, "agent_worker requires PHAZE_ROLE=agent"),
        ({"PHAZE_AGENT_QUEUE": None}, "PHAZE_AGENT_QUEUE env var is required for agent_worker"),
        ({"PHAZE_AGENT_API_URL": None}, "PHAZE_AGENT_API_URL is required when PHAZE_ROLE=agent"),
        ({"PHAZE_AGENT_TOKEN_FILE": None}, "PHAZE_AGENT_TOKEN is required when PHAZE_ROLE=agent"),
        ({"PHAZE_AGENT_KIND": None}, "AgentSettings.scan_roots is required when PHAZE_ROLE=agent"),
        ({"PHAZE_AGENT_CA_FILE": "/nowhere/ca.crt"}, "CA file empty or unreadable: /nowhere/ca.crt"),
        ({"MODELS_PATH": "/nowhere/models"}, "Model download failed"),
        ({"token": "token-of-x86"}, "queue/token mismatch: token resolves to agent_id=x86-spill"),
        ({"token": "nobodys-token"}, "agent /whoami probe rejected by server (401/403)"),
    ],
    ids=["role", "queue", "api-url", "token", "kind", "ca-file", "models", "other-agents-token", "unknown-token"],
)
def test_without_what_phazes_agent_needs_the_agent_refuses_to_start(
    tmp_path: Path, broker_dsn: str, api: tuple[str, list[str]], change: dict[str, str | None], message: str
) -> None:
    url, _ = api
    command, environment = rendered_environment(tmp_path, url)
    env = host_side(environment, tmp_path, broker_dsn, token=str(change.pop("token", "token-of-a1")))
    for name, value in change.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    assert message in refusal(command, env, tmp_path)
    assert fresh_workers(broker_dsn, QUEUE) == 0
