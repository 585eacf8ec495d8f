"""The `UnitVerifier` port: `systemd-analyze verify` of rendered units before activation.

The rendered units live in a generation directory, not in /etc/systemd/system,
so systemd would not find them by name (nor their drop-ins, nor a unit one of
them `Requires=`). The verifier therefore runs

    env SYSTEMD_UNIT_PATH=<their directories>: systemd-analyze verify \
        --man=no --recursive-errors=one <unit files...> <units extended by drop-ins...>

The trailing `:` keeps systemd's own search path after ours, so dependencies
such as `network-online.target` still resolve. `--recursive-errors=one` reports
problems of the given units and of their direct dependencies (a `Requires=` on
a unit that exists nowhere is an error), not of everything those pull in;
`--man=no` skips looking for `Documentation=` man pages.

A drop-in (`NAME.d/*.conf`) cannot be verified on its own: the unit it extends
is verified by name with the drop-in merged in. That unit must be one of the
given files or installed on this machine, otherwise verification fails ("Unit
... not found"), because a drop-in for a unit that does not exist would do
nothing.

A setting systemd could not parse or an unknown key ("..., ignoring") is only a
warning to systemd, which would run the unit without it, and systemd-analyze
does not always exit non-zero for one. Every diagnostic line about one of the
given units therefore counts as a failure: a misspelled hardening option
silently dropped is exactly what this check is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

from reconciler.ports import ActivationError, CommandRunner

# Exit status of `env` when the program it should run does not exist.
_ENV_COMMAND_NOT_FOUND = 127


class SystemdAnalyzeVerifier:
    """`reconciler.ports.UnitVerifier` running `systemd-analyze verify` through a CommandRunner."""

    def __init__(
        self,
        runner: CommandRunner,
        *,
        systemd_analyze: str = "systemd-analyze",
        timeout: float = 60.0,
    ) -> None:
        self._runner = runner
        self._systemd_analyze = systemd_analyze
        self._timeout = timeout

    def verify(self, unit_paths: Sequence[str]) -> None:
        if not unit_paths:
            return
        argv, unit_names = self.command(unit_paths)
        result = self._runner.run(argv, timeout=self._timeout)
        if result.missing or result.timed_out:
            raise ActivationError(f"systemd-analyze verify: {result.failure()}")
        if result.returncode == _ENV_COMMAND_NOT_FOUND:
            raise ActivationError(f"systemd-analyze verify: {self._systemd_analyze}: not installed")
        diagnostics = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        if result.returncode != 0:
            raise ActivationError("systemd-analyze verify failed:\n" + "\n".join(diagnostics or [f"exit {result.returncode}"]))
        about_ours = [line for line in diagnostics if _names_any(line, unit_paths, unit_names)]
        if about_ours:
            raise ActivationError("systemd-analyze verify found problems (systemd would ignore these settings):\n" + "\n".join(about_ours))

    def command(self, unit_paths: Sequence[str]) -> tuple[list[str], set[str]]:
        """The argv that verifies `unit_paths`, and the unit names it covers."""
        search_dirs: list[str] = []
        targets: list[str] = []
        unit_names: set[str] = set()
        extended: list[str] = []
        for raw in unit_paths:
            path = PurePosixPath(raw)
            if not path.is_absolute():
                raise ActivationError(f"systemd-analyze verify: unit path must be absolute: {raw}")
            if path.parent.name.endswith(".d") and path.suffix == ".conf":
                # NAME.d/x.conf extends NAME; systemd finds it beside NAME in the search path.
                _add_once(search_dirs, str(path.parent.parent))
                _add_once(extended, path.parent.name.removesuffix(".d"))
                unit_names.add(path.parent.name.removesuffix(".d"))
            else:
                _add_once(search_dirs, str(path.parent))
                targets.append(str(path))
                unit_names.add(path.name)
        given_names = {PurePosixPath(t).name for t in targets}
        targets += [name for name in extended if name not in given_names]
        argv = [
            "env",
            f"SYSTEMD_UNIT_PATH={':'.join(search_dirs)}:",
            self._systemd_analyze,
            "verify",
            "--man=no",
            "--recursive-errors=one",
            *targets,
        ]
        return argv, unit_names


def _add_once(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def _names_any(line: str, paths: Sequence[str], unit_names: set[str]) -> bool:
    return any(path in line for path in paths) or any(line.startswith(f"{name}:") for name in unit_names)
