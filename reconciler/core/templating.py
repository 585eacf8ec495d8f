"""The one way to load the Jinja templates of every file a pass writes.

The templates are package data (pyproject.toml `[tool.setuptools.package-data]`)
and are loaded with Jinja's `PackageLoader`, so they are found wherever the
package is installed: a wheel in a virtual environment (`scripts/join.sh`), the
Nix store (`nix/package.nix`), an editable checkout. Nothing copies them beside
the package. They live in `reconciler/templates/` (data, no code); the
repository's top-level `templates/` is a link to that directory.

Files whose name starts with `_` are included by other templates, never
rendered on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import jinja2

# The templates' directory, for tests that read or copy them; rendering goes
# through `environment()` and never uses the path.
TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"

Kind = Literal["text", "html"]


@cache
def environment(kind: Kind = "text", directory: str | None = None, compiled: jinja2.BytecodeCache | None = None) -> jinja2.Environment:
    """The Jinja environment for `kind`, one per process (it caches the compiled templates).

    Both kinds are StrictUndefined: a missing value is an error, never an
    empty string.

    - "text": unit files, nftables, the Caddyfile, YAML. Nothing is escaped
      (the renderer quotes every value for the language it lands in) and the
      whitespace is exactly what the template spells out.
    - "html": the status page. Everything is escaped (its values come from the
      registry and the plan) and block tags take their line with them.

    `directory` loads the templates from there instead of the package (tests
    render edited copies). `compiled` keeps the package's templates compiled
    between processes (a pass's state directory: `Templates`); edited copies
    are compiled every time.
    """
    loader: jinja2.BaseLoader = jinja2.PackageLoader("reconciler", "templates") if directory is None else jinja2.FileSystemLoader(directory)
    # Edited copies (tests) are compiled every time; only the package's are kept.
    compiled = compiled if directory is None else None
    if kind == "html":
        return jinja2.Environment(
            loader=loader,
            bytecode_cache=compiled,
            undefined=jinja2.StrictUndefined,
            autoescape=True,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
        )
    return jinja2.Environment(
        loader=loader,
        bytecode_cache=compiled,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=False,
    )


@dataclass(frozen=True, eq=False)
class Templates:
    """Where a render takes its templates from: the package's (kept compiled
    between processes when `compiled` is given: the wiring hands a pass its
    state directory's cache) or an edited copy in `directory` (tests). A
    value the caller passes in, so the core holds no state set from outside."""

    directory: Path | None = None
    compiled: jinja2.BytecodeCache | None = None

    @staticmethod
    def of(templates: Templates | Path | None) -> Templates:
        """`templates` as a Templates: a directory is an edited copy, None the package's."""
        if isinstance(templates, Templates):
            return templates
        return Templates(directory=templates)

    def get(self, kind: Kind, name: str) -> jinja2.Template:
        directory = None if self.directory is None else str(self.directory)
        return environment(kind, directory, self.compiled).get_template(name)


# The package's templates, compiled in this process only.
PACKAGED = Templates()
