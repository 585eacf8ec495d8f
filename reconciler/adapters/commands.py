"""CommandRunner over subprocess: no shell, a timeout, never raises for a failing program."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from reconciler.core.command_result import CommandResult


class SubprocessRunner:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        # A fixed locale so parsers see the output they were written for.
        self._env = {**os.environ, "LC_ALL": "C", **(env or {})}

    def run(self, argv: Sequence[str], *, timeout: float = 10.0, stdin: str | None = None) -> CommandResult:
        argv = tuple(argv)
        if argv and os.sep not in argv[0] and shutil.which(argv[0], path=self._env.get("PATH", os.defpath)) is None:
            # Not on the PATH the child would search: what its exec would
            # say, without starting a process (the probe asks for several
            # programs most hosts do not have, every pass).
            return CommandResult(argv, None, missing=True)
        # Imported here: a pass that runs no program (a memo hit on a host
        # without tailscale or nvidia-smi) does not pay for it.
        import subprocess

        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                env=self._env,
                check=False,
            )
        except FileNotFoundError:
            return CommandResult(argv, None, missing=True)
        except PermissionError as exc:
            return CommandResult(argv, None, stderr=str(exc), missing=True)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return CommandResult(argv, None, stdout=out, timed_out=True)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
