"""plan: compare_units (NixOS switch-to-configuration style) and host_actions."""

from __future__ import annotations

import pytest

from reconciler.core.render.actions import HostActions, UnitChange, compare_units, configured_unit, host_actions, is_dropin, parse_unit
from reconciler.core.render.artifacts import Artifact

BASE = """\
# a comment
[Unit]
Description=fabric port map x
After=network-online.target

[Service]
ExecStart="/usr/bin/socat" "TCP-LISTEN:2222,fork" "TCP4:100.1.2.3:22"
Restart=always

[Install]
WantedBy=multi-user.target
"""


def changed(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


def test_parse_unit_joins_continuations_and_drops_comments() -> None:
    parsed = parse_unit("[Service]\n# c\n; c\nExecStart=/bin/a \\\n  b\nEnvironment=A=1\nEnvironment=B=2\n")
    assert parsed == {"Service": {"ExecStart": ("/bin/a b",), "Environment": ("A=1", "B=2")}}


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        (BASE, UnitChange.NONE),
        (BASE.replace("# a comment\n", "# another comment\n\n"), UnitChange.NONE),
        (changed("Description=fabric port map x", "Description=renamed"), UnitChange.METADATA),
        (changed("WantedBy=multi-user.target", "WantedBy=default.target"), UnitChange.METADATA),
        (changed("After=network-online.target", "After=network.target"), UnitChange.RESTART),
        (changed('"TCP4:100.1.2.3:22"', '"TCP4:100.1.2.3:2022"'), UnitChange.RESTART),
        (changed("Restart=always", "Restart=on-failure"), UnitChange.RESTART),
        (changed("Restart=always\n", "Restart=always\nEnvironment=A=1\n"), UnitChange.RESTART),
        (changed("[Unit]\n", "[Unit]\nX-Fabric-Note=hello\n"), UnitChange.METADATA),
        (changed("[Unit]\n", "[Unit]\nX-Restart-Triggers=abc\n"), UnitChange.RESTART),
    ],
)
def test_compare_units(new: str, expected: UnitChange) -> None:
    assert compare_units(BASE, new) == expected


def test_reload_triggers_reload_a_unit_that_can_reload() -> None:
    old = "[Unit]\nX-Reload-Triggers=a\n[Service]\nExecStart=/bin/x\nExecReload=/bin/kill -HUP $MAINPID\n"
    assert compare_units(old, old.replace("Triggers=a", "Triggers=b")) == UnitChange.RELOAD
    # Without ExecReload= a reload cannot apply anything: restart.
    no_reload = "[Unit]\nX-Reload-Triggers=a\n[Service]\nExecStart=/bin/x\n"
    assert compare_units(no_reload, no_reload.replace("Triggers=a", "Triggers=b")) == UnitChange.RESTART


def test_reload_if_changed_reloads_instead_of_restarting() -> None:
    old = "[Service]\nExecStart=/bin/x --a\nExecReload=/bin/x --reload\nX-ReloadIfChanged=true\n"
    assert compare_units(old, old.replace("--a", "--b")) == UnitChange.RELOAD
    assert compare_units(old, old.replace("X-ReloadIfChanged=true", "X-ReloadIfChanged=false").replace("--a", "--b")) == UnitChange.RESTART


def art(path: str, content: str, kind: str = "unit") -> Artifact:
    return Artifact(path, content, 0o644, kind)  # type: ignore[arg-type]


U = "etc/systemd/system/"


def test_make_plan_start_restart_stop_and_untracked_files() -> None:
    desired = [
        art(U + "fabric-a.service", BASE),
        art(U + "fabric-b.service", changed("Restart=always", "Restart=no")),
        art(U + "fabric-new.service", BASE),
        art("etc/fabric/fabric.nft", "table inet fabric {}\n", "nft"),
    ]
    installed = {
        U + "fabric-a.service": BASE.encode(),
        U + "fabric-b.service": BASE.encode(),
        U + "fabric-gone.service": BASE.encode(),
        U + "fabric-foreign.service": BASE.encode(),  # on disk, not in any manifest
        "etc/fabric/fabric.nft": b"table inet fabric {}\n",
    }
    tracked = {U + "fabric-a.service": "unit", U + "fabric-b.service": "unit", U + "fabric-gone.service": "unit", "etc/fabric/fabric.nft": "nft"}
    plan = host_actions(desired, installed, tracked)
    assert plan.write == (U + "fabric-b.service", U + "fabric-new.service")
    assert plan.remove == (U + "fabric-gone.service",)
    assert plan.stop == ("fabric-gone.service",)
    assert plan.restart == ("fabric-b.service",)
    assert plan.start == ("fabric-new.service",)
    assert plan.daemon_reload and not plan.nft_load and not plan.caddy_reload
    assert plan.reasons["fabric-gone.service"] == "left the plan"


def test_running_view_decides_activation_and_states_start_stopped_units() -> None:
    desired = [art(U + "fabric-a.service", BASE), art(U + "fabric-b.service", BASE)]
    installed = {a.path: a.data for a in desired}
    tracked = {a.path: "unit" for a in desired}
    # Files installed by a killed pass, last activated with older content.
    running = {U + "fabric-a.service": changed("Restart=always", "Restart=no").encode()}
    plan = host_actions(desired, installed, tracked, running=running, unit_states={"fabric-a.service": "active"})
    assert plan.write == () and plan.daemon_reload
    assert plan.restart == ("fabric-a.service",) and plan.start == ("fabric-b.service",)
    # Same files, both running: nothing. One failed: started again.
    assert host_actions(desired, installed, tracked, unit_states={"fabric-a.service": "active", "fabric-b.service": "active"}).empty
    again = host_actions(desired, installed, tracked, unit_states={"fabric-a.service": "failed", "fabric-b.service": "active"})
    assert again.start == ("fabric-a.service",) and again.reasons["fabric-a.service"] == "not running (failed)"
    assert not again.daemon_reload


def test_caddy_snippet_leaving_the_plan_reloads_caddy() -> None:
    tracked = {"etc/caddy/fabric.caddy": "caddy"}
    installed = {"etc/caddy/fabric.caddy": b"a.example {\n}\n"}
    plan = host_actions([], installed, tracked)
    assert plan.remove == ("etc/caddy/fabric.caddy",) and plan.caddy_reload


def test_plan_text_tenses() -> None:
    plan = HostActions(write=("etc/x",), daemon_reload=True, restart=("fabric-x.service",), caddy_reload=True)
    assert plan.text() == (
        "would write the following files:\n  etc/x\n"
        "would reload the systemd manager configuration (daemon-reload)\n"
        "would restart the following units:\n  fabric-x.service\n"
        "would reload caddy\n"
    )
    assert plan.text(files_done=True, activation_done=True).startswith("wrote the following files:")
    assert "restarted the following units" in plan.text(files_done=True, activation_done=True)
    assert HostActions().text() == "nothing to do\n"


BACKENDS = "etc/phaze/backends.toml"
PHAZE = ("phaze-api.service", "phaze-worker.service")


def backends(text: str) -> Artifact:
    return Artifact(BACKENDS, text, 0o644, "file", restarts=PHAZE)


def test_a_changed_file_restarts_the_units_that_read_it_at_startup() -> None:
    # phaze's control plane is not rendered by the fabric; a change of the
    # file it reads at startup restarts it, as a changed unit file would.
    old, new = '[[backends]]\nid = "a"\ncap = 1\n', '[[backends]]\nid = "a"\ncap = 2\n'
    tracked = {BACKENDS: "file"}
    plan = host_actions([backends(new)], {BACKENDS: old.encode()}, tracked)
    assert plan.write == (BACKENDS,) and plan.restart == PHAZE
    assert plan.reasons["phaze-api.service"] == f"{BACKENDS} changed"
    assert not plan.daemon_reload and plan.start == ()
    assert plan.text() == (
        f"would write the following files:\n  {BACKENDS}\nwould restart the following units:\n  phaze-api.service\n  phaze-worker.service\n"
    )
    # Unchanged: nothing. Written for the first time: restarted too (they
    # started without it).
    assert host_actions([backends(new)], {BACKENDS: new.encode()}, tracked).empty
    assert host_actions([backends(new)], {}, {}).restart == PHAZE
    # Written but not activated by a killed pass: what ran decides.
    assert host_actions([backends(new)], {BACKENDS: new.encode()}, tracked, running={BACKENDS: old.encode()}).restart == PHAZE
    # A unit known not to run reads the file when it starts: left alone.
    states = {"phaze-api.service": "active", "phaze-worker.service": "inactive"}
    assert host_actions([backends(new)], {BACKENDS: old.encode()}, tracked, dependent_states=states).restart == ("phaze-api.service",)


def test_a_removed_file_restarts_the_units_its_generation_named() -> None:
    tracked = {BACKENDS: "file"}
    plan = host_actions([], {BACKENDS: b"[[backends]]\n"}, tracked, tracked_restarts={BACKENDS: PHAZE})
    assert plan.remove == (BACKENDS,) and plan.restart == PHAZE
    assert plan.reasons["phaze-worker.service"] == f"{BACKENDS} removed"


# --------------------------------------------------------------------------
# daemon-reload only when systemd holds a unit whose file changed

NEW = U + "fabric-new.service"
KEPT = U + "fabric-kept.service"
GONE = U + "fabric-gone.service"


def reload_planned(
    desired: list[Artifact],
    installed: dict[str, bytes],
    tracked: dict[str, str],
    units_held: dict[str, bool] | None,
    *,
    running: dict[str, bytes] | None = None,
) -> HostActions:
    return host_actions(desired, installed, tracked, running=running, units_held=units_held)


def test_a_new_unit_systemd_does_not_hold_is_started_without_daemon_reload() -> None:
    plan = reload_planned([art(NEW, BASE)], {}, {}, {"fabric-new.service": False})
    assert plan.write == (NEW,) and plan.start == ("fabric-new.service",)
    assert not plan.daemon_reload
    assert "daemon-reload" not in plan.text()
    # ...and one it holds (loaded from a file, say failed and kept, or a stub of an older systemd) is reloaded first.
    assert reload_planned([art(NEW, BASE)], {}, {}, {"fabric-new.service": True}).daemon_reload


def test_a_changed_unit_systemd_holds_is_reloaded_before_its_restart() -> None:
    new = changed("Restart=always", "Restart=no")
    plan = reload_planned([art(KEPT, new)], {KEPT: BASE.encode()}, {KEPT: "unit"}, {"fabric-kept.service": True})
    assert plan.restart == ("fabric-kept.service",) and plan.daemon_reload
    assert "would reload the systemd manager configuration (daemon-reload)\n" in plan.text()
    # Only described differently: no restart, but systemd must still re-read it.
    described = reload_planned(
        [art(KEPT, changed("Description=fabric port map x", "Description=y"))], {KEPT: BASE.encode()}, {KEPT: "unit"}, {"fabric-kept.service": True}
    )
    assert described.restart == () and described.daemon_reload
    # Not held (garbage-collected while inactive): its start reads the new file.
    assert not reload_planned([art(KEPT, new)], {KEPT: BASE.encode()}, {KEPT: "unit"}, {"fabric-kept.service": False}).daemon_reload


def test_an_unchanged_unit_held_by_systemd_needs_no_reload_when_another_is_new() -> None:
    desired = [art(KEPT, BASE), art(NEW, BASE)]
    plan = reload_planned(desired, {KEPT: BASE.encode()}, {KEPT: "unit"}, {"fabric-kept.service": True, "fabric-new.service": False})
    assert plan.start == ("fabric-new.service",) and not plan.daemon_reload


def test_a_unit_leaving_the_plan_is_stopped_without_daemon_reload() -> None:
    installed = {KEPT: BASE.encode(), GONE: BASE.encode()}
    tracked = {KEPT: "unit", GONE: "unit"}
    plan = reload_planned([art(KEPT, BASE)], installed, tracked, {"fabric-kept.service": True})
    assert plan.remove == (GONE,) and plan.stop == ("fabric-gone.service",)
    assert not plan.daemon_reload
    assert plan.text() == f"would remove the following files:\n  {GONE}\nwould stop the following units:\n  fabric-gone.service\n"


def test_without_systemds_answer_every_unit_change_reloads_as_before() -> None:
    new = changed("Restart=always", "Restart=no")
    # Not asked (no activators, `fabric plan` without D-Bus): a new unit, a changed one, a removal.
    assert reload_planned([art(NEW, BASE)], {}, {}, None).daemon_reload
    assert reload_planned([art(KEPT, new)], {KEPT: BASE.encode()}, {KEPT: "unit"}, None).daemon_reload
    assert reload_planned([], {GONE: BASE.encode()}, {GONE: "unit"}, None).daemon_reload
    # Asked, but with no answer about a unit whose file changes: as if not asked.
    assert reload_planned([art(NEW, BASE), art(KEPT, BASE)], {KEPT: BASE.encode()}, {KEPT: "unit"}, {"fabric-kept.service": False}).daemon_reload
    # Nothing about units changes: no reload whatever systemd says.
    assert not reload_planned([art(KEPT, BASE)], {KEPT: BASE.encode()}, {KEPT: "unit"}, None).daemon_reload


def test_a_killed_pass_that_wrote_a_unit_is_reloaded_only_if_systemd_holds_it() -> None:
    # The file on disk is the desired one; what ran (the good generation) differs.
    new = changed("Restart=always", "Restart=no")
    installed, tracked, running = {KEPT: new.encode()}, {KEPT: "unit"}, {KEPT: BASE.encode()}
    held = reload_planned([art(KEPT, new)], installed, tracked, {"fabric-kept.service": True}, running=running)
    assert held.write == () and held.restart == ("fabric-kept.service",) and held.daemon_reload
    assert not reload_planned([art(KEPT, new)], installed, tracked, {"fabric-kept.service": False}, running=running).daemon_reload


DROPIN = U + "fabric-kept.service.d/50-limits.conf"
FOREIGN_DROPIN = U + "k3s.service.d/50-fabric.conf"
LIMITS = "[Service]\nMemoryMax=1G\n"


def test_a_drop_in_belongs_to_its_unit() -> None:
    assert configured_unit(DROPIN) == "fabric-kept.service" and is_dropin(DROPIN)
    assert configured_unit(KEPT) == "fabric-kept.service" and not is_dropin(KEPT)
    assert configured_unit(U + "fabric-x.service.d/notes.txt") == "notes.txt"


def test_a_drop_in_of_a_held_unit_reloads_and_of_a_unit_not_held_does_not() -> None:
    desired = [art(KEPT, BASE), art(DROPIN, LIMITS)]
    installed, tracked = {KEPT: BASE.encode()}, {KEPT: "unit"}
    assert reload_planned(desired, installed, tracked, {"fabric-kept.service": True}).daemon_reload
    assert not reload_planned(desired, installed, tracked, {"fabric-kept.service": False}).daemon_reload
    # The drop-in's own name is not a unit systemd is asked about.
    assert reload_planned(desired, installed, tracked, {"50-limits.conf": False}).daemon_reload


def test_a_removed_drop_in_of_a_unit_that_stays_reloads_if_held() -> None:
    installed = {KEPT: BASE.encode(), DROPIN: LIMITS.encode(), FOREIGN_DROPIN: LIMITS.encode()}
    tracked = {KEPT: "unit", DROPIN: "unit", FOREIGN_DROPIN: "unit"}
    held = {"fabric-kept.service": True, "k3s.service": False}
    plan = reload_planned([art(KEPT, BASE), art(FOREIGN_DROPIN, LIMITS)], installed, tracked, held)
    assert plan.remove == (DROPIN,) and plan.daemon_reload
    # A unit systemd does not hold (and a unit the fabric does not render) reads its drop-ins at its start.
    plan = reload_planned([art(KEPT, BASE)], installed, tracked, {"fabric-kept.service": False, "k3s.service": False})
    assert plan.remove == (DROPIN, FOREIGN_DROPIN) and not plan.daemon_reload
    assert reload_planned(
        [art(KEPT, BASE), art(DROPIN, LIMITS)], installed, tracked, {"fabric-kept.service": False, "k3s.service": True}
    ).daemon_reload


def test_a_drop_in_leaving_with_its_unit_needs_no_reload() -> None:
    installed = {GONE: BASE.encode(), U + "fabric-gone.service.d/x.conf": LIMITS.encode()}
    tracked = {GONE: "unit", U + "fabric-gone.service.d/x.conf": "unit"}
    plan = reload_planned([], installed, tracked, {"fabric-gone.service": True})
    assert "fabric-gone.service" in plan.stop and not plan.daemon_reload
