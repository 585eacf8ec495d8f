"""What one pass reports: the one result type of `fabric reconcile`, `fabric
plan` and `fabric rollback`, whether the full pass ran (engine.reconcile) or
the pass memo stood for it (engine.memoized_pass).

Standard library only (the preview's types are named for type checkers
alone), so that a memoized pass imports no model to report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from reconciler.core.render.actions import HostActions
    from reconciler.engine.pass_memo import MemoSeed


@dataclass(frozen=True)
class Preview:
    """What `fabric plan` shows, for its --json form."""

    host: str
    actions: HostActions
    unfinished: bool  # the last pass did not finish activating; this one would
    render_notes: tuple[str, ...]


PassOutcome = Literal[
    "noop",  # nothing to do
    "applied",  # a generation written and activated
    "written",  # a generation written, not activated
    "static",  # kept the current generation (fail static, or a fenced-off plan)
    "planned",  # fabric plan: the actions shown
    "restored",  # fabric rollback: an earlier generation reinstalled
    "invalid",  # the new generation did not pass the checks; nothing installed
    "rolled-back",  # activation failed; the last good generation is back
    "failed",  # the pass (or rollback) could not finish
    "busy",  # another pass holds the lock
    "bad-input",  # bad desired state, host, capture or plan file; nothing written
    "pending",  # no host file: reported pending (engine.pending), nothing rendered
]
SUCCEEDED = frozenset({"noop", "applied", "written", "static", "planned", "restored", "pending"})


@dataclass(frozen=True)
class PassReport:
    outcome: PassOutcome
    stdout: str = ""  # what a person reads: the actions and the closing line, newline-terminated
    stderr: tuple[str, ...] = ()  # one line each: why it failed or stopped
    preview: Preview | None = None  # preview_pass, when it planned
    memo_seed: MemoSeed | None = None  # run_pass, when the world is as the desired state wants it
    # The pass memo stood for the pass (run_memoized_pass): nothing to do,
    # heartbeat sent, audited; no model was built.
    memoized: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome in SUCCEEDED

    @property
    def exit_status(self) -> int:
        """The command line's: 0 success, 1 the pass failed, 2 bad input (nothing changed)."""
        if self.ok:
            return 0
        return 2 if self.outcome == "bad-input" else 1
