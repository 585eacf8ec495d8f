"""A cloud hook as a transient systemd unit: the `systemd-run` argv, and how its run ended.

Pure: the hook's model and a time in, an argv value out (`hook_unit`); the
output of `systemd-run --wait` and the lines of the unit's journal in, a
`HookRun` out (`hook_run`). The leader never runs a hook in its own (root)
process: `reconciler.adapters.hook_units` runs this argv, and systemd starts
the hook as a unit of its own:

- a dynamic user (`DynamicUser=yes`): no uid of the host's, no files of its
  own afterwards; no capabilities (`CapabilityBoundingSet=` and
  `AmbientCapabilities=` empty), `NoNewPrivileges=yes`;
- a private /tmp (`PrivateTmp=yes`, also its `HOME`), the whole file system
  read-only (`ProtectSystem=strict`), home directories hidden;
- only the credentials it names: `LoadCredential=NAME:PATH` for each, PID 1
  reads the file and hands the hook a copy under
  `/run/credentials/<unit>/NAME` (`$CREDENTIALS_DIRECTORY`), whose path (never
  the value) the hook also finds in `$NAME_FILE`;
- its own time budget (`RuntimeMaxSec=` its `timeout_s`): systemd stops it
  then, whether or not the leader still waits;
- its working directory (`WorkingDirectory=`), else `/`;
- its output to its own journal (`journalctl _SYSTEMD_UNIT=<unit>`), its exit
  status back to the leader (`--wait`; `--collect` unloads the unit even when
  it failed, so the next run starts clean).

The unit's name carries the tier and the time it was started, so each run's
journal is found by its name alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from reconciler.core.command_result import CommandResult
from reconciler.core.desired.model import CloudHook
from reconciler.core.desired.secrets import secret_value_kind

SYSTEMD_RUN = "systemd-run"
HOOK_UNIT_PREFIX = "fabric-hook-"
# Where systemd puts a system service's credentials (its $CREDENTIALS_DIRECTORY).
CREDENTIALS_ROOT = "/run/credentials"
# The sandbox every hook gets, whatever the desired state says.
SANDBOX = (
    "DynamicUser=yes",
    "CapabilityBoundingSet=",
    "AmbientCapabilities=",
    "NoNewPrivileges=yes",
    "PrivateTmp=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
)
# How long past its own budget the leader waits for systemd-run to report
# (systemd's stop of the unit, SIGTERM then SIGKILL, takes up to its
# TimeoutStopSec=, 90 s by default: the leader does not wait that out).
REPORT_GRACE_S = 10.0
# What the scaling record keeps of a hook's output: its last lines, short.
OUTPUT_LINES = 8
OUTPUT_LINE_CHARS = 200

# refused: not run at all, a path it names is outside this host's allowed prefixes.
HookEnd = Literal["ok", "exit", "timeout", "missing", "start_failed", "detached", "refused"]


@dataclass(frozen=True)
class HookUnit:
    """One run of a tier's hook: the unit systemd will run it as, and the argv that asks for it."""

    tier: str
    unit: str
    argv: tuple[str, ...]
    timeout_s: int
    # How long the leader waits for systemd-run's report at most: the hook's
    # budget and a grace, or less when the leader must renew its lease first
    # (the unit runs on, bounded by its own budget; its journal says how it ended).
    wait_s: float


def hook_unit_name(tier: str, at: datetime) -> str:
    """fabric-hook-batch-20261202T101500123456.service: the tier and the start time (UTC, microseconds)."""
    return f"{HOOK_UNIT_PREFIX}{tier.replace('_', '-')}-{at:%Y%m%dT%H%M%S%f}.service"


def credential_file(unit: str, name: str) -> str:
    """Where the hook finds credential `name` (the path only, never the value)."""
    return f"{CREDENTIALS_ROOT}/{unit}/{name}"


def hook_unit(tier: str, hook: CloudHook, at: datetime) -> HookUnit:
    """The `systemd-run` argv that runs `hook` as its own sandboxed unit, started at `at`."""
    unit = hook_unit_name(tier, at)
    argv = [
        SYSTEMD_RUN,
        "--wait",
        "--collect",
        "--service-type=exec",
        f"--unit={unit}",
        f"--description=fabric cloud hook ({tier})",
        *(f"--property={p}" for p in SANDBOX),
        f"--property=RuntimeMaxSec={hook.timeout_s}",
    ]
    if hook.working_directory is not None:
        argv.append(f"--property=WorkingDirectory={hook.working_directory}")
    for name, path in sorted(hook.credentials.items()):
        argv.append(f"--property=LoadCredential={name}:{path}")
    argv.append("--setenv=HOME=/tmp")
    argv += [f"--setenv={name}_FILE={credential_file(unit, name)}" for name in sorted(hook.credentials)]
    argv += ["--", *hook.command]
    return HookUnit(tier=tier, unit=unit, argv=tuple(argv), timeout_s=hook.timeout_s, wait_s=hook.timeout_s + REPORT_GRACE_S)


@dataclass(frozen=True)
class HookRun:
    """How a hook's unit ended, with the last lines of its output (screened for secrets)."""

    unit: str
    end: HookEnd
    returncode: int | None = None
    output: tuple[str, ...] = ()
    # systemd-run's own words when the unit did not run to an exit status.
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.end == "ok"

    def summary(self) -> str:
        """How it ended, in a few words (the audit's and the timeline's)."""
        words = {
            "ok": "ran, exit 0",
            "exit": f"failed: exit {self.returncode}",
            "timeout": "failed: timed out (its own budget)",
            "missing": "failed: not installed",
            "start_failed": "failed: did not start",
            "detached": "still running when the leader stopped waiting",
            "refused": "refused: a path outside this host's allowed prefixes",
        }[self.end]
        return f"{words} ({self.unit})"


_RESULT_RE = re.compile(r"^Finished with result: (\S+)", re.MULTILINE)
_STATUS_RE = re.compile(r"^Main processes terminated with: code=exited/status=(\d+)", re.MULTILINE)


def output_tail(lines: Sequence[str]) -> tuple[str, ...]:
    """The last OUTPUT_LINES non-empty lines, each cut short, control
    characters dropped, and any line that looks like a secret withheld."""
    kept = []
    for line in lines:
        clean = "".join(c for c in line if c.isprintable()).strip()
        if not clean:
            continue
        kind = secret_value_kind(clean)
        kept.append(f"(a line withheld: it looks like {kind})" if kind is not None else clean[:OUTPUT_LINE_CHARS])
    return tuple(kept[-OUTPUT_LINES:])


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("Running as unit")]
    return lines[0][:OUTPUT_LINE_CHARS] if lines else ""


def hook_run(unit: HookUnit, result: CommandResult, journal: Sequence[str]) -> HookRun:
    """How the run ended, from systemd-run's own report (--wait: the
    service's exit status is its own, 'Finished with result: ...' on stderr)."""
    output = output_tail(journal)
    if result.missing:
        return HookRun(unit.unit, "missing", detail=f"{SYSTEMD_RUN}: not installed", output=output)
    if result.timed_out:
        return HookRun(unit.unit, "detached", detail=f"no report within {unit.wait_s:g} s", output=output)
    finished = _RESULT_RE.search(result.stderr)
    if result.returncode == 0 and finished is not None and finished.group(1) == "success":
        return HookRun(unit.unit, "ok", returncode=0, output=output)
    if finished is None:
        # No unit ran to its end: the program was not found, a credential
        # could not be read, the working directory is missing, no systemd.
        end: HookEnd = "missing" if "Failed to find executable" in result.stderr else "start_failed"
        return HookRun(unit.unit, end, detail=_first_line(result.stderr or result.stdout), output=output)
    if finished.group(1) == "timeout":
        return HookRun(unit.unit, "timeout", output=output, detail=f"stopped at its budget of {unit.timeout_s} s")
    status = _STATUS_RE.search(result.stderr)
    code = int(status.group(1)) if status is not None else result.returncode
    return HookRun(unit.unit, "exit", returncode=code, output=output, detail=f"result: {finished.group(1)}")
