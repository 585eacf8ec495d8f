"""fabric: a self-adapting compute fabric, reconciled by a systemd timer on every host."""

from __future__ import annotations

DISTRIBUTION = "fabric-reconciler"


def __getattr__(name: str) -> str:
    # reconciler.__version__ is read when asked for (the pass memo's key, the
    # desired state's verdict), not by every `import reconciler`.
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    version = installed_version()
    globals()["__version__"] = version
    return version


def installed_version() -> str:
    """This package's version. It is written in pyproject.toml only; the
    installed metadata carries it.

    A wheel installed by pip, or by Nix's Python builder, puts the package
    beside its metadata (site-packages/reconciler and
    site-packages/fabric_reconciler-VERSION.dist-info): that METADATA's
    Version is read directly. importlib.metadata, which finds the same file,
    costs a pass more (some 70 modules) than the memo's whole check.
    A source tree (the package beside the pyproject.toml of this
    distribution: a checkout, an editable install) reads the version there,
    the file it is written in. Anything else (not exactly one such
    directory beside the package, no such pyproject.toml) asks
    importlib.metadata."""
    import os

    site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefix = DISTRIBUTION.replace("-", "_") + "-"
    try:
        beside = [name for name in os.listdir(site) if name.lower().startswith(prefix) and name.endswith(".dist-info")]
    except OSError:
        beside = []
    if len(beside) == 1:
        found = _metadata_version(os.path.join(site, beside[0], "METADATA"))
        if found is not None:
            return found
    found = _pyproject_version(os.path.join(site, "pyproject.toml"))
    if found is not None:
        return found
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


def _metadata_version(path: str) -> str | None:
    """The Version header of a METADATA file (headers end at the first blank line); None without one."""
    try:
        with open(path, encoding="utf-8") as metadata:
            for line in metadata:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                if key.strip().lower() == "version" and value.strip():
                    return value.strip()
    except (OSError, UnicodeDecodeError):
        pass
    return None


def _pyproject_version(path: str) -> str | None:
    """[project] version of a pyproject.toml whose [project] name is this
    distribution's; None for any other file, or none. A line scan of the
    plain `key = "value"` form pyproject.toml writes them in (tomllib would
    cost a pass its import; anything else falls back on importlib.metadata)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as pyproject:
            table = None
            for line in pyproject:
                stripped = line.strip()
                if stripped.startswith("["):
                    table = stripped
                    continue
                key, sep, value = stripped.partition("=")
                value = value.strip()
                if table == "[project]" and sep and len(value) >= 2 and value[0] == value[-1] == '"':
                    fields.setdefault(key.strip(), value[1:-1])
    except (OSError, UnicodeDecodeError):
        return None
    version = fields.get("version")
    return version if fields.get("name") == DISTRIBUTION and version else None
