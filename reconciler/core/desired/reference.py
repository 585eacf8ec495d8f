"""The desired state's JSON Schema and its reference page, from the models.

`fabric schema` prints `fleet_schema()` (fabric.toml) or `host_schema()`
(hosts/<host>.toml); editors that read JSON Schema for TOML (taplo, Even
Better TOML) validate and complete the files with it. `reference_markdown()`
is docs/reference.md: every key with its TOML name, type, default, constraint
and description, table by table. Both are generated, never written by hand:
tests/unit/test_reference.py fails when a checked-in copy is stale.

A schema says what a pattern or a bound can say; the rules across keys (a
compute lane needs its agent_ref, node_timeout_s is at least heartbeat_s, ...)
and across files are `fabric validate`'s, named in the keys' descriptions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from reconciler.core.desired.model import FleetConfig, HostConfig

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FILE = "fabric.schema.json"
REGENERATE_REFERENCE = "fabric schema --reference > docs/reference.md"
REGENERATE_SCHEMA = f"fabric schema > hosts/{SCHEMA_FILE}"

Schema = dict[str, Any]


def fleet_schema() -> Schema:
    """The JSON Schema of fabric.toml (TOML names: `[[backends]]`, not the model's `lanes`)."""
    return _with_header(FleetConfig.model_json_schema(by_alias=True), "fabric.toml", "The fleet's desired state: fabric.toml.")


def host_schema() -> Schema:
    """The JSON Schema of a host file, hosts/<host>.toml."""
    return _with_header(HostConfig.model_json_schema(by_alias=True), "<host>.toml", "One host's desired state: hosts/<host>.toml.")


def schema_json(schema: Schema) -> str:
    """A schema as the checked-in file holds it (stable key order, a final newline)."""
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def _with_header(schema: Schema, title: str, description: str) -> Schema:
    return {"$schema": JSON_SCHEMA_DIALECT, **schema, "title": title, "description": description}


# --------------------------------------------------------------------------
# The reference page


def reference_markdown() -> str:
    """docs/reference.md."""
    out = [
        "# Desired-state reference",
        "",
        "<!-- Generated from reconciler/core/desired/model.py: do not edit by hand.",
        f"     Regenerate with `{REGENERATE_REFERENCE}`. -->",
        "",
        "Every key of `fabric.toml` and of a host file, table by table: its TOML name,",
        "type, default (a dash: required), the constraint a value must meet and what",
        "it does. Unknown keys are errors, and values are not converted between",
        'types (`30`, not `"30"`). Rules that span keys or files (named in the',
        "descriptions) are checked by `fabric validate --desired DIR`, which reports",
        "every problem at once as `FILE: key.path: reason`. The same models give the",
        "JSON Schema that `fabric schema` prints (`--host-file` for a host file);",
        "[desired-state.md](desired-state.md) shows how an editor uses it.",
        "",
        "## fabric.toml",
        "",
    ]
    fleet = fleet_schema()
    out += _table(fleet, fleet, "", heading_level=3)
    out += ["## hosts/&lt;host&gt;.toml", ""]
    host = host_schema()
    out += _table(host, host, "", heading_level=3)
    return "\n".join(out).rstrip("\n") + "\n"


def _table(root: Schema, model: Schema, prefix: str, heading_level: int) -> list[str]:
    """The rows of one TOML table's keys, then one section per nested table."""
    rows: list[str] = []
    nested: list[tuple[str, Schema, str]] = []  # (TOML header, model schema, description)
    required = set(model.get("required", []))
    for key, prop in model.get("properties", {}).items():
        description = prop.get("description", "")
        inner = _optional_inner(prop)
        path = f"{prefix}{key}"
        if "$ref" in inner:
            nested.append((f"[{path}]", _resolve(root, inner["$ref"]), description))
        elif inner.get("type") == "array" and "$ref" in inner.get("items", {}):
            nested.append((f"[[{path}]]", _resolve(root, inner["items"]["$ref"]), description))
        elif inner.get("type") == "object" and "$ref" in _as_schema(inner.get("additionalProperties")):
            names = inner.get("propertyNames", {}).get("enum")
            name = "|".join(names) if names else "name"
            nested.append((f"[{path}.<{name}>]", _resolve(root, inner["additionalProperties"]["$ref"]), description))
        else:
            default = "—" if key in required else _default(prop.get("default"))
            rows.append(f"| `{key}` | {_cell(_type(inner))} | {_cell(default)} | {_cell(_constraint(inner))} | {_cell(description)} |")
    out: list[str] = []
    if rows:
        out += ["| key | type | default | constraint | description |", "|---|---|---|---|---|", *rows, ""]
    for header, sub, description in nested:
        out += ["#" * heading_level + f" `{header}`", ""]
        text = description or _first_paragraph(sub.get("description", ""))
        if text:
            out += [text, ""]
        out += _table(root, sub, header.strip("[]") + ".", heading_level)
    return out


def _optional_inner(prop: Schema) -> Schema:
    """`X | None` is X in TOML (a key left out); anything else as it is."""
    options = prop.get("anyOf")
    if options:
        present: list[Schema] = [o for o in options if o.get("type") != "null"]
        if len(present) == 1:
            return present[0]
    return prop


def _as_schema(value: Any) -> Schema:
    return value if isinstance(value, dict) else {}


def _resolve(root: Schema, ref: str) -> Schema:
    name = ref.rsplit("/", 1)[-1]
    resolved: Schema = root["$defs"][name]
    return resolved


def _type(schema: Schema) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "$ref" in schema:
        return "table"
    if "anyOf" in schema:
        return " or ".join(_type(o) for o in schema["anyOf"] if o.get("type") != "null")
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_plural(_type(schema.get('items', {})))}"
    if kind == "object":
        names = schema.get("propertyNames", {}).get("enum")
        values = _values(schema)
        if names:
            keys = "keys " + ", ".join(f"`{n}`" for n in names)
            return f"table ({keys}) of {_plural(_type(values))}" if values else f"table ({keys})"
        return f"table of {_plural(_type(values))}" if values else "table"
    if kind is None:
        return "any"
    return str(kind)


def _values(schema: Schema) -> Schema:
    """The schema of a table's values (pydantic puts a key pattern's under patternProperties)."""
    values = _as_schema(schema.get("additionalProperties"))
    if not values and len(schema.get("patternProperties", {})) == 1:
        values = next(iter(schema["patternProperties"].values()))
    return values


def _plural(text: str) -> str:
    if text.startswith("one of "):
        return text
    return {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans", "table": "tables"}.get(text, text)


_BOUNDS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} item(s)"),
    ("maxItems", "at most {} item(s)"),
    ("minProperties", "at least {} keys"),
)


def _constraint(schema: Schema) -> str:
    parts = [text.format(schema[key]) for key, text in _BOUNDS if key in schema]
    if "x-constraint" in schema:
        parts.append(schema["x-constraint"])
    elif "pattern" in schema:
        parts.append(f"matches {_code(schema['pattern'])}")
    if schema.get("type") == "array":
        item = _constraint(_as_schema(schema.get("items")))
        if item:
            parts.append(f"each item: {item}")
    if schema.get("type") == "object":
        names = _as_schema(schema.get("propertyNames"))
        if "x-constraint" in names:
            parts.append(f"keys: {names['x-constraint']}")
        elif "pattern" in names:
            parts.append(f"keys match {_code(names['pattern'])}")
        value = _constraint(_values(schema))
        if value:
            parts.append(f"each value: {value}")
    return "; ".join(parts)


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    return f"`{json.dumps(value)}`"


def _code(text: str) -> str:
    """Inline code for any text, backticks in it too (CommonMark: a longer fence, padded)."""
    if "`" not in text:
        return f"`{text}`"
    return f"`` {text} ``"


def _cell(text: str) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    if not text.startswith("`"):  # a description's <id> is text, not an HTML tag
        text = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)
    return text or " "


def _first_paragraph(text: str) -> str:
    return " ".join(text.split("\n\n", 1)[0].split())
