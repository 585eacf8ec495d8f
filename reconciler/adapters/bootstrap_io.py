"""What `fabric bootstrap` observes and does on the node (the thin side of
reconciler.core.install.bootstrap): commands through a CommandRunner, files under a root,
the registry through its Protocol."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

from reconciler.adapters.install_files import read_text_or_none, write_atomic
from reconciler.core.install.bootstrap import (
    DISTRO_TABLE,
    K3S_AGENT_UNIT,
    K3S_SERVER_UNIT,
    NFT_FIX_COMMENT,
    NFT_FIX_FILE,
    RECONCILE_SERVICE,
    RECONCILE_TIMER,
    Observed,
    Step,
)
from reconciler.ports import BootstrapError, CommandRunner, NodeLabels, NodeLabelsUnavailable, Registry, RegistryError

# A k3s agent registers its Node and posts Ready within a minute on a small
# machine; a join that takes longer than this is reported, not waited for.
K3S_READY_TIMEOUT_S = 300.0
K3S_READY_POLL_S = 2.0


class NodeIO:
    def __init__(
        self,
        runner: CommandRunner,
        registry: Registry,
        root: Path = Path("/"),
        node_api: NodeLabels | None = None,
        ready_timeout_s: float = K3S_READY_TIMEOUT_S,
    ) -> None:
        self._run = runner
        self._registry = registry
        self._root = root
        self._node_api = node_api
        self._ready_timeout_s = ready_timeout_s

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

    def _node_ready(self, node: str | None) -> bool | None:
        if self._node_api is None or node is None:
            return None
        try:
            return self._node_api.ready(node)
        except NodeLabelsUnavailable:
            return None

    def observe(self, host: str, files: Iterable[str], socat_units: Iterable[str], k3s_node: str | None = None) -> Observed:
        family, table = DISTRO_TABLE
        table_listing = self._run.run(["nft", "list", "table", family, table], timeout=15)
        agent_active = self._active(K3S_AGENT_UNIT)
        return Observed(
            k3s_server=self._active(K3S_SERVER_UNIT) or self._run.run(["systemctl", "is-enabled", "--quiet", K3S_SERVER_UNIT], timeout=15).ok,
            k3s_agent_installed=self._run.run(["systemctl", "cat", K3S_AGENT_UNIT], timeout=15).ok,
            k3s_agent_active=agent_active,
            k3s_node_ready=self._node_ready(k3s_node) if agent_active else False,
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
        elif step.kind == "restart_k3s_agent":
            # k3s-agent is Type=notify: restart returns once the agent is up.
            self._command(["systemctl", "restart", K3S_AGENT_UNIT], f"restart {K3S_AGENT_UNIT}", timeout=180)
        elif step.kind == "wait_k3s_node":
            assert step.node is not None
            self._wait_ready(step.node)
        elif step.kind == "load_nft_fix":
            self._command(["nft", "-f", str(self._root / NFT_FIX_FILE)], "load the nftables fix")
        elif step.kind == "daemon_reload":
            self._command(["systemctl", "daemon-reload"], "daemon-reload")
        elif step.kind == "enable_timer":
            self._command(["systemctl", "enable", "--now", RECONCILE_TIMER], f"enable {RECONCILE_TIMER}")
        elif step.kind == "run_pass":
            # A oneshot: returns when the pass has ended.
            self._command(["systemctl", "start", RECONCILE_SERVICE], "first reconcile pass", timeout=900)
        elif step.kind == "queue_pass":
            # From fabric-bootstrap.service, ordered before the pass: the
            # pass's job waits for the bootstrap to end, so it is not waited for.
            self._command(["systemctl", "start", "--no-block", RECONCILE_SERVICE], "queue the first reconcile pass")
        elif step.kind == "write_stamp":
            assert step.path is not None and step.content is not None
            write_atomic(self._root / step.path, step.content, step.mode)
        else:  # pragma: no cover - the planner makes no other kind
            raise BootstrapError(f"unknown step {step.kind}")

    def _wait_ready(self, node: str) -> None:
        """Until the Node is Ready, asked as its kubelet; a timeout names the last answer."""
        if self._node_api is None:
            raise BootstrapError(f"wait for the k3s Node {node}: no kubelet kubeconfig to ask the API with (k3s-agent did not start?)")
        deadline = time.monotonic() + self._ready_timeout_s
        last = "not asked yet"
        while True:
            try:
                if self._node_api.ready(node):
                    return
                last = "its Ready condition is not True"
            except NodeLabelsUnavailable as exc:
                last = str(exc)
            if time.monotonic() >= deadline:
                raise BootstrapError(f"the k3s Node {node} is not Ready after {self._ready_timeout_s:.0f} s: {last} (journalctl -u {K3S_AGENT_UNIT})")
            time.sleep(K3S_READY_POLL_S)
