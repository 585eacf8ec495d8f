"""The example fleet with the fabric's own lanes: its lanes' queues carry the
fabric's prefix (`fabric-lane-<agent_ref>`, the local lane `fabric-local`),
never phaze's, and the crash timings a test gives. Shared by
test_lane_crash_pg.py, test_lane_chaos.py and bench/lane_crash (beside
harness/own_lanes.py, the dispatcher tests' fleet: this one also sets the crash timings)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState
from tests.conftest import EXAMPLE_FLEET

PREFIX = "fabric-lane-"
LOCAL_QUEUE = "fabric-local"


def own_lanes_fleet(directory: Path, *, beat_s: int = 1, grace_s: int = 1, job_heartbeat_s: int = 0) -> DesiredState:
    """The example fleet copied to `directory`, its lanes on the fabric's own
    queues (not a phaze fleet: no [phaze] api_url), its lane workers beating
    every `beat_s` (stats live 1 s longer), crashed after `grace_s` more,
    jobs carrying `job_heartbeat_s`."""
    shutil.copytree(EXAMPLE_FLEET, directory, dirs_exist_ok=True)
    toml = directory / "fabric.toml"
    text = re.sub(r"(?m)^(api_url|queue_prefix) = .*\n", "", toml.read_text())
    local = 'kind = "local"\nid = "local"\nrank = 99\ncap = 1\n'
    assert local in text, "the example fleet's local lane"
    text = text.replace(local, local + f'queue = "{LOCAL_QUEUE}"\n', 1)
    for section, lines in (
        ("[agent]\n", f'queue_prefix = "{PREFIX}"\n'),
        ("[scheduler]\n", f"lane_worker_beat_s = {beat_s}\nlane_crash_grace_s = {grace_s}\nlane_job_heartbeat_s = {job_heartbeat_s}\n"),
    ):
        assert section in text, section
        text = text.replace(section, section + lines, 1)
    toml.write_text(text)
    return load_desired(directory)
