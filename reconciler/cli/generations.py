"""fabric generations: the generations under the state directory, newest last.

NUMBER  CREATED                    DIGEST        FILES  STATE
3       2026-11-29T18:00:00+00:00  5f0c1a2b9e3d  7      current, good
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reconciler.cli import EXIT_OK
from reconciler.engine.apply import STATE_DIR, GenerationStore, list_generations
from reconciler.wiring import local_tree


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generations", help="list the generations this host has written")
    p.add_argument("--root", metavar="DIR", type=Path, default=Path("/"), help="root of the files (default /)")
    p.add_argument("--state-dir", metavar="DIR", default=STATE_DIR, help=f"relative to the root (default: {STATE_DIR})")
    p.add_argument("--json", action="store_true", help="print them as JSON")
    p.set_defaults(func=run)


def state_text(current: bool, good: bool) -> str:
    if current and good:
        return "current, good"
    if current:
        return "current, not activated"
    if good:
        return "good"
    return ""


def run(args: argparse.Namespace) -> int:
    infos = list_generations(GenerationStore(local_tree(args.root), args.state_dir))
    if args.json:
        print(
            json.dumps(
                [
                    {"number": g.number, "created": g.created, "digest": g.digest, "files": g.artifacts, "current": g.current, "good": g.good}
                    for g in infos
                ],
                indent=2,
            )
        )
        return EXIT_OK
    if not infos:
        print("no generations yet")
        return EXIT_OK
    print(f"{'NUMBER':<7} {'CREATED':<26} {'DIGEST':<13} {'FILES':<6} STATE")
    for g in infos:
        print(f"{g.number:<7} {g.created:<26} {g.digest[:12]:<13} {g.artifacts:<6} {state_text(g.current, g.good)}".rstrip())
    return EXIT_OK
