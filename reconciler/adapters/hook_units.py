"""HookRunner: a cloud hook as a transient systemd unit (`systemd-run --wait`), never in this process.

`reconciler.core.render.hook_unit.hook_unit` builds the argv (the sandbox, the
credentials, the budget); this runs it through a CommandRunner (no shell),
then reads the unit's own output back from the journal: `journalctl --sync`
first (journald may not have written the last lines a unit printed just
before it ended), then the unit's lines by `_SYSTEMD_UNIT=`, which journald
takes from the stream's own header, so even a process gone by then is found.
"""

from __future__ import annotations

from reconciler.core.render.hook_unit import OUTPUT_LINES, HookRun, HookUnit, hook_run
from reconciler.ports import CommandRunner

# How long the journal reads may take (each).
JOURNAL_TIMEOUT_S = 10.0


class SystemdRunHooks:
    def __init__(self, runner: CommandRunner) -> None:
        self._runner = runner

    def run(self, hook: HookUnit) -> HookRun:
        result = self._runner.run(hook.argv, timeout=hook.wait_s)
        return hook_run(hook, result, self.output(hook.unit))

    def output(self, unit: str) -> list[str]:
        """The unit's last lines in the journal ([] when there is none to read)."""
        self._runner.run(["journalctl", "--sync"], timeout=JOURNAL_TIMEOUT_S)
        read = self._runner.run(
            ["journalctl", "--no-pager", "--output=cat", f"--lines={OUTPUT_LINES * 4}", f"_SYSTEMD_UNIT={unit}"],
            timeout=JOURNAL_TIMEOUT_S,
        )
        return read.stdout.splitlines() if read.ok else []
