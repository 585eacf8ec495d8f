"""fabric: a self-adapting compute fabric, reconciled by a systemd timer on every host."""

__version__ = "0.1.0"
