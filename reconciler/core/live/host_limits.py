"""A host's effective concurrency limits: the host file's, bounded by the probe (pure).

A host file's `[limits]` may only lower what the probe measured (a typo must
not make a 2-core box take eight tasks), unless it says
`overrides.limits_above_probe = true`; then the declared limits stand. A limit
the host file does not declare is the probe's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

# Types only: a memoized pass says `lowered_note` and imports no model.
if TYPE_CHECKING:
    from reconciler.core.desired.model import HostConfig, Limitations


@dataclass(frozen=True)
class EffectiveLimits:
    max_concurrent_tasks: int
    max_concurrent_ceiling: int
    # One sentence per declared limit the probe lowered, for the pass output
    # and the heartbeat (NodeRecord.lowered_limits).
    lowered: tuple[str, ...] = ()


def effective_limits(host: HostConfig, probed: Limitations) -> EffectiveLimits:
    declared = host.limits
    above_probe = host.overrides.limits_above_probe
    lowered: list[str] = []

    def bound(name: str, wanted: int | None, measured: int) -> int:
        if wanted is None:
            return measured
        if above_probe or wanted <= measured:
            return wanted
        lowered.append(f"{name} {wanted} lowered to {measured} by the probe")
        return measured

    tasks = bound("max_concurrent_tasks", declared.max_concurrent_tasks, probed.max_concurrent_tasks)
    ceiling = bound("max_concurrent_ceiling", declared.max_concurrent_ceiling, probed.max_concurrent_ceiling)
    return EffectiveLimits(tasks, ceiling, tuple(lowered))


def lowered_note(lowered: tuple[str, ...] | list[str]) -> str | None:
    """The pass output's one line on limits the probe lowered (None: none)."""
    if not lowered:
        return None
    return f"limits bounded by the probe: {'; '.join(lowered)} (overrides.limits_above_probe = true keeps the declared ones)"
