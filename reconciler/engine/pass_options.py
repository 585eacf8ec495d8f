"""A pass's typed options and where its fleet plan comes from, standard library only.

`fabric reconcile` builds these before it knows whether the pass memo
(reconciler.engine.memoized_pass) lets it stop early, so this module must
import no model, template or other engine module; reconciler.engine.reconcile
and reconciler.engine.plan_source re-export what they use of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# reconciler.engine.apply.STATE_DIR and reconciler.core.render.artifacts.Layout().unit_dir,
# spelled here to stay light (tests/unit/test_pass_memo.py checks they agree).
STATE_DIR = "var/lib/fabric"
UNIT_DIR = "etc/systemd/system"

# Where a leader candidate keeps its private plan signing key unless told
# otherwise (--plan-key-file, $FABRIC_PLAN_KEY_FILE): root's, mode 0600.
DEFAULT_PLAN_KEY_FILE = Path("/etc/fabric/plan-signing.key")

# The operator's main Caddyfile, relative to the root: Debian's package, then
# NixOS's services.caddy (reconciler.engine.reconcile.CADDY_MAIN_CANDIDATES).
CADDY_MAIN_CANDIDATES = ("etc/caddy/Caddyfile", "etc/caddy/caddy_config")


@dataclass(frozen=True)
class PlanFile:
    """--plan-file: render from this saved FleetPlan; the registry is not touched."""

    path: Path


@dataclass(frozen=True)
class PlanAlone:
    """--no-registry: the scheduler over this host alone."""


@dataclass(frozen=True)
class PlanFromRegistry:
    """The registry (the normal case). `sqlite_path` is --registry-path: the
    wiring's registry connector opens that sqlite file whatever [registry]
    says; the pass itself only ever sees the connector."""

    sqlite_path: Path | None = None


PlanSource = PlanFile | PlanAlone | PlanFromRegistry


@dataclass(frozen=True)
class PassOptions:
    """A pass's options, parsed and typed (`fabric reconcile` and `fabric plan`).

    The pass reads the desired state, host, replay, plan, state and unit
    directories and the main Caddyfile; the wiring reads the rest (where
    the root is, whether to check and activate, how to reach systemd and
    Caddy, the registry's sqlite path)."""

    desired: Path
    host: str
    root: Path = Path("/")
    state_dir: str = STATE_DIR
    unit_dir: str = UNIT_DIR
    # A saved probe capture (fabric probe --capture) instead of probing.
    replay: str | None = None
    plan: PlanSource = PlanFromRegistry()
    no_activate: bool = False
    # With no_activate: still run systemd-analyze, nft -c and caddy validate.
    validate: bool = False
    # The edge's main Caddyfile, relative to the root; None: the first of CADDY_MAIN_CANDIDATES that exists.
    caddy_main: str | None = None
    systemd_bus: str | None = None
    caddy_admin: str = "localhost:2019"
    startup_grace: float = 1.0
    # A leader candidate's private plan key (read only when its pass leads;
    # the wiring builds the signer from it). Never in the desired state.
    plan_key_file: Path = DEFAULT_PLAN_KEY_FILE
    # The fabric's nftables table differs from what the last pass left (the
    # pass memo saw it: flushed, edited): load it again even though it exists.
    nft_reload: bool = False
    # --member-of GROUP / --address IP: a machine without a host file joins
    # this worker group as an ephemeral member (reconciler.engine.member).
    member_of: str | None = None
    member_address: str | None = None
