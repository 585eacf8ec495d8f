"""A registry record that did not parse or validate, as readers name it (pure).

Every record the registry holds is parsed on its own (its adapter does that,
reconciler.adapters.registry_records): one that does not parse is skipped, its
node counts as not beating, and the problem travels with the snapshot as an
`UnreadableRecord`, so the leader's journal, `fabric nodes`, `fabric status`
and the status page all say the same line:

    x86-spill: unreadable heartbeat record: not JSON (expected value at line 1 column 1)

The reason never quotes the record's bytes: a host may have written anything
there (a secret it was handed by mistake, control characters, megabytes).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# What a reason may say at most (a short sentence, never the record's bytes).
MAX_REASON_CHARS = 200


class UnreadableRecord(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # The key under the registry's prefix ("facts/x86-spill") or the sqlite
    # table and row ("nodes/x86-spill").
    key: str
    # What the record is: "heartbeat record", "node state", "drain request",
    # "plan", "leader record", "scaling record", "epoch".
    what: str
    reason: str
    # The node the record is of (None: a fleet-wide record such as the plan).
    node: str | None = None

    def line(self) -> str:
        """`x86-spill: unreadable heartbeat record: <reason>` (the key when
        the record is no node's)."""
        line = f"{self.node or self.key}: unreadable {self.what}: {self.reason}"
        # A key is bytes someone wrote too: no control character reaches a terminal or the journal.
        return "".join(c if c.isprintable() else "?" for c in line)


def problem_lines(problems: list[UnreadableRecord] | tuple[UnreadableRecord, ...]) -> list[str]:
    """One line per problem, sorted and without repeats (the same bytes under
    nodes/ and facts/ are one problem to an operator)."""
    return sorted({p.line() for p in problems})
