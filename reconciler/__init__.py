"""fabric: a self-adapting compute fabric, reconciled by a systemd timer on every host."""

from importlib.metadata import PackageNotFoundError, version

try:
    # The version is written in pyproject.toml only; the installed metadata carries it.
    __version__ = version("fabric-reconciler")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
