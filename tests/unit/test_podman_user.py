"""A podman workload runs as a static system user of its own (issue 35, item 6).

Each podman agent or service unit names `User=`/`Group=` of a user made from a
sysusers.d snippet by its account unit (a root oneshot the agent Wants= and
runs After=), never `DynamicUser=`; its home is its state directory and its
runtime directory is XDG_RUNTIME_DIR; its secrets stay credentials. Real
podman runs it in tests/integration/test_agent_podman.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from reconciler.core.desired.load import load_desired
from reconciler.core.render.artifacts import account_unit, render, sysusers_line, workload_user
from tests.conftest import EXAMPLE_FLEET
from tests.support.render import facts, files, golden_plan

# systemd's strict rule for a user name (user-util.c valid_user_group_name),
# at most 31 characters so it fits utmp and shadow's tools.
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")


def rendered(host: str) -> dict[str, str]:
    return files(load_desired(EXAMPLE_FLEET), host)


def test_a_podman_agent_runs_as_its_own_static_user_made_by_its_account_unit() -> None:
    texts = rendered("x86-spill")
    agent = texts["etc/systemd/system/fabric-agent-x86-spill.service"]
    assert "User=fabric-agent-x86-spill\n" in agent and "Group=fabric-agent-x86-spill\n" in agent
    assert "DynamicUser=" not in agent
    unit_section = agent.split("[Service]")[0]
    assert "Wants=fabric-account-x86-spill.service\n" in unit_section and "After=fabric-account-x86-spill.service\n" in unit_section
    # Its home (image storage) and runtime directory, as podman reads them.
    assert "StateDirectory=fabric-agent-x86-spill\n" in agent and "Environment=HOME=/var/lib/fabric-agent-x86-spill\n" in agent
    assert "RuntimeDirectory=fabric-agent-x86-spill\n" in agent and "Environment=XDG_RUNTIME_DIR=/run/fabric-agent-x86-spill\n" in agent
    # What DynamicUser= implied stays: no IPC left behind, the same sandbox.
    for setting in ("RemoveIPC=yes", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "RestrictSUIDSGID=yes"):
        assert f"{setting}\n" in agent
    # Secrets stay credentials: a path in LoadCredential=, never a value.
    assert "LoadCredential=phaze_agent_token_file:/run/secrets/phaze/agents/x86-spill/token\n" in agent


def test_the_sysusers_snippet_and_the_account_unit_declare_that_user() -> None:
    texts = rendered("x86-spill")
    snippet = texts["etc/sysusers.d/fabric-agent-x86-spill.conf"]
    line = 'u fabric-agent-x86-spill - "fabric x86-spill" /var/lib/fabric-agent-x86-spill -'
    assert sysusers_line("x86-spill") == line
    assert [x for x in snippet.splitlines() if not x.startswith("#")] == [line]
    account = texts["etc/systemd/system/fabric-account-x86-spill.service"]
    assert 'ExecStart="/usr/bin/systemd-sysusers" "/etc/sysusers.d/fabric-agent-x86-spill.conf"\n' in account
    assert "Type=oneshot\n" in account and "RemainAfterExit=yes\n" in account and "Before=fabric-agent-x86-spill.service\n" in account
    # The unit carries the snippet's line, so a changed snippet changes the
    # unit too, and the pass restarts it (systemd-sysusers runs again).
    assert f"#   {line}\n" in account
    # Root, but confined to writing /etc.
    assert "User=" not in account and "ReadWritePaths=/etc\n" in account and "ProtectSystem=strict\n" in account


def test_snippet_and_units_have_their_modes() -> None:
    artifacts = {a.path: a for a in render(load_desired(EXAMPLE_FLEET), "x86-spill", facts("x86-spill"), golden_plan()).artifacts}
    assert artifacts["etc/sysusers.d/fabric-agent-x86-spill.conf"].mode == 0o644
    assert artifacts["etc/sysusers.d/fabric-agent-x86-spill.conf"].kind == "file"
    assert artifacts["etc/systemd/system/fabric-account-x86-spill.service"].kind == "unit"


def test_two_podman_workloads_on_one_host_get_two_users() -> None:
    texts = rendered("a1-arm64")
    users = {re.search(r"^User=(.*)$", texts[f"etc/systemd/system/fabric-agent-{w}.service"], re.M).group(1) for w in ("a1-arm64", "braid")}  # type: ignore[union-attr]
    assert users == {"fabric-agent-a1-arm64", "fabric-agent-braid"}
    assert {p for p in texts if p.startswith("etc/sysusers.d/")} == {
        "etc/sysusers.d/fabric-agent-a1-arm64.conf",
        "etc/sysusers.d/fabric-agent-braid.conf",
    }


def test_a_command_workload_keeps_its_dynamic_user_and_gets_no_account() -> None:
    texts = rendered("qfox-1")
    assert "DynamicUser=yes\n" in texts["etc/systemd/system/fabric-agent-lupine.service"]
    assert not any(p.startswith("etc/sysusers.d/") or "fabric-account-" in p for p in texts)


def test_user_names_fit_and_stay_distinct_for_long_ids() -> None:
    long_a = "a" * 40 + "-one"
    long_b = "a" * 40 + "-two"
    for workload in ("x86-spill", "braid", long_a, long_b, "x" * 63):
        assert USER_NAME.match(workload_user(workload)), workload_user(workload)
    assert workload_user("x86-spill") == "fabric-agent-x86-spill"
    assert workload_user(long_a) != workload_user(long_b)
    assert workload_user(long_a).startswith("fabric-agent-aaaa")
    assert account_unit(long_a) == f"fabric-account-{long_a}.service"


def test_the_account_template_is_package_data() -> None:
    from reconciler.core.render.artifacts import TEMPLATES_DIR

    assert (Path(TEMPLATES_DIR) / "account.service.j2").is_file()


def test_the_pass_may_write_the_snippets_directory() -> None:
    """Under the pass's ProtectSystem=strict only listed, existing directories
    are writable: the sysusers.d snippets' is one, made by both installers."""
    from reconciler.core.install.units import HARDENING, PASS_DIRECTORIES
    from reconciler.core.render.artifacts import Layout

    directory = "/" + Layout().sysusers_dir
    assert f"-{directory}" in HARDENING["ReadWritePaths"]
    assert directory in PASS_DIRECTORIES


def test_every_podman_unit_runs_with_one_id_and_unpacks_files_of_other_owners() -> None:
    """No subordinate ID range (this podman, 4.3, under NoNewPrivileges=
    cannot use one: docs/_incoming/podman-mode.md): the container's root is
    the workload's user, and podman gives image files of other owners to it
    (containers/storage's ignore_chown_errors, read from STORAGE_OPTS by the
    overlay and vfs drivers alike)."""
    units = {
        f"{host}/{path}": text
        for host in ("x86-spill", "a1-arm64")
        for path, text in rendered(host).items()
        if path.startswith("etc/systemd/system/fabric-agent-") and "User=fabric-agent-" in text
    }
    assert len(units) == 3, sorted(units)
    for name, text in units.items():
        assert "Environment=STORAGE_OPTS=.ignore_chown_errors=true\n" in text, name
        assert "NoNewPrivileges=yes\n" in text and "CapabilityBoundingSet=\n" in text and "AmbientCapabilities=\n" in text, name
        assert "--userns" not in text and "--uidmap" not in text and "--gidmap" not in text, name


def test_the_account_unit_refuses_a_subordinate_id_range_after_making_its_user() -> None:
    from reconciler.core.render.artifacts import SUBID_CHECK, SUBID_FILES, Layout, subid_check_command

    account = rendered("x86-spill")["etc/systemd/system/fabric-account-x86-spill.service"]
    starts = [line for line in account.splitlines() if line.startswith("ExecStart=")]
    # First the user (its UID is then known), then the check, with the user as $1.
    assert starts == [
        'ExecStart="/usr/bin/systemd-sysusers" "/etc/sysusers.d/fabric-agent-x86-spill.conf"',
        "ExecStart=" + subid_check_command(Layout(), "x86-spill"),
    ]
    assert starts[1].startswith('ExecStart="/bin/sh" "-c" ') and starts[1].endswith(' "fabric-account-x86-spill" "fabric-agent-x86-spill"')
    # Both files, matched as podman matches (name, UID, ALL); one line, as a
    # unit's value cannot span lines; $ doubled for systemd.
    assert SUBID_FILES == ("/etc/subuid", "/etc/subgid") and "for file in /etc/subuid /etc/subgid;" in SUBID_CHECK
    assert '"$owner" = "$1"' in SUBID_CHECK and '"$owner" = ALL' in SUBID_CHECK and '"$owner" = "$uid"' in SUBID_CHECK
    assert "\n" not in starts[1] and "$$1" in starts[1]


def test_a_podman_workload_that_leaves_takes_its_snippet_and_both_units_along() -> None:
    from reconciler.core.render.actions import host_actions

    artifacts = render(load_desired(EXAMPLE_FLEET), "a1-arm64", facts("a1-arm64"), golden_plan()).artifacts
    installed = {a.path: a.data for a in artifacts}
    tracked = {a.path: a.kind for a in artifacts}
    mine = {
        "etc/sysusers.d/fabric-agent-braid.conf",
        "etc/systemd/system/fabric-agent-braid.service",
        "etc/systemd/system/fabric-account-braid.service",
    }
    assert mine <= set(installed)
    actions = host_actions([a for a in artifacts if a.path not in mine], installed, tracked)
    assert set(actions.remove) == mine
    assert set(actions.stop) == {"fabric-agent-braid.service", "fabric-account-braid.service"}
    assert not actions.write and not actions.start
