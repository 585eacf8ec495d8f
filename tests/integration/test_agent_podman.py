"""The agent unit, confined and run for real.

- Exposure: `systemd-analyze security --offline=true` rates every unit the
  example fleet renders (lane agents and placed services, podman or direct,
  the podman workloads' account units, the port maps' socat units and the
  Ray units) at most 4.0, "OK".
- Real podman: a lane agent unit rendered by the real render code (the
  fleet's image replaced by one built here, since nothing can be pulled) runs
  its container with the host's podman inside a systemd container (systemd as
  PID 1, tests/support/harness/systemd.py), rootless as the workload's own
  static system user, made by its account unit from the rendered sysusers.d
  snippet; the container reads its *_FILE secret and writes its scratch
  directory; its user namespace maps that one ID (no subordinate range), and
  a 0600 file of uid 1000 in the image's layer is unpacked as its own and
  read (ignore_chown_errors); stopping the unit removes the container. A
  subordinate ID range for the user fails its account unit, naming the line.
  Two co-located agents (two lanes on one host) run side by side, each with
  its own queue, token and scratch dir.
- phaze's push: a file rsync'ed as the lane's ssh_user into its scratch_dir
  on the host (under /var/lib or not) is read by the agent, whose answer
  appears beside it at the real path; the agent cannot write a directory of
  that user's group outside its scratch dir.

The image is built here (tests/support/harness/agent_image.py: a static busybox and
an agent script, `podman import`, saved as an OCI archive the unit names).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.desired.model import DesiredState, Hardware, HostFacts
from reconciler.core.live.models import FleetPlan
from reconciler.core.render.artifacts import Artifact, account_unit, render, workload_user
from reconciler.core.scheduling.lanes import agent_unit
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.agent_image import AGENT_COMMAND, AGENT_IDLE, OWNED_FILE, OWNED_TEXT, build_agent_image_archive, layer_owners
from tests.support.harness.systemd import SystemdContainer, systemd_container
from tests.support.harness.waiting import wait_until

HOSTS = ["racknerd", "qfox-1", "a1-arm64", "x86-spill", "lux"]
GOLDEN_PLAN = REPO / "tests" / "golden" / "fleet-plan.json"
MAX_EXPOSURE = 4.0

LANE = "x86-spill"
UNIT = f"fabric-agent-{LANE}.service"
IMAGE_ARCHIVE = "/srv/fabric-test/agent-image.tar"
SCRATCH = "/var/lib/phaze/scratch"
TOKEN = "token-for-the-agent\n"
PUSHER = "phaze"  # the example fleet's ssh_user
MODELS = "/var/lib/phaze/models"  # the example fleet's agent.models_dir


def facts(host: str) -> HostFacts:
    arch = "aarch64" if host == "a1-arm64" else "x86_64"
    return HostFacts(node_id=host, k3s_hostname=host, hardware=Hardware(arch=arch), tier="cpu_ffmpeg")  # type: ignore[arg-type]


def plan() -> FleetPlan:
    return FleetPlan.model_validate_json(GOLDEN_PLAN.read_text())


def exposure(unit_file: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, f"no exposure figure for {unit_file.name}: {result.stdout[-500:]}{result.stderr[-500:]}"
    return float(found.group(1))


def test_every_rendered_unit_is_rated_ok(tmp_path: Path) -> None:
    require("systemd-analyze")
    desired = load_desired(EXAMPLE_FLEET)
    figures: dict[str, float] = {}
    for host in HOSTS:
        for artifact in render(desired, host, facts(host), plan()).artifacts:
            if artifact.unit is None or not artifact.unit.startswith(("fabric-agent-", "fabric-account-", "fabric-socat-", "fabric-ray-")):
                continue
            unit_file = tmp_path / host / artifact.unit
            unit_file.parent.mkdir(parents=True, exist_ok=True)
            unit_file.write_text(artifact.content)
            figures[f"{host}/{artifact.unit}"] = exposure(unit_file)
    print("\n".join(f"exposure {value:.1f}  {name}" for name, value in sorted(figures.items())))
    # The podman agents are among them (the point of this test).
    assert f"x86-spill/{UNIT}" in figures and "a1-arm64/fabric-agent-braid.service" in figures
    assert f"x86-spill/{account_unit(LANE)}" in figures
    assert "lux/fabric-ray-head.service" in figures and "qfox-1/fabric-ray-worker.service" in figures
    too_exposed = {name: value for name, value in figures.items() if value > MAX_EXPOSURE}
    assert not too_exposed, f"units rated above {MAX_EXPOSURE}: {too_exposed}"


def desired_with_local_image(tmp_path: Path) -> DesiredState:
    """The example fleet, its x86_64 agent image replaced by the archive built here."""
    desired = tmp_path / "desired"
    shutil.copytree(EXAMPLE_FLEET, desired)
    fleet = desired / "fabric.toml"
    text = fleet.read_text()
    old = 'image = "ghcr.io/researchstack/phaze:2026.11"\ncommand = ["uv", "run", "saq", "phaze.tasks.agent_worker.settings"]'
    assert old in text
    fleet.write_text(text.replace(old, f'image = "oci-archive:{IMAGE_ARCHIVE}"\ncommand = {json.dumps(AGENT_COMMAND)}'))
    return load_desired(desired)


# --------------------------------------------------------------------------
# Running it


@pytest.fixture(scope="module")
def container() -> Iterator[SystemdContainer]:
    require_root()
    require("unshare", "nsenter", "pivot_root", "podman", "conmon", "crun", "catatonit", "busybox", "setpriv")
    # pivot_root, not chroot: the kernel lets no chrooted process make the
    # user namespace rootless podman needs.
    with systemd_container(user_namespaces=True) as booted:
        # phaze's push user (the lanes' ssh_user), with its own group, as on a
        # host phaze pushes to.
        added = booted.run("useradd", "--system", "--user-group", "--no-create-home", PUSHER)
        assert added.returncode == 0, added.stderr
        yield booted


def as_pusher(container: SystemdContainer, *argv: str) -> subprocess.CompletedProcess[str]:
    return container.run("setpriv", f"--reuid={PUSHER}", f"--regid={PUSHER}", "--init-groups", *argv)


def push_and_wait_for_the_answer(container: SystemdContainer, scratch: str, job: str) -> None:
    """What phaze does: rsync -a a file into the lane's scratch_dir on the
    host, logged in as ssh_user; the agent reads it (the file is 0640, so
    only through its group) and writes its answer beside it, at the real path,
    which phaze can read and remove."""
    text = f"audio of {job}\n"
    outbox = f"/srv/phaze-outbox/{job}"
    assert container.run("mkdir", "-p", outbox).returncode == 0
    container.write_file(f"{outbox}/{job}.in", text, mode=0o640)
    assert container.run("chown", "-R", f"{PUSHER}:{PUSHER}", "/srv/phaze-outbox").returncode == 0
    pushed = as_pusher(container, "rsync", "-a", f"{outbox}/{job}.in", f"{scratch}/")
    assert pushed.returncode == 0, pushed.stderr
    answer = wait_until(
        lambda: as_pusher(container, "cat", f"{scratch}/{job}.out").stdout == f"analysed\n{text}",
        timeout=30,
        what=f"the agent's answer to {job} at {scratch}/{job}.out, readable by {PUSHER}",
    )
    assert answer
    assert as_pusher(container, "rm", f"{scratch}/{job}.in", f"{scratch}/{job}.out").returncode == 0


def as_unit_user(container: SystemdContainer, uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run podman as the unit's dynamic user, on the unit's storage."""
    return container.run(
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "env",
        f"HOME=/var/lib/fabric-agent-{LANE}",
        f"XDG_RUNTIME_DIR=/run/fabric-agent-{LANE}",
        "podman",
        "--cgroup-manager=cgroupfs",
        *argv,
    )


def install_workload(container: SystemdContainer, artifacts: tuple[Artifact, ...], workload: str) -> str:
    """Write a podman workload's files as a pass would: its agent unit, its
    account unit and its sysusers.d snippet; returns the agent unit's text."""
    account = account_unit(workload)
    mine = [a for a in artifacts if a.unit in (agent_unit(workload), account) or a.path == f"etc/sysusers.d/fabric-agent-{workload}.conf"]
    assert len(mine) == 3, [a.path for a in mine]
    for a in mine:
        container.write_file(f"/{a.path}", a.content, mode=a.mode)
    return next(a.content for a in mine if a.unit == agent_unit(workload))


def agent_host_files(container: SystemdContainer) -> None:
    """What a push host keeps for phaze's agent: phaze's broker DSN and the
    agent API's CA (root's, mode 0600), and phaze's models."""
    for name in ("queue_url", "ca.crt"):
        container.write_file(f"/run/secrets/phaze/{name}", f"{name}\n", mode=0o600)
    container.host_path(MODELS).mkdir(parents=True, exist_ok=True)
    container.write_file(f"{MODELS}/model-list", "models\n", mode=0o644)


def unit_property(container: SystemdContainer, name: str) -> str:
    return container.systemctl("show", f"--property={name}", "--value", UNIT).stdout.strip()


def test_agent_unit_runs_its_container_with_real_podman(container: SystemdContainer, tmp_path: Path) -> None:
    archive = build_agent_image_archive(tmp_path)
    artifacts = render(desired_with_local_image(tmp_path), LANE, facts(LANE), plan()).artifacts
    text = next(a.content for a in artifacts if a.unit == UNIT)
    assert f'"oci-archive:{IMAGE_ARCHIVE}"' in text and f"User={workload_user(LANE)}\n" in text and "DynamicUser=" not in text
    unit_file = tmp_path / UNIT
    unit_file.write_text(text)
    assert exposure(unit_file) <= MAX_EXPOSURE

    container.host_path(IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, container.host_path(IMAGE_ARCHIVE))
    # The secrets as a host keeps them: root's, mode 0600, in a 0700 directory.
    secrets = container.host_path("/run/secrets/phaze")
    secrets.mkdir(parents=True, mode=0o700)
    agent_host_files(container)
    # The agent's own token, under agent.token_dir/<agent_ref>/.
    container.host_path(f"/run/secrets/phaze/agents/{LANE}").mkdir(parents=True, mode=0o700)
    container.write_file(f"/run/secrets/phaze/agents/{LANE}/token", TOKEN, mode=0o600)

    install_workload(container, artifacts, LANE)
    assert container.systemctl("daemon-reload").returncode == 0
    started = container.systemctl("start", UNIT, timeout=120)
    assert started.returncode == 0, started.stderr + container.journal("-u", UNIT)
    wait_until(lambda: unit_property(container, "ActiveState") == "active", timeout=30, what=f"{UNIT} active")

    # Rootless: the workload's static user (made by its account unit, a
    # system user of /etc/passwd) owns its storage and is not root.
    entry = container.run("getent", "passwd", workload_user(LANE)).stdout.split(":")
    assert len(entry) == 7 and entry[5] == f"/var/lib/fabric-agent-{LANE}", entry
    uid = int(entry[2])
    assert 0 < uid < 1000
    assert int(container.run("stat", "-c", "%u", f"/var/lib/fabric-agent-{LANE}").stdout) == uid
    assert unit_property(container, "User") == workload_user(LANE)
    last: list[str] = []

    def container_state() -> bool:
        inspected = as_unit_user(container, uid, "container", "inspect", "--format", "{{.State.Status}}", f"fabric-agent-{LANE}")
        last[:] = [inspected.stdout + inspected.stderr]
        return inspected.stdout.strip() == "running"

    try:
        wait_until(container_state, timeout=30, what="podman to list the agent's container as running")
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}; podman said: {last}") from None
    # The agent read its secret (a credential of the unit, at the path its
    # variable names) and wrote its scratch directory.
    seen = wait_until(lambda: container.run("cat", f"{SCRATCH}/token-seen").stdout, timeout=30, what="the agent's record of its token")
    assert seen == TOKEN
    assert container.run("cat", f"{SCRATCH}/queue-seen").stdout == f"phaze-agent-{LANE}\n"
    # phaze's models at MODELS_PATH, read-only.
    assert container.run("cat", f"{SCRATCH}/models-seen").stdout == "models\nread-only\n"
    # One ID: the container's root is the workload's user and nothing else
    # is mapped (no subuid/subgid range, no newuidmap). The image's file of
    # uid 1000 (its layer says so) was unpacked all the same
    # (ignore_chown_errors): it is root's in the container, which reads it.
    assert layer_owners(archive)[OWNED_FILE.lstrip("/")] == (1000, 1000)
    gid = int(entry[3])
    maps = [line.split() for line in container.run("cat", f"{SCRATCH}/maps-seen").stdout.splitlines()]
    assert maps == [["0", str(uid), "1"], ["0", str(gid), "1"]], maps
    assert container.run("cat", f"{SCRATCH}/owned-seen").stdout == f"0:0\n{OWNED_TEXT}"
    # Its processes run as the unit's user, never as root.
    payload = container.run("pgrep", "-f", AGENT_IDLE).stdout.split()
    assert payload, "the agent's process is not running"
    owners = {container.run("ps", "-o", "uid=", "-p", pid).stdout.strip() for pid in payload}
    assert owners == {str(uid)}
    # A scratch dir under /var/lib is the pusher's real directory too, not a
    # state directory behind /var/lib/private (where phaze cannot reach).
    push_and_wait_for_the_answer(container, SCRATCH, "inside")

    stopped = container.systemctl("stop", UNIT, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    # A clean stop (the SIGTERM exit of the agent is a success), the container gone.
    assert unit_property(container, "ActiveState") == "inactive", container.journal("-u", UNIT)
    assert not container.run("pgrep", "-f", AGENT_IDLE).stdout.strip()
    # podman's runtime directory went with the unit, so its storage says it:
    # no container left (the images stay for the next start).
    storage = container.host_path(f"/var/lib/fabric-agent-{LANE}/.local/share/containers/storage")
    listings = list(storage.glob("*-containers/containers.json"))
    assert listings, f"no container storage under {storage}"
    assert all(json.loads(listing.read_text()) == [] for listing in listings)
    assert list(storage.glob("*-images/images.json"))
    # The user is static: it outlives the unit, and its account unit run
    # again (a changed snippet restarts it) changes nothing.
    restarted = container.systemctl("restart", account_unit(LANE), timeout=60)
    assert restarted.returncode == 0, restarted.stderr + container.journal("-u", account_unit(LANE))
    assert container.run("getent", "passwd", workload_user(LANE)).stdout.split(":") == entry
    assert [line.split(":")[0] for line in container.read_file("/etc/passwd").splitlines()].count(workload_user(LANE)) == 1


def test_a_subordinate_id_range_for_the_workload_user_fails_its_account_unit_naming_the_line(container: SystemdContainer, tmp_path: Path) -> None:
    """The fabric runs each workload user with one ID: a range in /etc/subuid
    and /etc/subgid (by name, by UID or for ALL, as podman looks it up) makes
    podman map through newuidmap/newgidmap, which the agent's
    NoNewPrivileges= stops (or which is not installed), so the agent cannot
    start. The account unit says so first, naming the file and the line (a
    line in one file alone too); without the lines both run."""
    archive = build_agent_image_archive(tmp_path)
    artifacts = render(desired_with_local_image(tmp_path), LANE, facts(LANE), plan()).artifacts
    container.host_path(IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, container.host_path(IMAGE_ARCHIVE))
    container.host_path(f"/run/secrets/phaze/agents/{LANE}").mkdir(parents=True, mode=0o700, exist_ok=True)
    agent_host_files(container)
    container.write_file(f"/run/secrets/phaze/agents/{LANE}/token", TOKEN, mode=0o600)
    install_workload(container, artifacts, LANE)
    assert container.systemctl("daemon-reload").returncode == 0
    account, user = account_unit(LANE), workload_user(LANE)
    before = {name: container.read_file(name) if container.host_path(name).exists() else "" for name in ("/etc/subuid", "/etc/subgid")}
    try:
        restarted = container.systemctl("restart", account, timeout=60)
        assert restarted.returncode == 0, restarted.stderr + container.journal("-u", account)
        uid = container.run("id", "-u", user).stdout.strip()
        # A range in both files, by name: podman would use it.
        lines = {name: f"{user}:300000:65536" for name in before}
        for name, line in lines.items():
            container.write_file(name, before[name] + line + "\n")
        failed = container.systemctl("restart", account, timeout=60)
        assert failed.returncode != 0
        said = container.journal("-u", account)
        for name, line in lines.items():
            assert f"{name}: {user} has a subordinate ID range ({line})" in said, said
        # Why: podman maps the range through newuidmap, and the agent cannot start.
        refused = container.systemctl("start", UNIT, timeout=120)
        assert refused.returncode != 0
        assert "newuidmap" in container.journal("-u", UNIT), container.journal("-u", UNIT)
        container.systemctl("reset-failed", UNIT, account)
        # One line alone, by UID or for ALL users, as podman matches them.
        for name, line in (("/etc/subgid", f"{uid}:300000:65536"), ("/etc/subuid", "ALL:300000:65536")):
            for each in before:
                container.write_file(each, before[each] + (line + "\n" if each == name else ""))
            failed = container.systemctl("restart", account, timeout=60)
            assert failed.returncode != 0
            said = container.journal("-u", account)
            assert f"{name}: {user} has a subordinate ID range ({line})" in said, said
        for name, text in before.items():
            container.write_file(name, text)
        restarted = container.systemctl("restart", account, timeout=60)
        assert restarted.returncode == 0, restarted.stderr + container.journal("-u", account)
        started = container.systemctl("start", UNIT, timeout=120)
        assert started.returncode == 0, started.stderr + container.journal("-u", UNIT)
    finally:
        for name, text in before.items():
            container.write_file(name, text)
        container.systemctl("stop", UNIT, timeout=120)


SECOND = "x86-spill-b"
SECOND_SCRATCH = "/var/lib/phaze/scratch-b"


def test_two_agents_on_one_host_each_run_with_their_own_queue_token_and_scratch_dir(container: SystemdContainer, tmp_path: Path) -> None:
    """multi-compute.md's co-located agents: a second lane on x86-spill (its
    own agent_ref, scratch dir and token), both units rendered by the real
    render code and run with real podman side by side; each agent sees only
    its own queue, token and scratch dir."""
    archive = build_agent_image_archive(tmp_path)
    desired_with_local_image(tmp_path)  # writes tmp_path/desired
    fleet = tmp_path / "desired" / "fabric.toml"
    text = fleet.read_text()
    second = (
        f'[[backends]]\nkind = "compute"\nid = "{SECOND}"\nrank = 25\ncap = 1\nagent_ref = "{SECOND}"\n'
        f'push_host = "{LANE}"\nscratch_dir = "{SECOND_SCRATCH}"\nssh_user = "{PUSHER}"\n\n'
    )
    fleet.write_text(text.replace("# --- Final catch", second + "# --- Final catch", 1))
    state = load_desired(tmp_path / "desired")
    artifacts = render(state, LANE, facts(LANE), plan()).artifacts
    units = {a.unit: a.content for a in artifacts if a.unit and a.unit.startswith("fabric-agent-x86")}
    assert sorted(units) == sorted([UNIT, f"fabric-agent-{SECOND}.service"])

    container.host_path(IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, container.host_path(IMAGE_ARCHIVE))
    container.host_path("/run/secrets/phaze").mkdir(parents=True, mode=0o700, exist_ok=True)
    agent_host_files(container)
    tokens = {LANE: "token-of-x86-spill\n", SECOND: "token-of-x86-spill-b\n"}
    for ref, token in tokens.items():
        container.host_path(f"/run/secrets/phaze/agents/{ref}").mkdir(parents=True, mode=0o700, exist_ok=True)
        container.write_file(f"/run/secrets/phaze/agents/{ref}/token", token, mode=0o600)
    for ref in tokens:
        install_workload(container, artifacts, ref)
    assert container.systemctl("daemon-reload").returncode == 0
    try:
        for unit in units:
            started = container.systemctl("start", unit, timeout=120)
            assert started.returncode == 0, started.stderr + container.journal("-u", unit)
        for ref, scratch in ((LANE, SCRATCH), (SECOND, SECOND_SCRATCH)):
            seen = wait_until(lambda s=scratch: container.run("cat", f"{s}/token-seen").stdout, timeout=30, what=f"{ref}'s record of its token")
            assert seen == tokens[ref]
            assert container.run("cat", f"{scratch}/queue-seen").stdout == f"phaze-agent-{ref}\n"
        # Two containers of their own, both running, each as its own user.
        for unit in units:
            assert container.systemctl("is-active", unit).stdout.strip() == "active", container.journal("-u", unit)
        uids = {container.run("id", "-u", workload_user(ref)).stdout.strip() for ref in tokens}
        assert len(uids) == 2 and "" not in uids
    finally:
        for unit in units:
            container.systemctl("stop", unit, timeout=120)


OUTSIDE_SCRATCH = "/srv/phaze/scratch"


def test_agent_reads_what_phaze_pushes_to_a_scratch_dir_outside_var_lib(container: SystemdContainer, tmp_path: Path) -> None:
    """issue 12's bug: a scratch_dir outside /var/lib was kept under the
    unit's state directory, so phaze's push landed where the container never
    looked. Now the container sees the declared path itself."""
    archive = build_agent_image_archive(tmp_path)
    desired_with_local_image(tmp_path)  # writes tmp_path/desired
    fleet = tmp_path / "desired" / "fabric.toml"
    text = fleet.read_text()
    old = f'push_host = "{LANE}"\nscratch_dir = "{SCRATCH}"'
    assert old in text
    fleet.write_text(text.replace(old, f'push_host = "{LANE}"\nscratch_dir = "{OUTSIDE_SCRATCH}"'))
    rendered = render(load_desired(tmp_path / "desired"), LANE, facts(LANE), plan())
    unit_text = next(a.content for a in rendered.artifacts if a.unit == UNIT)
    unit_file = tmp_path / UNIT
    unit_file.write_text(unit_text)
    assert exposure(unit_file) <= MAX_EXPOSURE

    container.host_path(IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, container.host_path(IMAGE_ARCHIVE))
    container.host_path("/run/secrets/phaze").mkdir(parents=True, mode=0o700, exist_ok=True)
    agent_host_files(container)
    container.host_path(f"/run/secrets/phaze/agents/{LANE}").mkdir(parents=True, mode=0o700, exist_ok=True)
    container.write_file(f"/run/secrets/phaze/agents/{LANE}/token", TOKEN, mode=0o600)
    install_workload(container, rendered.artifacts, LANE)
    assert container.systemctl("daemon-reload").returncode == 0
    try:
        started = container.systemctl("start", UNIT, timeout=120)
        assert started.returncode == 0, started.stderr + container.journal("-u", UNIT)
        seen = wait_until(lambda: container.run("cat", f"{OUTSIDE_SCRATCH}/token-seen").stdout, timeout=30, what="the agent's record of its token")
        assert seen == TOKEN
        # The directory is the pusher's, with its group, setgid, at its real path.
        assert container.run("stat", "-c", "%U:%G %a %F", OUTSIDE_SCRATCH).stdout.strip() == f"{PUSHER}:{PUSHER} 2770 directory"
        push_and_wait_for_the_answer(container, OUTSIDE_SCRATCH, "outside")
        # The group opens the scratch dir only: another directory of the
        # pusher's group is read-only in the unit's namespace (ProtectSystem=
        # strict; ReadWritePaths= names the scratch dir alone).
        other = "/srv/phaze/other"
        assert container.run("install", "-d", "-o", PUSHER, "-g", PUSHER, "-m", "2770", other).returncode == 0
        main_pid = unit_property(container, "MainPID")
        uid = container.run("ps", "-o", "uid=", "-p", main_pid).stdout.strip()
        gid = container.run("getent", "group", PUSHER).stdout.split(":")[2]

        def touch_as_the_agent(path: str) -> subprocess.CompletedProcess[str]:
            return container.run(
                "nsenter", "-t", main_pid, "-m", "--", "setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={gid}", "touch", path
            )

        assert touch_as_the_agent(f"{OUTSIDE_SCRATCH}/written-by-the-agent").returncode == 0
        refused = touch_as_the_agent(f"{other}/written-by-the-agent")
        assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
        # Nothing was kept under the unit's state directory.
        assert not container.host_path(f"/var/lib/fabric-agent-{LANE}/volumes").exists()
    finally:
        container.systemctl("stop", UNIT, timeout=120)


def test_an_agent_that_ran_as_a_dynamic_user_starts_as_its_static_user_with_its_storage(container: SystemdContainer, tmp_path: Path) -> None:
    """A host upgraded from the DynamicUser= unit: systemd moves the state
    directory back out of /var/lib/private and gives it to the static user,
    so podman finds the images the dynamic user stored."""
    archive = build_agent_image_archive(tmp_path)
    artifacts = render(desired_with_local_image(tmp_path), LANE, facts(LANE), plan()).artifacts
    new = next(a.content for a in artifacts if a.unit == UNIT)
    user = workload_user(LANE)
    # The unit as the fabric rendered it before: a dynamic user, no account unit.
    old = new.replace(f"User={user}\nGroup={user}\n", "DynamicUser=yes\n")
    old = old.replace(f"Wants={account_unit(LANE)}\nAfter={account_unit(LANE)}\n", "")
    assert "\nDynamicUser=yes\n" in old and "\nUser=" not in old and f"\nWants={account_unit(LANE)}" not in old
    # A fresh start: no user, no state of the earlier tests.
    container.systemctl("stop", UNIT, account_unit(LANE), timeout=120)
    container.run("userdel", user)
    container.run("rm", "-rf", f"/var/lib/fabric-agent-{LANE}", f"/var/lib/private/fabric-agent-{LANE}")
    container.run("rm", "-f", f"/etc/systemd/system/{account_unit(LANE)}", f"/etc/sysusers.d/fabric-agent-{LANE}.conf")
    container.host_path(IMAGE_ARCHIVE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(archive, container.host_path(IMAGE_ARCHIVE))
    container.host_path(f"/run/secrets/phaze/agents/{LANE}").mkdir(parents=True, mode=0o700, exist_ok=True)
    agent_host_files(container)
    container.write_file(f"/run/secrets/phaze/agents/{LANE}/token", TOKEN, mode=0o600)
    container.write_file(f"/etc/systemd/system/{UNIT}", old, mode=0o640)
    assert container.systemctl("daemon-reload").returncode == 0
    try:
        started = container.systemctl("start", UNIT, timeout=120)
        assert started.returncode == 0, started.stderr + container.journal("-u", UNIT)
        assert container.run("test", "-L", f"/var/lib/fabric-agent-{LANE}").returncode == 0  # -> private/
        images = container.host_path(f"/var/lib/private/fabric-agent-{LANE}/.local/share/containers/storage")
        wait_until(lambda: list(images.glob("*-images/images.json")), timeout=30, what="the dynamic user's image storage")
        assert container.systemctl("stop", UNIT, timeout=120).returncode == 0

        text = install_workload(container, artifacts, LANE)
        assert text == new
        assert container.systemctl("daemon-reload").returncode == 0
        started = container.systemctl("start", UNIT, timeout=120)
        assert started.returncode == 0, started.stderr + container.journal("-u", UNIT)
        wait_until(lambda: unit_property(container, "ActiveState") == "active", timeout=30, what=f"{UNIT} active as {user}")
        uid = container.run("id", "-u", user).stdout.strip()
        # A real directory again, the static user's, with the storage in it.
        state = f"/var/lib/fabric-agent-{LANE}"
        assert container.run("test", "-L", state).returncode != 0
        assert container.run("stat", "-c", "%u", state).stdout.strip() == uid
        storage = container.host_path(f"{state}/.local/share/containers/storage")
        assert list(storage.glob("*-images/images.json"))
        listed = as_unit_user(container, int(uid), "images", "--format", "{{.ID}}")
        assert listed.returncode == 0 and listed.stdout.strip(), listed.stderr
    finally:
        container.systemctl("stop", UNIT, timeout=120)
