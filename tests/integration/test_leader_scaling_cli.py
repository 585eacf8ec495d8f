"""`fabric leader run` wires the real CommandRunner: a burst makes the running leader run the hook.

A real leader process over a sqlite registry, with the example fleet whose
burst window is 1 s and whose batch hook is a tiny Python program appending
its argv to a file. This machine has no systemd as PID 1: a stand-in
`systemd-run` first on the leader's PATH records the argv the leader asks
for (the sandbox's properties) and runs what follows "--", reporting as
systemd-run --wait does; the sandbox itself is test_hook_sandbox's, against a
real systemd. Eleven jobs are enqueued with `fabric lane enqueue` on
phaze's broker (a real PostgreSQL, named by the desired state's [phaze]
queue_url_file, which the leader reads too); the test waits (bounded) for the
hook's line, then stops the leader by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.harness.own_lanes import own_lanes
from tests.support.harness.postgres import broker_url_file, naming_broker
from tests.support.plan_keys import signed_example_fleet

pytestmark = pytest.mark.integration

FABRIC = [sys.executable, "-m", "reconciler"]
# systemd-run's stand-in: its argv to $STUB_LOG, then the command after "--", then its report.
SYSTEMD_RUN_STUB = """#!/bin/sh
printf '%s\\n' "$*" >> "$STUB_LOG"
while [ "$1" != "--" ]; do shift; done
shift
"$@"
rc=$?
if [ $rc -eq 0 ]; then echo "Finished with result: success" >&2; else echo "Finished with result: exit-code" >&2; fi
echo "Main processes terminated with: code=exited/status=$rc" >&2
exit $rc
"""
HOOK = "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + '\\n')"


def desired_dir(tmp: Path, registry: Path, hook_out: Path, url_file: Path) -> tuple[Path, Path]:
    """The example fleet with throwaway plan keys, and lux's private key file."""
    signed = signed_example_fleet(tmp)
    target = signed.desired
    text = (target / "fabric.toml").read_text()
    registry_old = 'path = "/var/lib/fabric/registry.sqlite"'
    window_old = "burst_window_s = 30"
    hooks_start = text.index("[scaling.cloud_hooks.batch]")
    hooks_end = text.index("# The compute agent", hooks_start)
    assert registry_old in text and window_old in text
    hook = json.dumps([sys.executable, "-c", HOOK, str(hook_out), "batch", "two words", "$HOME"])
    text = text[:hooks_start] + f"[scaling.cloud_hooks.batch]\ncommand = {hook}\n\n" + text[hooks_end:]
    text = text.replace(registry_old, f'path = "{registry}"').replace(window_old, "burst_window_s = 1")
    text = naming_broker(own_lanes(text), url_file)  # the fabric's own lanes: the example fleet is phaze's
    (target / "fabric.toml").write_text(text)
    return target, signed.key_file("lux")


def test_the_running_leader_runs_the_configured_hook_with_its_exact_argv(tmp_path, broker_dsn):
    registry = tmp_path / "registry.sqlite"
    hook_out = tmp_path / "hooks.jsonl"
    url_file = broker_url_file(tmp_path, broker_dsn)
    desired, lux_key = desired_dir(tmp_path, registry, hook_out, url_file)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "systemd-run").write_text(SYSTEMD_RUN_STUB)
    (stubs / "systemd-run").chmod(0o755)
    stub_log = tmp_path / "systemd-run.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{stubs}:{os.environ['PATH']}", "STUB_LOG": str(stub_log)}
    env.pop("FABRIC_REGISTRY", None)
    common = ["--desired", str(desired)]
    enqueued = subprocess.run(
        [*FABRIC, "lane", "enqueue", *[f"burst-{i}" for i in range(11)], *common], env=env, capture_output=True, text=True, timeout=60
    )
    assert enqueued.returncode == 0, enqueued.stderr
    log = tmp_path / "leader.log"
    with open(log, "w") as out:
        leader = subprocess.Popen(
            [*FABRIC, "leader", "run", "--host", "lux", "--lease-ttl", "2", "--plan-key-file", str(lux_key), *common],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not hook_out.exists():
            assert leader.poll() is None, f"the leader died: {log.read_text()}"
            assert time.monotonic() < deadline, f"no hook ran: {log.read_text()}"
            time.sleep(0.1)
    finally:
        if leader.poll() is None:
            leader.send_signal(signal.SIGTERM)
        try:
            leader.wait(timeout=20)
        except subprocess.TimeoutExpired:
            leader.kill()
            leader.wait(timeout=20)
    runs = [json.loads(line) for line in hook_out.read_text().splitlines()]
    assert runs == [["batch", "two words", "$HOME"]], "ran once, argv untouched by any shell"
    text = log.read_text()
    assert "fabric-leader: scaling run_cloud_hook batch: ran, exit 0 (fabric-hook-batch-" in text, text
    [asked] = stub_log.read_text().splitlines()
    assert "--wait --collect" in asked and "--property=DynamicUser=yes" in asked and "--property=RuntimeMaxSec=60" in asked
    assert leader.returncode == 0

    status = subprocess.run([*FABRIC, "lane", "status", "--json", *common], env=env, capture_output=True, text=True, timeout=60)
    document = json.loads(status.stdout)
    assert document["queue_depth"] == 11
    assert document["scaling"]["hooks"]["batch"]["ok"] is True
    unit = document["scaling"]["hooks"]["batch"]["unit"]
    assert unit.startswith("fabric-hook-batch-") and document["scaling"]["hooks"]["batch"]["end"] == "ok"
    text = subprocess.run([*FABRIC, "lane", "status", *common], env=env, capture_output=True, text=True, timeout=60).stdout
    assert f": ok; journalctl _SYSTEMD_UNIT={unit}" in text, text
