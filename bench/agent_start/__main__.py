"""What real podman costs a lane agent unit, against the e2e fleet's stand-in.

Run (root): .venv/bin/python bench/agent_start [--repeats N]

Boots one systemd container (tests/support/harness/systemd.py, user_namespaces=True),
builds the busybox image of tests/integration/test_agent_podman.py, renders the
x86-spill lane agent twice through the real render code (the same unit, once
with /usr/bin/podman, once with tests/e2e/podman_standin.py as its podman) and
times `systemctl start` (returns when the unit is active: podman run has
returned and conmon's PID file is read) and `systemctl stop` of each, N times.
The first real start also copies the image out of its archive into the unit's
storage; later starts find it there but still read the archive's manifest.

Prints the best and median of each, and real / stand-in ratios measured in the
same run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reconciler.core.render.artifacts import Layout, render  # noqa: E402
from tests.integration import test_agent_podman as agent  # noqa: E402
from tests.support.harness.agent_image import build_agent_image_archive  # noqa: E402
from tests.support.harness.systemd import SystemdContainer, systemd_container  # noqa: E402

STANDIN = "/usr/local/bin/podman-standin"
STANDIN_UNIT = "fabric-agent-standin.service"


def timed(container: SystemdContainer, *args: str) -> float:
    t0 = time.perf_counter()
    done = container.systemctl(*args, timeout=120)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"systemctl {' '.join(args)} failed: {done.stderr}\n{container.journal('-n', '30')}")
    return elapsed


def measure(work: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    archive = build_agent_image_archive(work)
    desired = agent.desired_with_local_image(work)
    real = next(a.content for a in render(desired, agent.LANE, agent.facts(agent.LANE), agent.plan()).artifacts if a.unit == agent.UNIT)
    standin = next(
        a.content
        for a in render(desired, agent.LANE, agent.facts(agent.LANE), agent.plan(), layout=Layout(podman=STANDIN)).artifacts
        if a.unit == agent.UNIT
    )
    with systemd_container(user_namespaces=True) as container:
        container.host_path(agent.IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
        container.host_path(agent.IMAGE_ARCHIVE).write_bytes(archive.read_bytes())
        container.host_path("/run/secrets/phaze").mkdir(parents=True, mode=0o700)
        for name in ("push_key", "queue_url"):
            container.write_file(f"/run/secrets/phaze/{name}", "bench\n", mode=0o600)
        container.host_path(f"/run/secrets/phaze/agents/{agent.LANE}").mkdir(parents=True, mode=0o700)
        container.write_file(f"/run/secrets/phaze/agents/{agent.LANE}/token", "bench\n", mode=0o600)
        container.write_file(STANDIN, (ROOT / "tests" / "e2e" / "podman_standin.py").read_text(), mode=0o755)
        container.write_file(f"/etc/systemd/system/{agent.UNIT}", real)
        container.write_file(f"/etc/systemd/system/{STANDIN_UNIT}", standin.replace(f"fabric-agent-{agent.LANE}", "fabric-agent-standin"))
        container.systemctl("daemon-reload")
        results: dict[str, dict[str, list[float]]] = {}
        for label, unit in (("real podman", agent.UNIT), ("stand-in", STANDIN_UNIT)):
            starts, stops = [], []
            for _ in range(repeats):
                starts.append(timed(container, "start", unit))
                stops.append(timed(container, "stop", unit))
            results[label] = {"start": starts, "stop": stops}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    work = Path(tempfile.mkdtemp(prefix="fabric-bench-agent-"))
    try:
        results = measure(work, repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"lane agent unit x86-spill, {repeats} start/stop cycles each, in one systemd container")
    for label, phases in results.items():
        for phase, values in phases.items():
            first = f" (first {values[0] * 1000:.0f} ms)" if phase == "start" else ""
            print(f"  {label:<12} {phase:<5} best {min(values) * 1000:7.0f} ms  median {statistics.median(values) * 1000:7.0f} ms{first}")
    for phase in ("start", "stop"):
        ratio = statistics.median(results["real podman"][phase]) / statistics.median(results["stand-in"][phase])
        print(f"  real / stand-in, median {phase}: {ratio:.1f}x")


if __name__ == "__main__":
    main()
