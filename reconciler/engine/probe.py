"""Collect the raw outputs of every fact from the live machine, through ports.

Commands go through `CommandRunner` (no shell, a timeout each) and files
through `FileReader`, so this module does no I/O of its own and the tests drive
it with fakes. A source that is not installed, fails, or hangs leaves its
reason in `RawCapture.errors`; nothing here raises for a bad machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reconciler.core.probe.facts import FACTS, Command, DriListing, Fact, File, PerRenderNode, Source, SysfsPci
from reconciler.core.probe.parsers import VAINFO_HEADER, ParseError, format_sysfs_pci_line, parse_dri, pci_slot_in_path
from reconciler.core.probe.raw import RawCapture

if TYPE_CHECKING:
    # Types only: a memoized pass probes live through this module and must not import the ports' models.
    from reconciler.ports import CommandRunner, FileReader


def _oserror(path: str, exc: OSError) -> str:
    return f"{path}: {exc.strerror or type(exc).__name__}"


def _run(runner: CommandRunner, argv: tuple[str, ...], timeout: float) -> tuple[str | None, str | None]:
    """(text, error): text is what it printed (even on failure), error why it is unusable."""
    result = runner.run(argv, timeout=timeout)
    if result.missing or result.timed_out:
        return None, result.failure()
    text = result.stdout
    if result.returncode != 0 and result.stderr.strip():
        text = text + ("\n" if text and not text.endswith("\n") else "") + result.stderr
    return text, result.failure()


def _list_dri(files: FileReader, path: str) -> tuple[str | None, str | None]:
    try:
        names = files.list_dir(path)
    except OSError as exc:
        return None, _oserror(path, exc)
    lines = [n for n in names if n != "by-path"]
    if "by-path" in names:
        try:
            links = files.list_dir(f"{path}/by-path")
        except OSError:
            links = []
        for link in links:
            try:
                lines.append(f"by-path/{link} -> {files.read_link(f'{path}/by-path/{link}')}")
            except OSError:
                continue
    return "".join(f"{line}\n" for line in lines), None


def _per_render_node(runner: CommandRunner, source: PerRenderNode, dri_text: str | None) -> tuple[str | None, str | None]:
    try:
        nodes = parse_dri(dri_text).render_nodes if dri_text is not None else ()
    except ParseError:
        nodes = ()
    if not nodes:
        return None, "no render node in /dev/dri"
    sections: list[str] = []
    for node in nodes:
        device = f"/dev/dri/{node}"
        argv = tuple(a.replace("{device}", device) for a in source.argv)
        text, error = _run(runner, argv, source.timeout)
        if text is None:
            # Not installed or hung: the same for every node, stop here.
            return None, error
        sections.append(f"{VAINFO_HEADER}{device}\n{text}")
    # A node whose driver failed (vainfo exits non-zero) is the parser's
    # business: it keeps the nodes that answered and names the ones that did
    # not, with libva's own message, which says more than the exit status.
    return "".join(s if s.endswith("\n") else s + "\n" for s in sections), None


def _read_optional(files: FileReader, path: str) -> str | None:
    try:
        return files.read_text(path).strip()
    except OSError:
        return None


def _sysfs_pci(files: FileReader, source: SysfsPci) -> tuple[str | None, str | None]:
    """One line per PCI device (parsers.format_sysfs_pci_line). A device file
    that cannot be read is left out of its line; the parser judges the line."""
    try:
        slots = files.list_dir(source.devices)
    except OSError as exc:
        return None, _oserror(source.devices, exc)
    drm: dict[str, list[str]] = {}
    try:
        drm_names = files.list_dir(source.drm)
    except OSError:
        drm_names = []  # no DRM class at all: devices without nodes
    for name in drm_names:
        # card1, renderD128; not the connectors (card1-DP-1) nor "version".
        if not (name.startswith("card") or name.startswith("renderD")) or "-" in name:
            continue
        try:
            # /sys/class/drm/card1 -> ../../devices/pci0000:00/.../0000:03:00.0/drm/card1
            slot = pci_slot_in_path(files.read_link(f"{source.drm}/{name}"))
        except OSError:
            continue
        if slot is not None:
            drm.setdefault(slot, []).append(name)
    lines = []
    for slot in slots:
        base = f"{source.devices}/{slot}"
        sub_vendor = _read_optional(files, f"{base}/subsystem_vendor")
        sub_device = _read_optional(files, f"{base}/subsystem_device")
        try:
            driver: str | None = files.read_link(f"{base}/driver").rstrip("/").rsplit("/", 1)[-1]
        except OSError:
            driver = None  # no driver bound
        fields = {
            "class": _read_optional(files, f"{base}/class"),
            "vendor": _read_optional(files, f"{base}/vendor"),
            "device": _read_optional(files, f"{base}/device"),
            "subsystem": f"{sub_vendor}:{sub_device}" if sub_vendor and sub_device else None,
            "driver": driver,
        }
        lines.append(format_sysfs_pci_line(slot, fields, drm.get(pci_slot_in_path(slot) or slot, [])))
    return "".join(lines), None


def _read(source: Source, runner: CommandRunner, files: FileReader, outputs: dict[str, str]) -> tuple[str | None, str | None]:
    if isinstance(source, Command):
        return _run(runner, source.argv, source.timeout)
    if isinstance(source, File):
        try:
            return files.read_text(source.path), None
        except OSError as exc:
            return None, _oserror(source.path, exc)
    if isinstance(source, DriListing):
        return _list_dri(files, source.path)
    if isinstance(source, PerRenderNode):
        return _per_render_node(runner, source, outputs.get("dri"))
    if isinstance(source, SysfsPci):
        return _sysfs_pci(files, source)
    raise TypeError(f"unknown source {source!r}")


def collect_live(runner: CommandRunner, files: FileReader, facts: tuple[Fact, ...] = FACTS) -> RawCapture:
    outputs: dict[str, str] = {}
    errors: dict[str, str] = {}
    for fact in facts:
        first_error: str | None = None
        for source in fact.sources:
            text, error = _read(source, runner, files, outputs)
            if error is None and text is not None:
                outputs[fact.raw] = text
                first_error = None
                break
            if first_error is None:
                first_error = error
                if text is not None:
                    # Keep the failed command's own words for the capture.
                    outputs[fact.raw] = text
        else:
            if first_error is not None:
                errors[fact.raw] = first_error
    return RawCapture(outputs, errors)
