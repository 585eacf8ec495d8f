"""The `Nftables` port: check and load the table `inet fabric` with the real `nft`.

The ruleset text is handed to `nft -f -` on stdin, so what is checked is byte for
byte what is loaded and no temporary file is involved. Loading is one nft
transaction: either the whole new table is in force afterwards or, if nft
rejects anything, the previous one still is.

Replacing the table rather than adding to it: unless the text already deletes
`inet fabric` itself, the adapter puts `table inet fabric` + `delete table inet
fabric` in front (create-if-missing, then delete, in the same transaction), so
the text only has to declare the table as it should be and a second load of the
same text changes nothing.

Only `inet fabric` is ever touched: text that names another table or flushes the
whole ruleset is refused before nft sees it, so other tables on the host (the
distribution's firewall, Docker's, k3s's) are left alone.

`prefix` is prepended to every command; the tests use `("ip", "netns", "exec",
NAME)` to work inside a network namespace.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from reconciler.ports import ActivationError, CommandRunner

FABRIC_FAMILY = "inet"
FABRIC_TABLE = "fabric"

_REPLACE_PROLOGUE = f"table {FABRIC_FAMILY} {FABRIC_TABLE}\ndelete table {FABRIC_FAMILY} {FABRIC_TABLE}\n"

# A reference to some table: `table inet fabric`, `add chain ip nat x`, `delete rule ...`.
_TABLE_REFERENCE = re.compile(
    r"\b(?:table|chain|rule|set|map|element|flowtable|counter|quota|limit|ct\s+helper)\s+"
    r"(ip|ip6|inet|arp|bridge|netdev)\s+([A-Za-z_][\w.-]*)"
)
_WHOLE_RULESET = re.compile(r"^\s*(?:flush|delete|reset)\s+ruleset\b", re.MULTILINE)
_INCLUDE = re.compile(r"^\s*include\b", re.MULTILINE)
_DELETES_FABRIC = re.compile(rf"^\s*delete\s+table\s+{FABRIC_FAMILY}\s+{FABRIC_TABLE}\s*$", re.MULTILINE)


class NftCommand:
    """`reconciler.ports.Nftables` through a `CommandRunner` running `nft`."""

    def __init__(self, runner: CommandRunner, *, prefix: Sequence[str] = (), nft: str = "nft", timeout: float = 30.0) -> None:
        self._runner = runner
        self._prefix = tuple(prefix)
        self._nft = nft
        self._timeout = timeout

    def check(self, ruleset: str) -> None:
        self._nft_file(("-c",), ruleset, "check")

    def apply(self, ruleset: str) -> None:
        self._nft_file((), ruleset, "load")

    def table_loaded(self) -> bool:
        result = self._runner.run([*self._prefix, self._nft, "list", "table", FABRIC_FAMILY, FABRIC_TABLE], timeout=self._timeout)
        if result.missing or result.timed_out:
            raise ActivationError(f"nft list: {result.failure()}")
        # nft exits 1 with "No such file or directory" for a table not there.
        return result.ok

    def _nft_file(self, flags: tuple[str, ...], ruleset: str, verb: str) -> None:
        text = self.transaction(ruleset)
        result = self._runner.run([*self._prefix, self._nft, *flags, "-f", "-"], timeout=self._timeout, stdin=text)
        if result.ok:
            return
        if result.missing or result.timed_out:
            raise ActivationError(f"nft {verb}: {result.failure()}")
        # nft's own words, with the offending line and caret it prints.
        detail = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
        raise ActivationError(f"nft {verb} of table {FABRIC_FAMILY} {FABRIC_TABLE} failed:\n{detail}")

    @staticmethod
    def transaction(ruleset: str) -> str:
        """The exact text handed to nft: the ruleset made to replace `inet fabric`.

        Raises ActivationError if the ruleset would touch anything but that table.
        """
        _refuse_foreign_tables(ruleset)
        if _DELETES_FABRIC.search(_without_comments(ruleset)):
            return ruleset
        return _REPLACE_PROLOGUE + ruleset


def _without_comments(text: str) -> str:
    # nft comments run from `#` to the end of the line; quoted strings in rules
    # (`comment "..."`) rarely hold a `#`, and if one does we only see less text.
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def _refuse_foreign_tables(ruleset: str) -> None:
    text = _without_comments(ruleset)
    problems: list[str] = []
    if _WHOLE_RULESET.search(text):
        problems.append("it acts on the whole ruleset")
    if _INCLUDE.search(text):
        problems.append("it includes other files")
    for line_number, line in enumerate(text.splitlines(), start=1):
        for family, table in _TABLE_REFERENCE.findall(line):
            if (family, table) != (FABRIC_FAMILY, FABRIC_TABLE):
                problems.append(f"line {line_number} names table {family} {table}")
    if problems:
        raise ActivationError(f"refusing an nft ruleset that reaches beyond table {FABRIC_FAMILY} {FABRIC_TABLE}: " + "; ".join(problems))
