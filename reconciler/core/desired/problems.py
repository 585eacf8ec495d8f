"""One way to say what is wrong with an input file: `FILE: key.path: reason`.

Every document the fabric reads (fabric.toml and the host files, node.toml, a
saved plan or snapshot) reports a bad value as a `Problem`: the file, the key
path in the file's own notation (`services[0].route.host`,
`labels."topology.researchstack.io/role"`) and a reason an operator can act
on. `problems_from_validation` turns a pydantic `ValidationError` into them,
`problem_from_toml_error` and `problem_from_json_error` a syntax error, and
`ProblemsError` carries them all (sorted, without duplicates) so a broken
push is fixed in one round.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from reconciler.core.desired.model import FieldProblem

TOP_LEVEL = "(top level)"


@dataclass(frozen=True, order=True)
class Problem:
    file: str
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.path}: {self.reason}"


class ProblemsError(Exception):
    """An input is invalid; `problems` lists every reason, sorted, once each."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = sorted(set(problems))
        super().__init__("\n".join(str(p) for p in self.problems))


def key_path(loc: Iterable[str | int]) -> str:
    """('services', 0, 'route', 'host') -> 'services[0].route.host'.

    Keys that are not bare TOML keys (label keys with dots and slashes) are
    quoted as TOML would: labels."topology.researchstack.io/role".
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        key = str(part)
        if not key.replace("_", "").replace("-", "").isalnum():
            key = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
        out = f"{out}.{key}" if out else key
    return out or TOP_LEVEL


_BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "less_than_equal": ("le", "at most"),
    "greater_than": ("gt", "greater than"),
    "less_than": ("lt", "less than"),
}


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside list[X], X | None, dict[K, X] and Annotated[...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and origin is not annotation:
        return _inner_model(origin)
    return None


def _fields_at(model: type[BaseModel] | None, loc: Sequence[str | int]) -> list[str]:
    """Known keys of the table at `loc` in `model`, for 'did you mean' (a
    field's TOML key is its alias where it has one: `[[backends]]` is `lanes`)."""
    current = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = _keys(current).get(str(part))
        if field is None:
            return []
        current = _inner_model(field.annotation)
    return list(_keys(current)) if current is not None else []


def _keys(model: type[BaseModel]) -> dict[str, Any]:
    return {field.alias or name: field for name, field in model.model_fields.items()}


def problems_from_validation(
    file: str,
    error: ValidationError,
    model: type[BaseModel] | None = None,
    prefix: Sequence[str | int] = (),
) -> list[Problem]:
    """One `Problem` per error of a pydantic validation of `file`.

    `model` is the model that was validated, for "did you mean" on an unknown
    key; `prefix` is the key path of the validated value inside the file when
    it is not the whole document. A `FieldProblem` raised by a model-level rule
    names its own key, appended to the path.
    """
    problems = []
    for err in error.errors():
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        rule = ctx.get("error")
        kind = err["type"]
        path = key_path((*prefix, *loc))
        if isinstance(rule, FieldProblem):
            path = key_path((*prefix, *loc, *(int(k) if k.isdigit() else k for k in rule.key.split("."))))
            reason = rule.reason
        elif kind == "extra_forbidden":
            known = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            reason = "unknown key" + (f"; did you mean {close[0]!r}?" if close else f" (known keys: {', '.join(known)})" if known else "")
        elif kind == "missing":
            reason = "required key is missing"
        else:
            reason = err["msg"]
            if reason.startswith("Value error, "):
                reason = reason[len("Value error, ") :]
            elif kind in _BOUNDS:
                key, words = _BOUNDS[kind]
                reason = f"{err['input']!r} is out of range: must be {words} {ctx[key]}"
            elif kind == "literal_error":
                reason = f"{err.get('input')!r} is not one of {ctx['expected']}"
            elif "input" in err and kind.endswith("_type"):
                reason = f"{reason} (got {type(err['input']).__name__} {err['input']!r})"
        problems.append(Problem(file, path, reason))
    return problems


def problem_from_toml_error(file: str, error: tomllib.TOMLDecodeError) -> Problem:
    """'Invalid value (at line 3, column 7)' -> path 'line 3', reason 'TOML syntax error: Invalid value'."""
    msg = str(error)
    where = "(syntax)"
    if "(at line " in msg:
        msg, _, pos = msg.partition(" (at ")
        where = pos.rstrip(")").split(",")[0]
    return Problem(file, where, f"TOML syntax error: {msg}")


def problem_from_json_error(file: str, error: json.JSONDecodeError) -> Problem:
    return Problem(file, f"line {error.lineno} column {error.colno}", f"JSON syntax error: {error.msg}")
