"""The operator's desired-state git checkout, as `fabric admit` changes it.

Paths are relative to the desired state's directory (where fabric.toml is),
which may be anywhere inside the checkout. A commit writes its files
(atomically), stages and commits exactly them (`git commit -- PATHS`: what
else is staged stays staged, uncommitted), signed with `-S` when asked (the
checkout's own signing configuration: gpg.format, user.signingkey); when
anything fails, every file is put back as it was and unstaged, so nothing
written stays.

Commits must be signed here when the checkout says so (git config
commit.gpgsign), or when this machine's node.toml requires signed commits of
the desired state's remote ([source] require_signed_commits, true unless
set to false): hosts would refuse an unsigned commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from reconciler.adapters.install_files import replace_file
from reconciler.ports import CheckoutError, CommandRunner

GIT_TIMEOUT = 120.0


class GitCheckout:
    def __init__(self, runner: CommandRunner, directory: Path, *, node_requires_signing: str | None = None) -> None:
        self._run = runner
        self._directory = directory
        self._node_requires_signing = node_requires_signing

    def _git(self, *args: str) -> tuple[bool, str]:
        result = self._run.run(["git", "-C", str(self._directory), *args], timeout=GIT_TIMEOUT)
        if result.ok:
            return True, result.stdout.strip()
        return False, result.failure() or "git failed"

    def read(self, path: str) -> str | None:
        target = self._directory / path
        if not target.is_file():
            return None
        return target.read_text(encoding="utf-8", errors="replace")

    def signing_required(self) -> str | None:
        ok, value = self._git("config", "--bool", "commit.gpgsign")
        if ok and value == "true":
            return "the checkout's git config sets commit.gpgsign"
        return self._node_requires_signing

    def commit(self, files: Mapping[str, str], message: str, *, sign: bool) -> str:
        ok, out = self._git("rev-parse", "--show-toplevel")
        if not ok:
            raise CheckoutError(f"{self._directory} is not in a git checkout: {out}")
        before = {path: self.read(path) for path in files}
        paths = list(files)
        try:
            for path, text in files.items():
                target = self._directory / path
                target.parent.mkdir(parents=True, exist_ok=True)
                replace_file(target, text.encode(), 0o644)
            for argv in (["add", "--", *paths], ["commit", "--quiet", *(["-S"] if sign else []), "-m", message, "--", *paths]):
                ok, out = self._git(*argv)
                if not ok:
                    raise CheckoutError(f"git {argv[0]}: {out}")
        except (CheckoutError, OSError) as exc:
            self._put_back(before)
            raise exc if isinstance(exc, CheckoutError) else CheckoutError(f"{self._directory}: {exc}") from exc
        ok, commit = self._git("rev-parse", "HEAD")
        if not ok:
            raise CheckoutError(commit)
        return commit

    def _put_back(self, before: Mapping[str, str | None]) -> None:
        """Every file as it was, unstaged (best effort: this runs after a failure)."""
        for path, text in before.items():
            target = self._directory / path
            if text is None:
                target.unlink(missing_ok=True)
            else:
                replace_file(target, text.encode(), 0o644)
        self._git("reset", "--quiet", "--", *before)

    def push(self) -> str:
        ok, out = self._git("push", "--quiet")
        if not ok:
            raise CheckoutError(f"git push: {out}")
        return out or "pushed"
