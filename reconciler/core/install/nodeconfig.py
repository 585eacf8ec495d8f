"""The node's own configuration: /etc/fabric/node.toml.

Pure: a pydantic model and a loader over text. The desired state (fabric.toml
and the host files) is the same on every host and lives in git; this file says
how *this* machine takes part: which host of the desired state it is, where the
desired state comes from (a local directory, or a git remote pulled before each
pass), where rendered units go, how often the timer fires, a local registry
file if the fleet's [registry] is not to be used, and what the
one-shot bootstrap needs (a Tailscale auth-key file, the k3s server and token
file). Both install paths write it: the NixOS module renders
`services.fabric.settings` with `pkgs.formats.toml`, and `scripts/join.sh`
writes it from its flags. `fabric units --config` derives the units from it,
`fabric pull` and `fabric bootstrap` read it.

Secrets never appear here, only paths to files holding them (`*_file`).
"""

from __future__ import annotations

import re
import tomllib
from typing import Annotated

from pydantic import StringConstraints, ValidationError, model_validator

from reconciler.core.desired.confinement import DEFAULT_ALLOWED_PREFIXES
from reconciler.core.desired.model import AbsPath, FieldProblem, Name, Strict
from reconciler.core.desired.problems import ProblemsError, problem_from_toml_error, problems_from_validation

NODE_CONFIG_PATH = "/etc/fabric/node.toml"

# A systemd time span as the timer takes it ("30s", "2min", "1h 30s"). Kept to a
# safe character set: it lands in a unit file.
TimeSpan = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9]+(?:\.[0-9]+)?\s*(?:us|ms|s|sec|m|min|h|hr|d)?(?:\s+[0-9]+(?:\.[0-9]+)?\s*(?:us|ms|s|sec|m|min|h|hr|d)?)*$"),
]
_SPAN_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(us|ms|sec|s|min|m|hr|h|d)?")
_SPAN_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": 86400.0}


def timespan_seconds(span: str) -> float:
    """The seconds in a TimeSpan, read as systemd.time(7) does: the parts add
    up ("1h 30s"), "m" is minutes, a bare number is seconds."""
    return sum(float(number) * _SPAN_UNIT_SECONDS[unit] for number, unit in _SPAN_PART.findall(span))


# A git remote: ssh (git@host:path, ssh://...), https or a local path.
GitRemote = Annotated[
    str,
    StringConstraints(pattern=r"^(?:[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[A-Za-z0-9._/~-]+|(?:ssh|https|file)://[A-Za-z0-9._@:/~%-]+|/[A-Za-z0-9._/-]+)$"),
]
GitBranch = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,200}$")]
HttpsUrl = Annotated[str, StringConstraints(pattern=r"^https://[A-Za-z0-9.\-\[\]:]+(?:/[A-Za-z0-9._/-]*)?$")]


class NodeSection(Strict):
    # Which host of the desired state this machine is; None: its hostname.
    host: Name | None = None
    # The desired-state directory (the git checkout when [source] is set).
    desired: AbsPath = "/var/lib/fabric/desired"
    # Where `fabric reconcile --unit-dir` writes the units it renders. NixOS keeps
    # /etc/systemd/system read-only (a link into the Nix store), so the module
    # sets /run/systemd/system; a plain systemd host uses /etc/systemd/system.
    unit_dir: AbsPath = "/etc/systemd/system"
    state_dir: AbsPath = "/var/lib/fabric"
    # A sqlite registry file used whatever the fleet's [registry] says
    # ($FABRIC_REGISTRY for the fabric's services): a single-host fleet, a demo.
    # None: the registry the desired state's fabric.toml names (etcd for a fleet).
    registry_path: AbsPath | None = None
    # Where the paths the desired state hands to this host's units may lie
    # (core.desired.confinement): a commit cannot widen them, and the system
    # directories stay refused whatever is listed here.
    allowed_path_prefixes: list[AbsPath] = list(DEFAULT_ALLOWED_PREFIXES)


# One public host key as ssh-keyscan prints it, without the host: "TYPE BASE64".
SshHostKey = Annotated[
    str, StringConstraints(pattern=r"^(?:ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(?:256|384|521)|sk-ssh-ed25519@openssh\.com) [A-Za-z0-9+/]+={0,3}$")
]


def is_ssh_remote(remote: str) -> bool:
    """An ssh remote (scp-like user@host:path or ssh://): its host key must be pinned."""
    return remote.startswith("ssh://") or ("@" in remote and ":" in remote and "://" not in remote)


class SourceSection(Strict):
    """The desired state as a git remote, fetched before each pass.

    Whoever can push to the remote decides what runs as root on every host,
    so the gate is on unless node.toml turns it off in so many words: a
    fetched commit must be signed by an allowed signer
    (`require_signed_commits`, true unless set to false), it must descend
    from the commit the host runs (a force-push back to an older commit is
    refused until an operator runs `fabric pull --accept-rewind`), and an ssh
    remote's host key is the one pinned here (`ssh_host_key`), never the
    first one offered."""

    remote: GitRemote
    branch: GitBranch = "main"
    # Deploy key for an ssh remote (read by ssh, never copied). Keep it where
    # the pass unit can read it under its hardening (ProtectHome hides /root):
    # /etc/fabric/deploy-key, 0600 root.
    ssh_key_file: AbsPath | None = None
    # The ssh remote's host key ("ssh-ed25519 AAAA...", as `ssh-keyscan HOST`
    # prints it after the host name): required for an ssh remote.
    ssh_host_key: SshHostKey | None = None
    # Accept a fetched commit only if `git verify-commit` accepts its signature
    # against the allowed signers file (ssh signatures, gpg.format=ssh).
    require_signed_commits: bool = True
    allowed_signers_file: AbsPath | None = None

    @model_validator(mode="after")
    def _signers(self) -> SourceSection:
        if self.require_signed_commits and self.allowed_signers_file is None:
            raise FieldProblem(
                "allowed_signers_file",
                "required: commits must be signed (require_signed_commits is true unless node.toml sets it to false, which lets "
                "anyone who can push run anything as root on this host)",
            )
        if is_ssh_remote(self.remote) and self.ssh_host_key is None:
            raise FieldProblem("ssh_host_key", "required for an ssh remote: its host key as `ssh-keyscan HOST` prints it (TYPE BASE64), pinned")
        return self


class TimerSection(Strict):
    interval: TimeSpan = "30s"
    randomized_delay: TimeSpan = "5s"


class BootstrapSection(Strict):
    """What `fabric bootstrap` needs to join a new node."""

    # Tailscale auth key, read by tailscale itself (`--auth-key=file:PATH`).
    tailscale_auth_key_file: AbsPath | None = None
    k3s_server: HttpsUrl | None = None
    # k3s reads the join token from this file (`token-file:`).
    k3s_token_file: AbsPath | None = None
    # k3s merges every *.yaml here into its configuration (k3s >= 1.21).
    k3s_config_dir: AbsPath = "/etc/rancher/k3s/config.yaml.d"

    @model_validator(mode="after")
    def _k3s_pair(self) -> BootstrapSection:
        if (self.k3s_server is None) != (self.k3s_token_file is None):
            missing = "k3s_token_file" if self.k3s_token_file is None else "k3s_server"
            raise FieldProblem(missing, "k3s_server and k3s_token_file go together")
        return self


class NodeConfig(Strict):
    node: NodeSection = NodeSection()
    source: SourceSection | None = None
    timer: TimerSection = TimerSection()
    bootstrap: BootstrapSection = BootstrapSection()

    @model_validator(mode="after")
    def _checkout_is_writable(self) -> NodeConfig:
        # The pass runs with ProtectSystem=strict: of the places a checkout
        # could go, only the state directory is writable (and the first clone
        # is renamed into place there).
        if self.source is not None and not self.node.desired.startswith(self.node.state_dir.rstrip("/") + "/"):
            raise FieldProblem(
                "node.desired",
                f"with [source] the checkout must be inside node.state_dir ({self.node.state_dir}), the only directory a pass may write",
            )
        return self


class NodeConfigError(ProblemsError):
    """node.toml is invalid; `problems` lists every reason."""


def parse_node_config(text: str, file: str = NODE_CONFIG_PATH) -> NodeConfig:
    """NodeConfig from TOML text; NodeConfigError lists every problem as file: key: reason."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError([problem_from_toml_error(file, exc)]) from exc
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as exc:
        raise NodeConfigError(problems_from_validation(file, exc, NodeConfig)) from exc
