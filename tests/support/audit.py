"""The one recording fake of the `Audit` port."""

from __future__ import annotations


class RecordingAudit:
    """The Audit port, kept in a list: one dict per record, its action, its
    outcome and the fields given a value (an empty field is left out)."""

    def __init__(self) -> None:
        self.records: list[dict[str, str]] = []

    def record(self, action: str, outcome: str, **fields: str) -> None:
        self.records.append({"action": action, "outcome": outcome, **{k: v for k, v in fields.items() if v}})
