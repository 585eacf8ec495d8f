"""How `fabric pull` reaches an ssh remote: with node.toml's pinned host key only."""

from __future__ import annotations

from pathlib import Path

from reconciler.adapters.git_source import HOST_KEY_ALIAS, GitSource
from reconciler.core.command_result import CommandResult
from reconciler.core.install.nodeconfig import SourceSection

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


class Recorded:
    def __init__(self) -> None:
        self.argv: list[list[str]] = []

    def run(self, argv: list[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        self.argv.append(list(argv))
        return CommandResult(argv=tuple(argv), returncode=1, stderr="unreachable")


def source(**fields: object) -> SourceSection:
    return SourceSection.model_validate(
        {"remote": "git@git.example:fleet.git", "ssh_host_key": KEY, "allowed_signers_file": "/etc/fabric/allowed_signers", **fields}
    )


def test_ssh_trusts_only_the_pinned_host_key(tmp_path: Path) -> None:
    runner = Recorded()
    known = tmp_path / "state" / "known_hosts"
    git = GitSource(runner, source(ssh_key_file="/etc/fabric/deploy-key"), checkout=tmp_path / "desired", known_hosts=known)
    outcome = git.update()
    assert outcome.commit is None and outcome.problem is not None
    assert known.read_text() == f"{HOST_KEY_ALIAS} {KEY}\n"
    ssh = git.ssh_command()
    assert "StrictHostKeyChecking=yes" in ssh and not any("accept-new" in arg for arg in ssh)
    assert f"UserKnownHostsFile={known}" in ssh and f"HostKeyAlias={HOST_KEY_ALIAS}" in ssh and "GlobalKnownHostsFile=/dev/null" in ssh
    assert ssh[-2:] == ["-i", "/etc/fabric/deploy-key"]
    (clone,) = runner.argv
    assert f"core.sshCommand={' '.join(ssh)}" in clone


def test_a_changed_pin_replaces_the_known_host(tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(f"{HOST_KEY_ALIAS} ssh-ed25519 AAAAold\nattacker ssh-rsa AAAAx\n")
    GitSource(Recorded(), source(), checkout=tmp_path / "desired", known_hosts=known).update()
    assert known.read_text() == f"{HOST_KEY_ALIAS} {KEY}\n"
