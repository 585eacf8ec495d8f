"""A stand-in HookRunner for leader tests on a machine without systemd as PID 1.

`DirectHooks` runs the hook's own command (what follows "--" in the
systemd-run argv the core built) with the real SubprocessRunner and reports
it as systemd-run would: the scaling logic, the record and the argv are the
leader's own; only the sandbox is missing. The sandbox itself (systemd-run,
a dynamic user, credentials, the budget, the journal) is tested against a
real systemd in tests/integration/test_hook_sandbox.py.
"""

from __future__ import annotations

from reconciler.adapters.commands import SubprocessRunner
from reconciler.core.render.hook_unit import HookRun, HookUnit, output_tail


class DirectHooks:
    def __init__(self) -> None:
        self.units: list[HookUnit] = []

    def run(self, hook: HookUnit) -> HookRun:
        self.units.append(hook)
        assert hook.argv[0] == "systemd-run", hook.argv
        command = hook.argv[hook.argv.index("--") + 1 :]
        result = SubprocessRunner().run(command, timeout=min(hook.wait_s, hook.timeout_s))
        output = output_tail((result.stdout + result.stderr).splitlines())
        if result.missing:
            return HookRun(hook.unit, "missing", output=output)
        if result.timed_out:
            return HookRun(hook.unit, "timeout", output=output)
        return HookRun(hook.unit, "ok" if result.returncode == 0 else "exit", returncode=result.returncode, output=output)


class NoHooks:
    """The HookRunner port where no hook may run: each 'succeeds', doing nothing."""

    def run(self, hook: HookUnit) -> HookRun:
        return HookRun(hook.unit, "ok", returncode=0)
