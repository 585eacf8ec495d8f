"""The desired state as a git checkout, brought up to date before each pass.

`update()` fetches the branch, and moves the checkout to the fetched commit only
if it is acceptable: signed by an allowed signer (unless node.toml turned that
off), and a descendant of the commit the checkout is at (fast-forward only: a
force-push back to an older commit, one that still lists a retired key, say,
is refused until an operator takes it with `update(accept_rewind=True)`, the
`fabric pull --accept-rewind` command). When the remote cannot be reached or
the new commit is refused, the checkout stays at the last good commit: the
host keeps running what it runs (fail static) and the outcome says why.

An ssh remote is reached with its host key pinned from node.toml
(`ssh_host_key`, written into a known-hosts file of the state directory under
a fixed alias): no key is trusted on first use.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from reconciler.adapters.install_files import replace_file
from reconciler.core.install.nodeconfig import SourceSection
from reconciler.ports import CommandRunner

GIT_TIMEOUT = 120.0
# The name the pinned host key is stored under (ssh's HostKeyAlias): the key
# is the remote's whatever name or port the remote URL uses.
HOST_KEY_ALIAS = "fabric-desired-state-remote"


@dataclass(frozen=True)
class PullOutcome:
    commit: str | None  # the commit the checkout is at afterwards (None: no checkout)
    changed: bool
    problem: str | None = None  # why the newest commit was not taken


class GitSource:
    def __init__(self, runner: CommandRunner, source: SourceSection, checkout: Path, known_hosts: Path) -> None:
        self._run = runner
        self._source = source
        self._checkout = checkout
        self._known_hosts = known_hosts

    def ssh_command(self) -> list[str]:
        """How git runs ssh: the pinned host key only, never a key offered first."""
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={self._known_hosts}"]
        ssh += ["-o", f"HostKeyAlias={HOST_KEY_ALIAS}", "-o", "GlobalKnownHostsFile=/dev/null"]
        if self._source.ssh_key_file:
            ssh += ["-o", "IdentitiesOnly=yes", "-i", self._source.ssh_key_file]
        return ssh

    def _pin_host_key(self) -> None:
        """The known-hosts file holds exactly node.toml's host key (rewritten when it differs)."""
        if self._source.ssh_host_key is None:
            return
        line = f"{HOST_KEY_ALIAS} {self._source.ssh_host_key}\n"
        try:
            if self._known_hosts.read_text() == line:
                return
        except OSError:
            pass
        self._known_hosts.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self._known_hosts, line.encode(), 0o644)

    def _git(self, *args: str, cwd: Path | None = None) -> tuple[bool, str]:
        argv = ["git", "-c", f"core.sshCommand={' '.join(self.ssh_command())}", "-c", "advice.detachedHead=false"]
        if cwd is not None:
            argv += ["-C", str(cwd)]
        result = self._run.run([*argv, *args], timeout=GIT_TIMEOUT)
        if result.ok:
            return True, result.stdout.strip()
        return False, result.failure() or "git failed"

    def head(self) -> str | None:
        """The commit the checkout is at (None: no checkout yet)."""
        if not (self._checkout / ".git").exists():
            return None
        ok, out = self._git("rev-parse", "HEAD", cwd=self._checkout)
        return out if ok else None

    def _verify(self, repo: Path, commit: str) -> str | None:
        """None when the commit may be used, else why not."""
        if not self._source.require_signed_commits:
            return None
        ok, out = self._git(
            "-c",
            "gpg.format=ssh",
            "-c",
            f"gpg.ssh.allowedSignersFile={self._source.allowed_signers_file}",
            "verify-commit",
            commit,
            cwd=repo,
        )
        return None if ok else f"commit {commit[:12]} is not signed by an allowed signer ({out})"

    def _rewind(self, head: str, candidate: str) -> str | None:
        """Why `candidate` may not replace `head` (None: it descends from it)."""
        ok, _ = self._git("merge-base", "--is-ancestor", head, candidate, cwd=self._checkout)
        if ok:
            return None
        return (
            f"commit {candidate[:12]} does not descend from {head[:12]}, the commit this host runs (a rewind or a force-push); "
            "an operator takes it with `fabric pull --accept-rewind`"
        )

    def update(self, *, accept_rewind: bool = False) -> PullOutcome:
        """Fetch and move to the branch's newest acceptable commit; `accept_rewind`
        also takes one that does not descend from the current commit (still signed)."""
        self._pin_host_key()
        head = self.head()
        if head is None:
            return self._clone()
        ok, out = self._git(
            "fetch", "--quiet", "origin", f"+refs/heads/{self._source.branch}:refs/remotes/origin/{self._source.branch}", cwd=self._checkout
        )
        if not ok:
            return PullOutcome(head, False, f"cannot fetch {self._source.remote}: {out}")
        ok, candidate = self._git("rev-parse", f"refs/remotes/origin/{self._source.branch}", cwd=self._checkout)
        if not ok:
            return PullOutcome(head, False, candidate)
        if candidate == head:
            return PullOutcome(head, False)
        refused = self._verify(self._checkout, candidate) or (None if accept_rewind else self._rewind(head, candidate))
        if refused:
            return PullOutcome(head, False, refused)
        ok, out = self._git("checkout", "--quiet", "--force", "--detach", candidate, cwd=self._checkout)
        if not ok:
            return PullOutcome(head, False, out)
        return PullOutcome(candidate, True)

    def _clone(self) -> PullOutcome:
        """First checkout: clone beside the target, verify, then rename into place."""
        staging = self._checkout.with_name(f".{self._checkout.name}.clone")
        shutil.rmtree(staging, ignore_errors=True)
        self._checkout.parent.mkdir(parents=True, exist_ok=True)
        ok, out = self._git(
            "clone", "--quiet", "--branch", self._source.branch, "--single-branch", "--no-checkout", self._source.remote, str(staging)
        )
        if not ok:
            shutil.rmtree(staging, ignore_errors=True)
            return PullOutcome(None, False, f"cannot clone {self._source.remote}: {out}")
        ok, commit = self._git("rev-parse", f"refs/remotes/origin/{self._source.branch}", cwd=staging)
        refused = self._verify(staging, commit) if ok else commit
        if not refused:
            ok, out = self._git("checkout", "--quiet", "--force", "--detach", commit, cwd=staging)
            refused = None if ok else out
        if refused:
            shutil.rmtree(staging, ignore_errors=True)
            return PullOutcome(None, False, refused)
        if self._checkout.exists():
            # A plain directory that was never a checkout: keep it aside, never delete it.
            os.replace(self._checkout, self._checkout.with_name(f"{self._checkout.name}.before-git"))
        os.replace(staging, self._checkout)
        return PullOutcome(commit, True)
