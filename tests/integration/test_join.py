"""scripts/join.sh on a plain systemd host: systemd as PID 1 in a container.

join.sh builds a wheel of this checkout with pip and installs it into
/opt/fabric, offline (--wheelhouse: the test venv's own installed
distributions, the dependencies and the build backend, repacked as wheels),
writes node.toml and the units `fabric units` renders, enables the
timer and runs a first pass of the example fleet as host "racknerd". The test
then checks what an operator would: the timer is active, a pass has run and
succeeded, its audit entries are in the journal, and the installed units are
byte for byte what reconciler/core/install/units.py renders (the definitions the NixOS
module is compared against in tests/unit/test_nix_module.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from reconciler.core.install.nodeconfig import parse_node_config
from reconciler.core.install.units import Install, host_units
from tests.conftest import EXAMPLE_FLEET, REPO, require, require_root
from tests.support.harness.systemd import SystemdContainer, systemd_container
from tests.support.harness.waiting import wait_until
from tests.support.wheel import runtime_requirements
from tests.support.wheel import wheelhouse as make_wheelhouse

pytestmark = pytest.mark.integration

PREFIX = "/opt/fabric"
WHEELHOUSE = "/var/cache/fabric-wheelhouse"
SEARCH_PATH = f"{PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# join.sh's timer: a pass every 30 s (its default --interval) plus up to 5 s of
# randomized delay (node.toml's default). A pass queued by the timer starts within this.
TIMER_PERIOD_S = 30 + 5


def run_join(container: SystemdContainer, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """scripts/join.sh inside `container`, installing this checkout from the offline wheelhouse."""
    return container.run("bash", str(REPO / "scripts" / "join.sh"), "--source", str(REPO), "--wheelhouse", WHEELHOUSE, *args, timeout=timeout)


@pytest.fixture(scope="module")
def wheelhouse() -> Iterator[Path]:
    """The runtime dependencies pyproject.toml declares, and the build backend
    join.sh builds the checkout's wheel with, as wheels, made offline."""
    directory = Path(tempfile.mkdtemp(prefix="fabric-wheelhouse-"))
    try:
        project = tomllib.loads((REPO / "pyproject.toml").read_text())
        build_backend = runtime_requirements(project["build-system"]["requires"])
        yield make_wheelhouse([*runtime_requirements(project["project"]["dependencies"]), *build_backend, "wheel"], directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def joined(wheelhouse: Path) -> Iterator[tuple[SystemdContainer, subprocess.CompletedProcess[str]]]:
    require_root()
    require("unshare", "nsenter", "chroot", "python3", "nft", "socat", "caddy")
    # Its own network namespace: the pass loads `table inet fabric` for real.
    with systemd_container(hostname="racknerd", private_network=True) as container:
        for toml in sorted(EXAMPLE_FLEET.glob("*.toml")):
            container.write_file(f"/var/lib/fabric/desired/{toml.name}", toml.read_text())
        # The example fleet's service programs do not exist here: a stand-in
        # that stays up, so the pass can start the services placed on this host.
        for program in ("lupine-server", "encode-server", "fft-server"):
            container.write_file(f"/opt/researchstack/bin/{program}", "#!/bin/sh\nexec sleep infinity\n", mode=0o755)
        # The edge's Caddy, whose admin API the pass loads the site snippet into.
        container.write_file("/etc/caddy/Caddyfile", "{\n\tadmin localhost:2019\n\tauto_https off\n}\n")
        # The container's /tmp is its own: copy the wheels in.
        shutil.copytree(wheelhouse, container.host_path(WHEELHOUSE))
        started = container.systemctl("start", "caddy.service")
        assert started.returncode == 0, started.stderr
        result = run_join(
            container,
            "--host",
            "racknerd",
            "--interval",
            "30s",
            timeout=600,
        )
        yield container, result


def test_join_installs_enables_the_timer_and_a_pass_runs(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    container, result = joined
    journal = container.journal("-t", "fabric-reconcile", "-o", "cat")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{journal}"
    # What it detected, printed for the operator.
    for line in ("architecture:", "gpus:", "storage:", "memory:", "tailscale:"):
        assert line in result.stdout
    # Installed by pip like any distribution: its files are known, the
    # templates among them as package data, bin/fabric its entry point.
    shown = container.run(f"{PREFIX}/bin/python", "-m", "pip", "show", "--files", "fabric-reconciler")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "reconciler/templates/agent.service.j2" in shown.stdout and "../../../bin/fabric" in shown.stdout, shown.stdout

    status = container.systemctl("show", "fabric-reconcile.timer", "-p", "ActiveState", "-p", "SubState")
    state = dict(line.split("=", 1) for line in status.stdout.splitlines())
    # Waiting for its next elapse, or (when it fires as we look) running its pass.
    assert state["ActiveState"] == "active" and state["SubState"] in ("waiting", "running"), state
    assert container.systemctl("is-enabled", "fabric-reconcile.timer").stdout.strip() == "enabled"

    shown = container.systemctl("show", "fabric-reconcile.service", "-p", "Result", "-p", "ExecMainStatus", "-p", "ExecMainStartTimestampMonotonic")
    props = dict(line.split("=", 1) for line in shown.stdout.splitlines())
    assert props["Result"] == "success"
    assert props["ExecMainStatus"] == "0"
    assert int(props["ExecMainStartTimestampMonotonic"]) > 0
    assert journal.strip(), "no audit entries under -t fabric-reconcile"


def test_the_pass_activated_the_edge(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    container, _ = joined
    assert container.run("nft", "list", "table", "inet", "fabric").returncode == 0
    for unit in ("fabric-socat-qfox-ssh.service", "fabric-socat-lux-smb.service"):
        assert container.systemctl("is-active", unit).stdout.strip() == "active", unit


def test_debians_node_exporter_serves_the_series_each_pass_writes(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    """Debian's prometheus-node-exporter, as packaged (its unit, its defaults
    file, its user), reads /var/lib/prometheus/node-exporter: join.sh linked
    the pass's textfile there, and the fabric's series are on /metrics."""
    require("prometheus-node-exporter")
    container, result = joined
    assert "node_exporter reads /var/lib/prometheus/node-exporter" in result.stdout, result.stdout
    started = container.systemctl("start", "prometheus-node-exporter.service")
    assert started.returncode == 0, started.stderr

    def scraped() -> str | None:
        metrics = container.run("curl", "-fsS", "http://127.0.0.1:9100/metrics")
        return metrics.stdout if metrics.returncode == 0 and "fabric_generation" in metrics.stdout else None

    metrics = wait_until(scraped, timeout=TIMER_PERIOD_S, interval=0.5, what="node_exporter serving fabric_generation")
    assert re.search(r"^fabric_generation\{[^}]*\} \d+", metrics, re.M) or re.search(r"^fabric_generation \d+", metrics, re.M), metrics[:2000]
    # The textfile collector read the file without an error.
    assert re.search(r"^node_textfile_scrape_error 0$", metrics, re.M), [ln for ln in metrics.splitlines() if "textfile" in ln]
    container.systemctl("stop", "prometheus-node-exporter.service")


def test_installed_units_are_what_reconciler_units_renders(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    container, _ = joined
    node = parse_node_config(container.read_file("/etc/fabric/node.toml"))
    assert node.node.host == "racknerd"
    install = Install(fabric_bin=f"{PREFIX}/bin/fabric", node=node, search_path=SEARCH_PATH)
    for unit in host_units(install, leader_candidate=False):
        assert container.read_file(f"/etc/systemd/system/{unit.name}") == unit.text(), unit.name
    # The unit systemd loaded runs the installed program.
    exec_start = container.systemctl("show", "fabric-reconcile.service", "-p", "ExecStart", "--value").stdout
    expected = f"argv[]={PREFIX}/bin/fabric reconcile --desired /var/lib/fabric/desired --unit-dir /etc/systemd/system --host racknerd ;"
    assert expected in exec_start, exec_start


def test_join_twice_changes_nothing(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]], wheelhouse: Path) -> None:
    container, _ = joined
    before = container.read_file("/etc/systemd/system/fabric-reconcile.service")
    again = run_join(
        container,
        "--host",
        "racknerd",
        "--no-first-pass",
        timeout=600,
    )
    assert again.returncode == 0, again.stderr
    assert "unchanged /etc/systemd/system/fabric-reconcile.service" in again.stdout
    assert container.read_file("/etc/systemd/system/fabric-reconcile.service") == before


def test_bad_setting_stops_before_touching_the_units(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]], wheelhouse: Path) -> None:
    container, _ = joined
    before = container.read_file("/etc/fabric/node.toml")
    bad = run_join(
        container,
        "--host",
        "racknerd",
        "--desired",
        "relative/path",
        "--no-first-pass",
        timeout=600,
    )
    assert bad.returncode == 2
    assert "node.toml.new: node.desired:" in bad.stderr and "absolute path" in bad.stderr
    assert container.read_file("/etc/fabric/node.toml") == before


def test_bootstrap_after_join_opens_the_distro_ruleset_and_is_idempotent(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    """The CachyOS/Arch fix for real: a distro ruleset whose forward chain drops,
    the fix inserted into it, kept across the distro's reloads, and a second
    bootstrap with nothing to do."""
    container, _ = joined
    fabric = f"{PREFIX}/bin/fabric"
    # Debian's nftables.service (flush ruleset, then its own table inet filter)
    # stands in for the distro's; a drop policy on forward like CachyOS's.
    container.write_file(
        "/etc/nftables.conf",
        (
            "flush ruleset\n"
            "table inet filter {\n"
            "\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n\t}\n"
            "\tchain forward {\n\t\ttype filter hook forward priority filter; policy drop;\n\t}\n"
            "}\n"
        ),
    )
    assert container.systemctl("start", "nftables.service").returncode == 0
    host_file = "/var/lib/fabric/desired/racknerd.toml"
    container.write_file(
        host_file,
        container.read_file(host_file).replace(
            'tailnet_name = "racknerd.tail-abc123.ts.net"', 'tailnet_name = "racknerd.tail-abc123.ts.net"\nnftables_fix = true'
        ),
    )

    first = container.run(fabric, "bootstrap", "--config", "/etc/fabric/node.toml", timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    # Registered: by this bootstrap, or already by the first pass's heartbeat.
    nodes = container.run(fabric, "nodes", "--json", "--desired", "/var/lib/fabric/desired")
    assert nodes.returncode == 0 and '"racknerd"' in nodes.stdout, nodes.stdout + nodes.stderr
    assert "load_nft_fix" in first.stdout
    assert re.search(r"ready: racknerd \(tier [a-z_0-9]+\)$", first.stdout.rstrip())
    forward = container.run("nft", "list", "chain", "inet", "filter", "forward").stdout
    assert 'iifname "tailscale0" accept comment "fabric-tailscale-fix"' in forward

    second = container.run(fabric, "bootstrap", "--config", "/etc/fabric/node.toml", timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("note: tailscale is not installed") and "nothing to do: racknerd is ready" in second.stdout

    # The distro reloads its ruleset (flush ruleset): the drop-in puts the fix
    # and the fabric's own table back.
    assert container.systemctl("reload", "nftables.service").returncode == 0
    forward = container.run("nft", "list", "chain", "inet", "filter", "forward").stdout
    assert forward.count("fabric-tailscale-fix") == 2  # iifname and oifname rules, once each
    # The drop-in queues the table's reload (--no-block): wait for that job.
    wait_until(
        lambda: container.run("nft", "list", "table", "inet", "fabric").returncode == 0,
        timeout=30,
        what="the queued reload of nftables-load.service to load table inet fabric",
    )


def test_git_desired_state_is_pulled_by_the_hardened_service(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    """join.sh with --git-remote and its signers: each pass first runs `fabric
    pull` (ExecStartPre) under the same hardening, takes only signed commits
    that descend from the one it runs, and the pass then runs on the checkout."""
    container, _ = joined
    remote = "/srv/fleet.git"
    seed = "/srv/fleet-seed"
    for toml in sorted(EXAMPLE_FLEET.glob("*.toml")):
        container.write_file(f"{seed}/{toml.name}", container.read_file(f"/var/lib/fabric/desired/{toml.name}"))
    # The operator's signing key (ssh signatures) and the hosts' allowed signers.
    done = container.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "op@fleet", "-f", "/srv/signer")
    assert done.returncode == 0, done.stderr
    container.write_file("/etc/fabric/allowed_signers", f'op@fleet namespaces="git" {container.read_file("/srv/signer.pub").strip()}\n')
    ident = ["-c", "user.name=op", "-c", "user.email=op@fleet", "-c", "gpg.format=ssh", "-c", "user.signingkey=/srv/signer"]
    for argv in (
        ["git", "init", "--quiet", "--bare", "--initial-branch=main", remote],
        ["git", "-C", seed, "init", "--quiet", "--initial-branch=main"],
        ["git", "-C", seed, "add", "."],
        ["git", "-C", seed, *ident, "commit", "--quiet", "-S", "-m", "fleet"],
        ["git", "-C", seed, "push", "--quiet", remote, "main"],
    ):
        done = container.run(*argv)
        assert done.returncode == 0, f"{argv}: {done.stderr}"

    # A timer pass of the old unit is running when join.sh starts (held by a
    # runtime drop-in until the test lets it go): join.sh must let it end
    # before it changes the units, so that its own first pass runs the new
    # unit, pull included, instead of merging into the old run.
    def timer_state() -> str:
        return container.systemctl("show", "-P", "ActiveState", "fabric-reconcile.timer").stdout.strip()

    hold = "/run/fabric-test-hold"
    drop_in = "/run/systemd/system/fabric-reconcile.service.d/50-hold.conf"
    container.write_file(hold, "")
    container.write_file(drop_in, f"[Service]\nExecStartPre=/bin/sh -c 'while [ -e {hold} ]; do sleep 0.05; done'\n")
    assert container.systemctl("daemon-reload").returncode == 0
    assert container.systemctl("start", "--no-block", "fabric-reconcile.service").returncode == 0
    try:
        wait_until(
            lambda: container.systemctl("show", "-P", "ActiveState", "fabric-reconcile.service").stdout.strip() == "activating", what="the held pass"
        )
        rejoining: list[subprocess.CompletedProcess[str]] = []
        joiner = threading.Thread(
            target=lambda: rejoining.append(
                run_join(container, "--host", "racknerd", "--git-remote", remote, "--allowed-signers", "/etc/fabric/allowed_signers", timeout=600)
            )
        )
        joiner.start()
        # join.sh stops the timer, then waits for the running pass.
        wait_until(lambda: timer_state() == "inactive" or not joiner.is_alive(), timeout=120, what="join.sh to stop the timer")
        container.remove_file(hold)
        joiner.join(timeout=600)
        assert not joiner.is_alive() and rejoining, "join.sh did not finish"
    finally:
        if container.host_path(hold).exists():
            container.remove_file(hold)
        container.remove_file(drop_in)
        container.systemctl("daemon-reload")
    rejoin = rejoining[0]
    journal = container.journal("-u", "fabric-reconcile.service", "-n", "30", "-o", "cat")
    assert rejoin.returncode == 0, f"{rejoin.stdout}\n{rejoin.stderr}\n{journal}"
    service = container.read_file("/etc/systemd/system/fabric-reconcile.service")
    assert f"ExecStartPre={PREFIX}/bin/fabric pull --config /etc/fabric/node.toml" in service
    # join.sh's own first pass ran the new unit: the plain directory is now a
    # checkout of the remote (the old one kept aside), and the pull said so.
    remote_main = container.run("git", "-C", remote, "rev-parse", "main").stdout.strip()
    assert container.run("git", "-C", "/var/lib/fabric/desired", "rev-parse", "HEAD").stdout.strip() == remote_main
    assert "pull: now at" in container.journal("-u", "fabric-reconcile.service", "-o", "cat")
    assert timer_state() == "active"
    assert container.host_path("/var/lib/fabric/desired.before-git/fabric.toml").exists()

    def pull_said(text: str) -> bool:
        assert container.systemctl("start", "fabric-reconcile.service").returncode in (0, 1)
        return text in container.journal("-u", "fabric-reconcile.service", "-o", "cat")

    # An unsigned commit is refused; the host stays at the signed one.
    container.write_file(f"{seed}/NOTE", "unsigned\n")
    for argv in (
        ["git", "-C", seed, "add", "."],
        ["git", "-C", seed, *ident, "commit", "--quiet", "-m", "unsigned"],
        ["git", "-C", seed, "push", "--quiet", remote, "main"],
    ):
        assert container.run(*argv).returncode == 0, argv
    wait_until(lambda: pull_said("is not signed by an allowed signer"), timeout=120, what="the pass unit's pull to refuse the unsigned commit")
    assert container.run("git", "-C", "/var/lib/fabric/desired", "rev-parse", "HEAD").stdout.strip() == remote_main
    # A force-push back to the first (signed) commit is refused as a rewind.
    newer = ["git", "-C", seed, *ident, "commit", "--quiet", "-S", "--amend", "-m", "signed"]
    assert container.run(*newer).returncode == 0
    assert container.run("git", "-C", seed, "push", "--quiet", "--force", remote, "main").returncode == 0
    wait_until(lambda: pull_said("pull: now at"), timeout=120, what="the signed commit")
    signed = container.run("git", "-C", "/var/lib/fabric/desired", "rev-parse", "HEAD").stdout.strip()
    assert signed != remote_main
    assert container.run("git", "-C", seed, "push", "--quiet", "--force", remote, f"{remote_main}:refs/heads/main").returncode == 0
    wait_until(lambda: pull_said("(a rewind or a force-push)"), timeout=120, what="the pull to refuse the rewind")
    assert container.run("git", "-C", "/var/lib/fabric/desired", "rev-parse", "HEAD").stdout.strip() == signed


def test_leader_without_a_host_name_is_refused(joined: tuple[SystemdContainer, subprocess.CompletedProcess[str]]) -> None:
    container, _ = joined
    before = container.read_file("/etc/fabric/node.toml")
    refused = run_join(
        container,
        "--leader",
        "--no-first-pass",
        timeout=600,
    )
    assert refused.returncode == 2
    assert "node.host: required for fabric-leader.service" in refused.stderr
    assert container.read_file("/etc/fabric/node.toml") == before
    assert not container.host_path("/etc/systemd/system/fabric-leader.service").exists()
