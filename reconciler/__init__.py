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
    Anything else (an editable install, whose metadata lives elsewhere; not
    exactly one such directory beside the package) asks importlib.metadata."""
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
