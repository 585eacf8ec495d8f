"""Real implementations of the ports in `reconciler.ports`. Only `reconciler.cli` wires them in."""
