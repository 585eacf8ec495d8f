"""The one way a test runs the `fabric` command in its own process: `main`
with the arguments, its exit status and what it printed.

`fabric(capsys, *argv)` inside a test (pytest's capsys, emptied first);
`fabric_captured(*argv)` where there is no capsys (a module-scoped fixture):
stdout and stderr redirected for the call. A test that needs the command as a
user runs it, in its own process, runs `python -m reconciler` (tests/conftest.py's
`fabric_validate`)."""

from __future__ import annotations

import contextlib
import io

import pytest


def fabric(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`fabric ARGV...`: (exit status, stdout, stderr) of this call alone."""
    from reconciler.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def fabric_captured(*argv: str) -> tuple[int, str, str]:
    """`fabric ARGV...` without capsys: (exit status, stdout, stderr)."""
    from reconciler.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
