"""fabric schema: the JSON Schema of fabric.toml (or of a host file), or the
desired-state reference page, generated from the models.

`fabric schema > hosts/fabric.schema.json` is the file hosts/fabric.toml names
on its first line (`#:schema ./fabric.schema.json`) for editors that read JSON
Schema for TOML (taplo, Even Better TOML); `fabric schema --reference >
docs/reference.md` writes the reference page.
"""

from __future__ import annotations

import argparse

from reconciler.cli import EXIT_OK
from reconciler.core.desired.reference import fleet_schema, host_schema, reference_markdown, schema_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of fabric.toml (or a host file), or the desired-state reference")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--host-file", action="store_true", help="the schema of a host file, hosts/<host>.toml")
    what.add_argument("--reference", action="store_true", help="the reference page (Markdown) of both files: docs/reference.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.reference:
        print(reference_markdown(), end="")
    else:
        print(schema_json(host_schema() if args.host_file else fleet_schema()), end="")
    return EXIT_OK
