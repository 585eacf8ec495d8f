"""What `fabric bootstrap` observes and does on the node (the thin side of
reconciler.core.install.bootstrap): commands through a CommandRunner, files under a root,
the registry through its Protocol."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from reconciler.adapters.install_files import read_text_or_none, write_atomic
from reconciler.core.install.bootstrap import (
    DISTRO_TABLE,
    NFT_FIX_COMMENT,
    NFT_FIX_FILE,
    RECONCILE_SERVICE,
    RECONCILE_TIMER,
    Observed,
    Step,
)
from reconciler.ports import BootstrapError, CommandRunner, Registry, RegistryError


class NodeIO:
    def __init__(self, runner: CommandRunner, registry: Registry, root: Path = Path("/")) -> None:
        self._run = runner
        self._registry = registry
        self._root = root

    # -- observing ---------------------------------------------------------

    def _tailscale_running(self) -> bool | None:
        result = self._run.run(["tailscale", "status", "--json"], timeout=15)
        if result.missing:
            return None
        try:
            return json.loads(result.stdout).get("BackendState") == "Running"
        except (json.JSONDecodeError, AttributeError):
            return False

    def _registered(self, host: str) -> bool:
        try:
            return any(s.node_id == host and s.status != "dead" for s in self._registry.node_states())
        except RegistryError:
            # Unreachable now: plan the registration; the step reports the failure.
            return False

    def _active(self, unit: str) -> bool:
        return self._run.run(["systemctl", "is-active", "--quiet", unit], timeout=15).ok

    def observe(self, host: str, files: Iterable[str], socat_units: Iterable[str]) -> Observed:
        family, table = DISTRO_TABLE
        table_listing = self._run.run(["nft", "list", "table", family, table], timeout=15)
        return Observed(
            tailscale_running=self._tailscale_running(),
            registered=self._registered(host),
            files={path: read_text_or_none(self._root / path) for path in files},
            distro_table_present=table_listing.ok,
            nft_fix_loaded=table_listing.ok and NFT_FIX_COMMENT in table_listing.stdout,
            timer_active=self._active(RECONCILE_TIMER),
            socat_active={unit: self._active(unit) for unit in socat_units},
        )

    # -- acting ------------------------------------------------------------

    def _command(self, argv: list[str] | tuple[str, ...], what: str, timeout: float = 60.0) -> None:
        result = self._run.run(list(argv), timeout=timeout)
        problem = result.failure()
        if problem:
            raise BootstrapError(f"{what}: {problem}")

    def execute(self, step: Step) -> None:
        if step.kind == "tailscale_up":
            self._command(step.argv, "tailscale up", timeout=120)
        elif step.kind == "register":
            assert step.record is not None
            try:
                self._registry.heartbeat(step.record)
            except RegistryError as exc:
                raise BootstrapError(f"register: {exc}") from exc
        elif step.kind == "write_file":
            assert step.path is not None and step.content is not None
            write_atomic(self._root / step.path, step.content, step.mode)
        elif step.kind == "load_nft_fix":
            self._command(["nft", "-f", str(self._root / NFT_FIX_FILE)], "load the nftables fix")
        elif step.kind == "daemon_reload":
            self._command(["systemctl", "daemon-reload"], "daemon-reload")
        elif step.kind == "enable_timer":
            self._command(["systemctl", "enable", "--now", RECONCILE_TIMER], f"enable {RECONCILE_TIMER}")
        elif step.kind == "run_pass":
            # A oneshot: returns when the pass has ended.
            self._command(["systemctl", "start", RECONCILE_SERVICE], "first reconcile pass", timeout=900)
        else:  # pragma: no cover - the planner makes no other kind
            raise BootstrapError(f"unknown step {step.kind}")
