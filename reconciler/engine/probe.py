"""Collect the raw outputs of every fact from the live machine, through ports.

Commands go through `CommandRunner` (no shell, a timeout each) and files
through `FileReader`, so this module does no I/O of its own and the tests drive
it with fakes. A source that is not installed, fails, or hangs leaves its
reason in `RawCapture.errors`; nothing here raises for a bad machine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from reconciler.core.probe.facts import FACTS, Command, DriListing, Fact, File, Inputs, PerRenderNode, Source, SysfsPci
from reconciler.core.probe.parsers import VAINFO_HEADER, ParseError, format_sysfs_pci_line, parse_dri, pci_slot_in_path
from reconciler.core.probe.raw import RawCapture
from reconciler.digests import sha256 as _sha256

if TYPE_CHECKING:
    # Types only: a memoized pass probes live through this module and must not import the ports' models.
    from reconciler.ports import CommandRunner, FileReader, ProbeFiles


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


def _collect(fact: Fact, runner: CommandRunner, files: FileReader, outputs: dict[str, str], errors: dict[str, str]) -> None:
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


def collect_live(runner: CommandRunner, files: FileReader, facts: tuple[Fact, ...] = FACTS) -> RawCapture:
    outputs: dict[str, str] = {}
    errors: dict[str, str] = {}
    for fact in facts:
        _collect(fact, runner, files, outputs, errors)
    return RawCapture(outputs, errors)


class LiveProbe(NamedTuple):
    """A live probe, and for each fact whose command declares its inputs
    (`reusable`) the stamp of those inputs as it ran (or was reused). (A
    NamedTuple: a frozen dataclass costs every memoized pass's import more.)"""

    capture: RawCapture
    stamps: dict[str, str]  # raw name -> the stamp of its command's inputs
    reused: tuple[str, ...] = ()  # raw names whose text is an earlier probe's (their command not run)

    def reusable(self) -> dict[str, dict[str, str | None]]:
        """What a later probe may reuse (`collect_live_reusing`): each stamped
        fact's stamp, text and error, as the pass memo keeps them."""
        out, err = self.capture.outputs, self.capture.errors
        return {raw: {"stamp": stamp, "output": out.get(raw), "error": err.get(raw)} for raw, stamp in self.stamps.items()}


def reusable_inputs(fact: Fact) -> tuple[Command, Inputs] | None:
    """The command of a fact whose only source is a command that declares its inputs."""
    if len(fact.sources) == 1:
        source = fact.sources[0]
        if isinstance(source, Command) and source.inputs is not None:
            return source, source.inputs
    return None


def collect_live_reusing(
    runner: CommandRunner, files: ProbeFiles, reuse: Mapping[str, Mapping[str, Any]] | None = None, facts: tuple[Fact, ...] = FACTS
) -> LiveProbe:
    """`collect_live`, stamping the inputs of each command that declares
    them (facts.Inputs) just before it runs: its raw text is the same. With
    `reuse` (an earlier probe's `LiveProbe.reusable`, from the pass memo),
    a command whose stamp is the one in `reuse` is not run: its text and
    error are taken from there. A stamp is taken before its command runs,
    so an input that changes while it runs makes the next stamp differ.
    Those facts are collected last (their stamps read the other raw outputs)."""
    outputs: dict[str, str] = {}
    errors: dict[str, str] = {}
    stamps: dict[str, str] = {}
    reused: list[str] = []
    later = [fact for fact in facts if reusable_inputs(fact) is not None]
    for fact in facts:
        if reusable_inputs(fact) is None:
            _collect(fact, runner, files, outputs, errors)
    for fact in later:
        command, inputs = reusable_inputs(fact) or (None, Inputs())
        assert command is not None
        stamp = input_stamp(command.argv[0], inputs, files, outputs, errors)
        stamps[fact.raw] = stamp
        earlier = (reuse or {}).get(fact.raw)
        if earlier is not None and earlier.get("stamp") == stamp:
            text, error = earlier.get("output"), earlier.get("error")
            if isinstance(text, str):
                outputs[fact.raw] = text
            if isinstance(error, str):
                errors[fact.raw] = error
            reused.append(fact.raw)
            continue
        _collect(fact, runner, files, outputs, errors)
    return LiveProbe(RawCapture(outputs, errors), stamps, tuple(reused))


def input_stamp(program: str, inputs: Inputs, files: ProbeFiles, outputs: Mapping[str, str], errors: Mapping[str, str]) -> str:
    """One digest of a command's program (real path and stat) and its `inputs` as they are now."""

    def attempt(read: Any, path: str) -> str:
        try:
            return str(read(path))
        except OSError as exc:
            return f"unreadable: {exc.errno}"

    parts: list[Any] = [["program", program, files.program(program)]]
    parts += [["raw", raw, outputs.get(raw), errors.get(raw)] for raw in inputs.raws]
    parts += [["file", path, attempt(files.stat, path)] for path in inputs.files]
    parts += [["content", path, attempt(files.read_text, path)] for path in inputs.contents]
    parts += [["block mounts", path, block_mounts(attempt(files.read_text, path))] for path in inputs.block_mounts]
    for directory, names in inputs.entries:
        try:
            entries = files.list_dir(directory)
        except OSError as exc:
            parts.append(["entries", directory, f"unreadable: {exc.errno}"])
            continue
        for entry in entries:
            path = f"{directory}/{entry}"
            parts.append(["entry", path, attempt(files.read_link, path), [attempt(files.read_text, f"{path}/{name}") for name in names]])
    return _sha256(json.dumps(parts).encode()).hexdigest()


def block_mounts(mountinfo: str) -> list[str]:
    """The lines of a mountinfo file that mount a block device's file system
    (proc(5): `ID PARENT MAJOR:MINOR ROOT POINT OPTIONS [TAGS] - TYPE SOURCE
    SUPER`): a device of a major other than 0, or a source under /dev/ (a
    btrfs subvolume's device number is anonymous, its source is not)."""
    kept = []
    for line in mountinfo.splitlines():
        fields = line.split()
        _, dash, after = line.partition(" - ")
        source = after.split()[1] if dash and len(after.split()) > 1 else ""
        if len(fields) > 2 and (not fields[2].startswith("0:") or source.startswith("/dev/")):
            kept.append(line)
    return kept
