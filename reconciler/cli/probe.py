"""fabric probe: what this machine is and can do (tier, labels, limitations).

fabric probe                  probe this machine, print a summary
fabric probe --json           the HostFacts JSON the registry stores
fabric probe --capture DIR    also keep the raw outputs in DIR (new or empty)
fabric probe --replay DIR     re-parse a capture instead of probing
fabric probe --host NAME      report as fabric host NAME (k3s host name, role label)
"""

from __future__ import annotations

import argparse
import re

from reconciler.cli import EXIT_OK, InvalidInput
from reconciler.core.desired.model import HostFacts
from reconciler.core.probe import RawCapture, facts_from_capture
from reconciler.engine.probe import collect_live
from reconciler.ports import CaptureError
from reconciler.wiring import capture_store, command_runner, local_files

_HOST_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


def _host_name(value: str) -> str:
    if not _HOST_RE.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a host name (lowercase letters, digits, '-')")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="probe this machine's hardware: tier, labels, limitations")
    p.add_argument("--json", action="store_true", help="print the HostFacts JSON instead of a summary")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--capture", metavar="DIR", help="save the raw outputs in DIR (must be new or empty)")
    source.add_argument("--replay", metavar="DIR", help="re-parse the raw outputs saved in DIR")
    p.add_argument("--host", metavar="NAME", type=_host_name, help="the fabric host name to report as")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store = capture_store()
    try:
        if args.replay:
            capture = RawCapture(*store.load(args.replay))
        else:
            capture = collect_live(command_runner(), local_files())
            if args.capture:
                store.save(args.capture, capture.outputs, capture.errors)
    except CaptureError as exc:
        raise InvalidInput(f"fabric probe: {exc}") from None
    facts = facts_from_capture(capture, host=args.host)
    if args.json:
        print(facts.model_dump_json(indent=2))
    else:
        print(summary(facts))
        if args.capture:
            print(f"\nraw outputs saved in {args.capture}")
    return EXIT_OK


def summary(facts: HostFacts) -> str:
    """A human-readable account of one probe."""
    hw = facts.hardware
    rows: list[tuple[str, str]] = [("host", f"{facts.k3s_hostname} (tailnet name {facts.tailnet_name})")]
    if facts.os is not None:
        rows.append(("os", facts.os.name or facts.os.id))
    rows.append(("arch", hw.arch or "unknown"))
    rows.append(("cpu", f"{hw.cpu_cores} threads" if hw.cpu_cores else "unknown"))
    rows.append(("memory", f"{hw.memory_mib} MiB" if hw.memory_mib else "unknown"))
    if hw.gpus:
        for i, gpu in enumerate(hw.gpus):
            parts = [gpu.model, "integrated" if gpu.integrated else "discrete"]
            if gpu.vram_mib:
                parts.append(f"{gpu.vram_mib} MiB")
            parts.append(f"tier {gpu.tier}")
            if gpu.pci_slot:
                parts.append(f"pci {gpu.pci_slot}")
            if gpu.render_node:
                parts.append(gpu.render_node)
            if gpu.driver:
                parts.append(f"driver {gpu.driver}")
            rows.append(("gpus" if i == 0 else "", ", ".join(parts)))
    else:
        rows.append(("gpus", "none usable"))
    if hw.storage:
        for i, disk in enumerate(hw.storage):
            rows.append(("storage" if i == 0 else "", f"{disk.name} {disk.type} {disk.size_gib} GiB" + (f" on {disk.mount}" if disk.mount else "")))
    else:
        rows.append(("storage", "unknown"))
    rows.append(("encoders", ", ".join(hw.ffmpeg) if hw.ffmpeg else "no hardware encoder"))
    rows.append(("framebuffer", f"{hw.framebuffer.device} {hw.framebuffer.resolution}" if hw.framebuffer else "none"))
    if facts.tailscale_ip:
        path = {True: "relayed via DERP", False: "direct", None: "path unknown"}[facts.tailscale_relayed]
        rows.append(("tailscale", f"{facts.tailscale_ip}, {path}"))
    else:
        rows.append(("tailscale", "not connected"))
    rows.append(("tier", facts.tier))
    for i, (key, value) in enumerate(sorted(facts.labels.items())):
        rows.append(("labels" if i == 0 else "", f"{key}={value}"))
    limits = facts.limitations
    tasks = f"{limits.max_concurrent_tasks} task{'s' if limits.max_concurrent_tasks != 1 else ''}"
    rows.append(("limits", f"{tasks} at once (ceiling {limits.max_concurrent_ceiling})"))
    rows.extend(("", f"  {note}") for note in limits.notes)
    if facts.missing:
        for i, (fact, reason) in enumerate(facts.missing.items()):
            rows.append(("missing" if i == 0 else "", f"{fact}: {reason}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}".rstrip() for key, value in rows)
