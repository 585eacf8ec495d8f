"""The agent unit's environment, pinned to what phaze's agent reads.

phaze's agent worker (`saq phaze.tasks.agent_worker.settings`) and its
settings (`phaze.config.AgentSettings`, `get_settings()`) read these names;
each is quoted below from phaze's source at commit a3fd169 (2026.8.5-238,
the version docs/_incoming/phaze-lanes.md says the fabric matches). The
rendered unit of the example fleet's a1-arm64 agent must set exactly these
(plus the operator's [agent.environment]), with the values the desired state
gives. With PHAZE_SOURCE naming the git dir of a clone of phaze
(SimplicityGuy/phaze, holding commit PHAZE_COMMIT), each quote is also
checked in phaze's own source: a check a developer opts into when moving the
fabric to a newer phaze (no clone of phaze is part of this repository or of
what its scripts install, so the suite does not depend on one).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import PER_AGENT_VARIABLES, Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import render
from tests.conftest import EXAMPLE_FLEET, REPO

PHAZE_COMMIT = "a3fd169a1951df032428f4bc70ecb06b46ef7e7f"
PHAZE_SOURCE = Path(os.environ["PHAZE_SOURCE"]) if os.environ.get("PHAZE_SOURCE") else None

WORKER = "src/phaze/tasks/agent_worker.py"
CONFIG = "src/phaze/config.py"
SECRETS = "src/phaze/config_secrets.py"
ROUTER = "src/phaze/services/enqueue_router.py"

# name -> (value in the example fleet's a1-arm64 unit, (phaze file, the line that reads it))
CONTRACT: dict[str, tuple[str, tuple[str, str]]] = {
    "PHAZE_ROLE": ("agent", (CONFIG, 'role = os.environ.get("PHAZE_ROLE", "control")')),
    "PHAZE_AGENT_KIND": ("compute", (CONFIG, 'validation_alias=AliasChoices("PHAZE_AGENT_KIND", "kind"),')),
    "PHAZE_AGENT_QUEUE": ("phaze-agent-a1-arm64", (WORKER, 'expected_base = f"phaze-agent-{identity.agent_id}"')),
    "PHAZE_AGENT_LANE": ("analyze", (WORKER, '_lane = os.environ.get("PHAZE_AGENT_LANE") or None')),
    "PHAZE_LANE_ANALYZE_CONCURRENCY": ("2", (CONFIG, 'validation_alias=AliasChoices("PHAZE_LANE_ANALYZE_CONCURRENCY", "lane_analyze_concurrency"),')),
    "WORKER_MAX_JOBS": ("2", (CONFIG, "worker_max_jobs: int = 8")),
    "PHAZE_AGENT_API_URL": (
        "https://lux.tail-abc123.ts.net:8000",
        (CONFIG, 'validation_alias=AliasChoices("PHAZE_AGENT_API_URL", "agent_api_url"),'),
    ),
    # <ALIAS>_FILE siblings of the secret fields agent_token and queue_url.
    "PHAZE_AGENT_TOKEN_FILE": (
        "/run/secrets/phaze/agents/a1-arm64/token",
        (CONFIG, 'validation_alias=AliasChoices("PHAZE_AGENT_TOKEN", "agent_token"),'),
    ),
    "PHAZE_QUEUE_URL_FILE": ("/run/secrets/phaze/queue_url", (CONFIG, 'validation_alias=AliasChoices("PHAZE_QUEUE_URL", "queue_url"),')),
    "PHAZE_AGENT_CA_FILE": ("/run/secrets/phaze/ca.crt", (CONFIG, 'validation_alias=AliasChoices("PHAZE_AGENT_CA_FILE", "agent_ca_file"),')),
    "PHAZE_CLOUD_SCRATCH_DIR": ("/var/lib/phaze/scratch", (CONFIG, 'validation_alias=AliasChoices("PHAZE_CLOUD_SCRATCH_DIR", "cloud_scratch_dir"),')),
    "MODELS_PATH": ("/models", (CONFIG, 'models_path: str = "/models"')),
}
# How phaze makes the *_FILE names and the lane's queue, and which secrets take a file.
MECHANISMS = [
    (SECRETS, 'file_var = f"{env_name.upper()}_FILE"'),
    (SECRETS, 'SECRET_FILE_FIELDS: ClassVar[frozenset[str]] = frozenset({"database_url", "redis_url", "queue_url"})'),
    (CONFIG, 'SECRET_FILE_FIELDS: ClassVar[frozenset[str]] = BaseSettings.SECRET_FILE_FIELDS | {"agent_token", "push_ssh_key", "push_known_hosts"}'),
    (WORKER, '_queue_name = f"{_base}-{_lane}"'),
    (WORKER, '_base = os.environ.get("PHAZE_AGENT_QUEUE")'),
    (WORKER, 'msg = f"agent_worker requires PHAZE_ROLE=agent; get_settings() returned {type(cfg).__name__}"'),
    (ROUTER, '"analyze": "lane_analyze_concurrency",'),
]


def _unit_environment() -> tuple[dict[str, str], str]:
    desired = load_desired(EXAMPLE_FLEET)
    facts = HostFacts(node_id="a1-arm64", k3s_hostname="a1-arm64", hardware=Hardware(arch="aarch64"), tier="cpu_ffmpeg")  # type: ignore[arg-type]
    plan = FleetPlan.model_validate_json((REPO / "tests" / "golden" / "fleet-plan.json").read_text())
    text = next(a.content for a in render(desired, "a1-arm64", facts, plan).artifacts if a.path.endswith("fabric-agent-a1-arm64.service"))
    env = dict(re.findall(r'^Environment="([A-Z_][A-Z0-9_]*)=([^"]*)"$', text, flags=re.M))
    return env, text


def test_the_agent_unit_sets_what_phazes_agent_reads_and_only_the_operators_rest() -> None:
    env, text = _unit_environment()
    operator = dict(load_desired(EXAMPLE_FLEET).fleet.agent.environment)  # type: ignore[union-attr]
    assert env == {**{name: value for name, (value, _) in CONTRACT.items()}, **operator}
    # Each variable reaches the container by name; each *_FILE is a credential at its own path.
    for name in env:
        assert f'"--env={name}"' in text
    for name, value in env.items():
        if name.endswith("_FILE"):
            assert f"LoadCredential={name.lower()}:{value}" in text
            assert f"--volume=%d/{name.lower()}:{value}:ro" in text
    # The scratch dir at the same path, the models read-only at MODELS_PATH.
    assert '"--volume=/var/lib/phaze/scratch:/var/lib/phaze/scratch"' in text
    assert '"--volume=/var/lib/phaze/models:/models:ro"' in text
    # The file server's push key is no agent's (phaze's PHAZE_PUSH_SSH_KEY_FILE is the file server's).
    assert not any(name.startswith("PHAZE_PUSH") for name in env)


def test_every_variable_the_fabric_sets_is_one_the_operator_cannot_override() -> None:
    assert set(CONTRACT) <= set(PER_AGENT_VARIABLES)


def _phaze_file(source: Path, path: str) -> str:
    shown = subprocess.run(["git", f"--git-dir={source}", "show", f"{PHAZE_COMMIT}:{path}"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0, f"PHAZE_SOURCE={source}: {shown.stderr}"
    return shown.stdout


if PHAZE_SOURCE is not None:  # opted into: a clone of phaze is at hand

    @pytest.mark.parametrize("path", sorted({WORKER, CONFIG, SECRETS, ROUTER}))
    def test_the_quotes_are_phazes_own_source(path: str) -> None:
        assert PHAZE_SOURCE is not None
        source = _phaze_file(PHAZE_SOURCE, path)
        quotes = [quote for _, (_, (file, quote)) in CONTRACT.items() if file == path] + [quote for file, quote in MECHANISMS if file == path]
        missing = [quote for quote in quotes if quote not in source]
        assert not missing, f"{path} at {PHAZE_COMMIT[:7]} no longer says: {missing}"
