"""Rules every test and harness module keeps, checked by reading their source (ast).

1. No fixed sleeps. A `time.sleep(...)` / `asyncio.sleep(...)` call (or a bare
   `sleep(...)` imported from either) may only pause a polling loop: it sits in
   the body of a `while` or `for` loop (directly or under if/try/with, not in a
   nested function), and that loop checks something every round: its body has
   an `assert`, `break`, `return` or `raise`, or it is a `while` whose test is
   not a constant. A sleep anywhere else waits for something to happen and
   hopes it did; wait on the condition instead (tests.support.harness.waiting.wait_until).
   The only exceptions are in SLEEP_ALLOWED, each with its reason.
2. No assertion on elapsed wall time: an `assert` whose condition subtracts
   from or subtracts a clock reading (time.monotonic/time/perf_counter) is
   a speed measurement; speed goes to bench/.
3. No Hypothesis deadline: every `settings(...)` / `register_profile(...)`
   that names a `deadline` sets it to None (a loaded machine blows any
   per-example deadline and fails a correct test), and the loaded profile has none.
4. Test modules do not import each other: what they share lives in
   tests/support (lint-imports checks the contract in pyproject.toml; here,
   that the contract names every test module, so a new one is not left out).

Sleeps inside strings (child-process scripts) are not calls here and are not checked.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hypothesis import settings

from tests.conftest import REPO

TESTS = REPO / "tests"

# (path relative to the repository, enclosing function) -> why that sleep is not a wait.
SLEEP_ALLOWED: dict[tuple[str, str], str] = {
    # Timeline.at on etcd: a cadence (beat or renew every so often on real
    # time); beating and renewing at that rhythm is the behaviour under test,
    # and what follows asserts on the registry, never on the time.
    ("tests/integration/test_registry_parity.py", "at"): "a cadence of beats and renewals on real time",
}

SLEEPS = {("time", "sleep"), ("asyncio", "sleep")}
CLOCKS = {("time", "monotonic"), ("time", "time"), ("time", "perf_counter"), ("time", "monotonic_ns"), ("time", "perf_counter_ns")}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} (in {self.function}): {self.what}"


def modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _dotted(node: ast.expr) -> tuple[str, str] | None:
    """`time.sleep` -> ("time", "sleep")."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _imported_names(tree: ast.Module, pairs: set[tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Bare names bound by `from time import sleep [as s]` and the like."""
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                if (node.module, alias.name) in pairs:
                    names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def _is_call_to(node: ast.AST, pairs: set[tuple[str, str]], bare: dict[str, tuple[str, str]]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id in bare
    return _dotted(node.func) in pairs


def _loop_checks_each_round(loop: ast.While | ast.For | ast.AsyncFor) -> bool:
    if isinstance(loop, ast.While) and not isinstance(loop.test, ast.Constant):
        return True
    for statement in loop.body:
        for node in ast.walk(statement):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                continue
            if isinstance(node, ast.Assert | ast.Break | ast.Return | ast.Raise):
                return True
    return False


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.sleep_names = _imported_names(tree, SLEEPS)
        self.clock_names = _imported_names(tree, CLOCKS)
        self.functions: list[str] = ["<module>"]
        # The loops around the current node, innermost last, reset in each function.
        self.loops: list[list[ast.While | ast.For | ast.AsyncFor]] = [[]]
        self.findings: list[Finding] = []
        self.allowed_sleeps: list[Finding] = []

    def _finding(self, node: ast.AST, what: str) -> Finding:
        return Finding(self.path, getattr(node, "lineno", 0), self.functions[-1], what)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, name: str) -> None:
        self.functions.append(name)
        self.loops.append([])
        self.generic_visit(node)
        self.loops.pop()
        self.functions.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._function(node, node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, f"{self.functions[-1]}.<lambda>")

    def _loop(self, node: ast.While | ast.For | ast.AsyncFor) -> None:
        # The test or iterable is evaluated outside the body's loop context.
        for field in ("test", "iter", "target"):
            if hasattr(node, field):
                self.visit(getattr(node, field))
        self.loops[-1].append(node)
        for statement in node.body:
            self.visit(statement)
        self.loops[-1].pop()
        for statement in node.orelse:
            self.visit(statement)

    def visit_While(self, node: ast.While) -> None:
        self._loop(node)

    def visit_For(self, node: ast.For) -> None:
        self._loop(node)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> None:
        self._loop(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _is_call_to(node, SLEEPS, self.sleep_names):
            loops = self.loops[-1]
            if not loops or not _loop_checks_each_round(loops[-1]):
                finding = self._finding(node, "a fixed sleep: wait on the condition (tests.support.harness.waiting.wait_until)")
                if (self.path, self.functions[-1]) in SLEEP_ALLOWED:
                    self.allowed_sleeps.append(finding)
                else:
                    self.findings.append(finding)
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else ""
        if name in ("settings", "register_profile"):
            for keyword in node.keywords:
                if keyword.arg == "deadline" and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is None):
                    self.findings.append(self._finding(node, "a Hypothesis deadline: set deadline=None"))
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        for sub in ast.walk(node.test):
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub):
                if any(_is_call_to(side, CLOCKS, self.clock_names) for side in (sub.left, sub.right)):
                    self.findings.append(self._finding(node, "an assertion on elapsed wall time: assert what happened (speed goes to bench/)"))
                    break
        self.generic_visit(node)


def check_source(path: str, source: str) -> _Checker:
    tree = ast.parse(source, filename=path)
    checker = _Checker(path, tree)
    checker.visit(tree)
    return checker


def check_tree() -> tuple[list[Finding], list[Finding]]:
    findings: list[Finding] = []
    allowed: list[Finding] = []
    for module in modules():
        path = module.relative_to(REPO).as_posix()
        checker = check_source(path, module.read_text())
        findings += checker.findings
        allowed += checker.allowed_sleeps
    return findings, allowed


def test_no_test_or_harness_module_sleeps_for_a_fixed_time_or_asserts_on_wall_time():
    findings, _ = check_tree()
    assert not findings, "\n".join(map(str, findings))


def test_every_allowed_sleep_is_still_there():
    """An allow-list entry that allows nothing is stale: remove it (a file
    that is gone, such as a stand-in replaced by the real program, needs no entry)."""
    _, allowed = check_tree()
    used = {(f.path, f.function) for f in allowed}
    stale = [key for key in SLEEP_ALLOWED if (REPO / key[0]).exists() and key not in used]
    assert not stale, f"stale SLEEP_ALLOWED entries: {stale}"


def test_the_loaded_hypothesis_profile_has_no_deadline():
    assert settings.default.deadline is None


TEST_MODULES_CONTRACT = "test modules do not import each other: what they share is in tests.support"


def _named_by(module: str, expressions: list[str]) -> bool:
    """`tests.unit.*` names the modules right under tests.unit; any other expression one module."""
    return any(module == e or (e.endswith(".*") and module.rpartition(".")[0] == e[:-2]) for e in expressions)


def test_the_import_contract_names_every_test_module():
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == TEST_MODULES_CONTRACT]
    test_modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for p in TESTS.glob("*/test_*.py")]
    assert len(test_modules) > 100
    missing = [m for m in sorted(test_modules) if not _named_by(m, contract["modules"])]
    assert not missing, f"add to the contract {TEST_MODULES_CONTRACT!r} in pyproject.toml: {missing}"


# -- the checker itself, on small sources --------------------------------------------


def _found(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.what.split(":")[0]) for f in check_source("tests/x.py", source).findings]


def test_the_checker_flags_a_bare_sleep_and_names_the_line():
    assert _found("import time\n\ndef test_x():\n    start()\n    time.sleep(1)\n    assert done()\n") == [(5, "a fixed sleep")]
    assert _found("from time import sleep as nap\nnap(0.5)\n") == [(2, "a fixed sleep")]
    assert _found("import asyncio\nasync def f():\n    await asyncio.sleep(1)\n") == [(3, "a fixed sleep")]


def test_the_checker_flags_a_cadence_loop_that_checks_nothing_and_a_sleep_in_a_nested_function():
    assert _found("import time\nwhile True:\n    beat()\n    time.sleep(1)\n") == [(4, "a fixed sleep")]
    assert _found("import time\nfor _ in range(3):\n    beat()\n    time.sleep(1)\n") == [(4, "a fixed sleep")]
    nested = "import time\nwhile not done():\n    def pause():\n        time.sleep(1)\n    pause()\n"
    assert _found(nested) == [(4, "a fixed sleep")]


def test_the_checker_accepts_polling_loops():
    assert _found("import time\nwhile not done():\n    time.sleep(0.05)\n") == []
    assert _found("import time\nwhile True:\n    if done():\n        break\n    time.sleep(0.05)\n") == []
    assert _found("import time\nfor _ in range(9):\n    assert alive()\n    time.sleep(0.05)\n") == []


def test_the_checker_flags_elapsed_time_assertions_and_hypothesis_deadlines():
    assert _found("import time\nt0 = time.monotonic()\nrun()\nassert time.monotonic() - t0 < 3\n") == [(4, "an assertion on elapsed wall time")]
    assert _found("from time import perf_counter\nassert perf_counter() - t0 <= 1\n") == [(2, "an assertion on elapsed wall time")]
    assert _found("from hypothesis import settings\n@settings(deadline=500)\ndef test_x(): pass\n") == [(2, "a Hypothesis deadline")]
    assert _found("settings.register_profile('ci', deadline=None)\n@settings(max_examples=5, deadline=None)\ndef f(): pass\n") == []
