"""Desired-state and live-state models.

Pure: pydantic models and validators only. Everything here can be built from
plain dicts (TOML, JSON), and every rule a human could break in a host file is a
validator here, so `fabric validate` reports it with the key path.

Desired state  = what an operator declares in git (`FleetConfig`, `HostConfig`,
                 combined into `DesiredState` by `reconciler.core.desired.load`).
Live state     = what a host observes and reports (`HostFacts` from the probe).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    WithJsonSchema,
    model_serializer,
    model_validator,
)

from reconciler.core.desired.secrets import argument_reason, environment_secret, free_text_reason, secret_value_kind

# --------------------------------------------------------------------------
# Tiers

Tier = Literal[
    "gpu_cuda",
    "gpu_vaapi",
    "gpu_apu",
    "cpu_ffmpeg",
    "batch",
    "ethernet",
    "framebuffer",
    "wasm",
    "dsp",
    "esp32",
    "relay",
]

# Best first, with the seed's scores (gpu_cuda 10 ... relay 0).
TIER_ORDER: tuple[Tier, ...] = get_args(Tier)
TIER_SCORE: dict[str, int] = {t: len(TIER_ORDER) - 1 - i for i, t in enumerate(TIER_ORDER)}

# A host's cost class, cheapest first: placement prefers a cheaper host among
# hosts of the same tier (reconciler.core.scheduling.placement). "free": no
# bill at all (an always-free cloud box); "owned": hardware at hand, paid for
# whether it works or not; "paid": billed while it runs work (a spill box).
Cost = Literal["free", "owned", "paid"]
COST_ORDER: tuple[Cost, ...] = get_args(Cost)
COST_RANK: dict[str, int] = {c: i for i, c in enumerate(COST_ORDER)}
# A host file without `cost`: owned. It claims no saving and no bill, so a
# fleet that marks no host plans exactly as before cost existed, and only a
# host an operator marks paid is kept for overflow.
DEFAULT_COST: Cost = "owned"
# Where cost ranks among the placement rules ([scheduler] cost_order, or a
# service's own): "within_tier" (default) keeps the tier order first and lets
# the cheaper host win among hosts of one tier; "before_tier" takes the
# cheapest class with room first, then the tier order (down to the floor),
# for work that does not care for speed.
CostOrder = Literal["within_tier", "before_tier"]

Arch = Literal["x86_64", "aarch64"]
ARCHES: tuple[Arch, ...] = get_args(Arch)
# A service's command or image is keyed by architecture, or "any" for both.
RunsOn = Literal["x86_64", "aarch64", "any"]

GpuVendor = Literal["nvidia", "amd", "intel", "other"]
StorageType = Literal["nvme", "ssd", "hdd", "other"]


def tier_score(tier: str) -> int:
    """10 for gpu_cuda down to 0 for relay."""
    return TIER_SCORE[tier]


# --------------------------------------------------------------------------
# Safe scalar types. Names end up in unit names, file names, Caddy and nft
# text, so they are restricted to a character set that cannot escape any of
# those contexts (no '/', '..', whitespace, quotes, braces, ';').

NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?$"
_NAME_RE = re.compile(NAME_PATTERN)
_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$")
_LABEL_KEY_RE = re.compile(r"^(?:[a-z0-9.-]{1,253}/)?[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9_.:-]{0,61}[A-Za-z0-9])?)?$")
# An argv element or environment value: printable, no newlines, no NUL. Quotes
# are allowed; the renderer quotes for systemd.
_ARG_RE = re.compile(r"^[^\x00-\x1f\x7f]*$")
_IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$")
_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,127}$")
# A systemd service unit name (systemd.unit(5): at most 255 characters of
# ASCII letters, digits, ':', '-', '_', '.', '\\' and '@'; no '\\' here, it
# would need escaping in every text the name lands in).
_SERVICE_UNIT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_.@-]{0,246}\.service$")


def is_name(value: str) -> bool:
    """A safe name (host, service, lane): one that may become part of a path."""
    return bool(_NAME_RE.match(value))


def _name(value: str) -> str:
    if not is_name(value):
        raise ValueError(
            f"{value!r} is not a safe name (lowercase letters, digits, '-' and '_', "
            "starting and ending with a letter or digit, at most 63 characters)"
        )
    return value


_HTTP_URL_RE = re.compile(r"^https?://[A-Za-z0-9._~:/?#@!&'()*+,;=%\[\]-]+$")


def _http_url(value: str) -> str:
    if not _HTTP_URL_RE.match(value):
        raise ValueError(f"{value!r} is not an http:// or https:// URL (no blanks, quotes or backslashes)")
    return value


def _hostname(value: str) -> str:
    if not _HOSTNAME_RE.match(value):
        raise ValueError(f"{value!r} is not a valid DNS host name (lowercase letters, digits, '-' and '.')")
    return value


def _abs_path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path")
    if not _ARG_RE.match(value) or any(c in value for c in " \"'{};$`\\"):
        raise ValueError(f"{value!r} contains characters not allowed in a path (whitespace, quotes, braces, ';', '$', '`', '\\')")
    if ".." in PurePosixPath(value).parts:
        raise ValueError(f"{value!r} must not contain '..'")
    return value


# Directories no path the desired state hands to a unit may lie in, whatever a
# host's node.toml allows: a commit must not make root chown /etc/systemd/system
# (a scratch dir), bind-mount the fabric's state, or hand a dynamic user
# /etc/shadow or the plan key through LoadCredential=.
SYSTEM_DIRECTORIES = (
    "/etc",
    "/usr",
    "/boot",
    "/root",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/proc",
    "/sys",
    "/dev",
    "/run/systemd",
    "/var/lib/systemd",
    "/var/lib/fabric",
)


def lies_in(path: str, directory: str) -> bool:
    """Whether `path` is `directory` or lies below it (by path components: /etcetera is not in /etc)."""
    target, parent = PurePosixPath(path), PurePosixPath(directory)
    return target == parent or parent in target.parents


def _unit_path(value: str) -> str:
    """A path a unit gets from the desired state: absolute, and outside every system directory."""
    _abs_path(value)
    if PurePosixPath(value) == PurePosixPath("/"):
        raise ValueError("'/' is not a path a unit may be handed")
    for system in SYSTEM_DIRECTORIES:
        if lies_in(value, system):
            raise ValueError(
                f"{value!r} lies in {system}, a system directory: no path the desired state hands to a unit may ({', '.join(SYSTEM_DIRECTORIES)})"
            )
    return value


def _arg(value: str) -> str:
    if not _ARG_RE.match(value):
        raise ValueError("control characters (newlines, NUL) are not allowed")
    return value


def _no_secret_argument(value: str) -> str:
    kind = secret_value_kind(value)
    if kind is not None:
        raise ValueError(argument_reason(kind))
    return value


def _no_secret_text(value: str) -> str:
    kind = secret_value_kind(value)
    if kind is not None:
        raise ValueError(free_text_reason(kind))
    return value


def _image(value: str) -> str:
    if not _IMAGE_RE.match(value):
        raise ValueError(f"{value!r} is not a valid image reference")
    return value


def _label_key(value: str) -> str:
    if not _LABEL_KEY_RE.match(value):
        raise ValueError(f"{value!r} is not a valid label key")
    return value


def _label_value(value: str) -> str:
    if not _LABEL_VALUE_RE.match(value):
        raise ValueError(f"{value!r} is not a valid label value (letters, digits, '-', '_', '.', ':')")
    return value


def _env_name(value: str) -> str:
    if not _ENV_NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a valid environment variable name (A-Z, 0-9, '_')")
    return value


def _service_unit(value: str) -> str:
    if not _SERVICE_UNIT_RE.match(value):
        raise ValueError(f"{value!r} is not a service unit name (letters, digits, ':', '-', '_', '.', '@', ending in '.service')")
    if value.startswith("fabric-"):
        raise ValueError(f"{value!r} is one of the fabric's own units (fabric-*), not a unit of phaze's")
    return value


# Each safe type's JSON Schema (`fabric schema`, for editors) says what its
# validator checks, as far as a pattern can (no lookahead: editors' regex
# engines lack it); the validators stay the judges.
def _schema(pattern: str, description: str, **extra: Any) -> WithJsonSchema:
    # x-constraint: the words docs/reference.md shows for the pattern (a keyword validators ignore).
    return WithJsonSchema({"type": "string", "pattern": pattern, "description": description, "x-constraint": description, **extra})


Name = Annotated[str, AfterValidator(_name), _schema(NAME_PATTERN, "a safe name: a-z, 0-9, '-', '_', at most 63 characters")]
ServiceUnit = Annotated[str, AfterValidator(_service_unit), _schema(r"^[A-Za-z0-9][A-Za-z0-9:_.@-]{0,246}\.service$", "a systemd service unit name")]
HostName = Annotated[
    str,
    AfterValidator(_hostname),
    _schema(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$", "a DNS host name", maxLength=253),
]
AbsPath = Annotated[str, AfterValidator(_abs_path), _schema("^/[^\\s\"'{};$`\\\\]*$", "an absolute path")]
# A path handed to a unit (scratch dirs, tokens, credentials, NAME_FILE values).
UnitPath = Annotated[str, AfterValidator(_unit_path), _schema("^/[^\\s\"'{};$`\\\\]*$", "an absolute path outside the system directories")]
Arg = Annotated[str, AfterValidator(_arg)]
# A description and the like: any text but a secret (checked first, so no other message quotes one).
FreeText = Annotated[str, AfterValidator(_no_secret_text), AfterValidator(_arg)]
Image = Annotated[str, AfterValidator(_image), _schema(_IMAGE_RE.pattern, "an image reference")]
LabelKey = Annotated[str, AfterValidator(_label_key)]
LabelValue = Annotated[str, AfterValidator(_no_secret_text), AfterValidator(_label_value)]
EnvName = Annotated[str, AfterValidator(_env_name), _schema(_ENV_NAME_RE.pattern, "an environment variable name")]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[int, Field(ge=1, le=86_400)]
Milliseconds = Annotated[int, Field(ge=1, le=600_000)]
# An argv element is judged by value (`core.desired.secrets`) before anything
# else, so no message quotes it: a secret on a command line shows in ps and in
# the unit file.
ArgvElement = Annotated[str, AfterValidator(_no_secret_argument), AfterValidator(_arg)]
NonEmptyArgv = Annotated[list[ArgvElement], Field(min_length=1)]


class FieldProblem(ValueError):
    """A model-level rule broken by one key: `desired` appends `key` to the path."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


class Strict(BaseModel):
    """Unknown keys are errors; values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def refuse_inline_secrets(env: Any) -> Any:
    """Inline environment must not carry secrets (by name or by value,
    `core.desired.secrets`): those come as NAME_FILE paths. Runs before the
    values' own checks, so no other message quotes a secret value (a
    password given as a number, a token where a NAME_FILE path belongs)."""
    if isinstance(env, dict):
        for key, value in env.items():
            reason = environment_secret(str(key), value)
            if reason is not None:
                raise FieldProblem(str(key), reason)
    return env


def check_environment(env: dict[str, str]) -> dict[str, str]:
    """NAME_FILE values are absolute paths outside the system directories."""
    for key, value in env.items():
        if key.endswith("_FILE"):
            try:
                _unit_path(value)
            except ValueError as exc:
                raise FieldProblem(key, str(exc)) from exc
    return env


Environment = Annotated[dict[EnvName, Arg], BeforeValidator(refuse_inline_secrets), AfterValidator(check_environment)]


# --------------------------------------------------------------------------
# fabric.toml


class FleetSettings(Strict):
    name: Name = Field("fabric", description="The fleet's name.")
    domain: HostName = Field(description="The fleet's DNS domain; the fleet's own sites (the status page) live under it.")
    leader_candidates: list[Name] = Field(min_length=1, description="Hosts that campaign for leadership (the scheduler runs on the leader).")
    # Sites served for the fleet itself (status page) live under this domain.
    status_subdomain: Name = Field("status", description="Subdomain of `domain` that serves the status page.")
    # Who may read the status page (and anything else the edge serves about
    # the fleet: its hosts, load, lanes and deferred work). "tailnet" (the
    # default): the edge's Caddy answers 403 to every other source address;
    # "public" opens it to the world, and must be said explicitly.
    status_access: Literal["tailnet", "public"] = Field(
        "tailnet",
        description="Who may read the status page: tailnet (the default: Caddy refuses every source outside the tailnet with 403) or public (anyone; say so explicitly).",
    )
    capabilities_allow_from: list[Cidr] = Field(
        [],
        description="Who besides the tailnet may read the capabilities API (/api/capabilities/nodes on the status site): CIDRs. "
        "Empty (the default): the tailnet only.",
    )


class TimingSettings(Strict):
    heartbeat_s: Seconds = Field(30, description="Seconds between a node's heartbeats (one per reconcile pass).")
    node_timeout_s: Seconds = Field(90, description="Seconds without a heartbeat after which a node is offline; at least heartbeat_s.")
    # A node whose Tailscale path is relayed (DERP) gets a longer per-beat
    # timeout: 200-500 ms of DERP latency must not read as a missed beat.
    relayed_heartbeat_s: Seconds = Field(
        45,
        description="Per-beat timeout of a node whose Tailscale path is relayed (DERP): its 200-500 ms of extra latency must not read as a missed beat; at least heartbeat_s.",
    )
    missed_beats: Annotated[int, Field(ge=1, le=100)] = Field(
        3,
        description="A relayed node's timeout is relayed_heartbeat_s x missed_beats (when longer than node_timeout_s); a lower probed tier is taken after this many passes.",
    )
    drain_grace_s: Seconds = Field(
        300, description="How long a draining node keeps its work, an offline node stays before it is dead, and a dead one before it is forgotten."
    )
    liveness_s: Annotated[int, Field(ge=0, le=3600)] = Field(
        2,
        description="How often fabric-watch keeps the host's fast liveness record alive (its lapse makes the node suspected and its single-replica services hedged); 0: no fast liveness, the node timeout alone decides.",
    )
    liveness_ttl_s: Seconds = Field(6, description="How long a fast liveness record lives without a keep-alive; longer than liveness_s.")

    @model_validator(mode="after")
    def _coherent(self) -> TimingSettings:
        if self.liveness_s and self.liveness_ttl_s <= self.liveness_s:
            raise FieldProblem("liveness_ttl_s", f"{self.liveness_ttl_s} is not longer than liveness_s ({self.liveness_s})")
        if self.node_timeout_s < self.heartbeat_s:
            raise FieldProblem("node_timeout_s", f"{self.node_timeout_s} is shorter than heartbeat_s ({self.heartbeat_s})")
        if self.relayed_heartbeat_s < self.heartbeat_s:
            raise FieldProblem("relayed_heartbeat_s", f"{self.relayed_heartbeat_s} is shorter than heartbeat_s ({self.heartbeat_s})")
        return self

    def node_timeout_for(self, relayed: bool) -> int:
        if relayed:
            return max(self.node_timeout_s, self.relayed_heartbeat_s * self.missed_beats)
        return self.node_timeout_s


class EdgeSettings(Strict):
    """How the edge's Caddy moves traffic between a service's upstreams
    (rendered into every `reverse_proxy` block, templates/fabric.caddy.j2).

    In milliseconds: these are a second or so, and the whole seconds of
    `[timing]` are too coarse for them. The template says what each does in
    Caddy; the comments here say why each default is what it is.
    """

    # lb_try_duration: how long a request may wait for an upstream that
    # answers. 5 s covers a move: the edge routes to a replacement whose
    # service is still starting (a process start, a second or two) or to a
    # host that vanished (one dial_timeout_ms, then another upstream).
    retry_window_ms: Milliseconds = Field(
        5000,
        description="Caddy's lb_try_duration: how long a request may wait for an upstream that answers (covers a move to a replacement that is still starting).",
    )
    # lb_try_interval: the pause before a failed attempt is tried again. It
    # is the delay a request pays when it hit a dead upstream, and how late
    # a waiting request sees an upstream come back; 100 ms keeps both small,
    # and 10 tries a second per waiting request cost nothing (while every
    # upstream is left out, a try is a lookup, not a dial).
    retry_interval_ms: Milliseconds = Field(
        100, description="Caddy's lb_try_interval: the pause before a failed attempt is tried again; shorter than retry_window_ms."
    )
    # fail_duration: how long an upstream that failed a request is left out.
    # 250 ms. In a move, the edge routes to the replacement as soon as the
    # plan says so, often before its service listens: each refused attempt
    # left it out for this long, and the first answer came up to this long
    # after it listened (1000 ms was most of what remained between a node's
    # lapse and its traffic served elsewhere: bench/convergence, issue 14).
    # The cost: a dead upstream is tried again 4 times a second; one that
    # refuses costs a request retry_interval_ms, one that vanished a
    # dial_timeout_ms (the request then goes elsewhere), until the node
    # timeout takes it out of the plan.
    fail_memory_ms: Milliseconds = Field(250, description="Caddy's fail_duration: how long an upstream that failed a request is left out.")
    # transport dial_timeout: how long a connection to an upstream may take
    # before the attempt counts as failed. 1 s is twice the slowest tailnet
    # round trip (a DERP relay adds 200-500 ms, see relayed_heartbeat_s);
    # Caddy's default of 3 s would hold each request that long per vanished host.
    dial_timeout_ms: Milliseconds = Field(
        1000,
        description="Caddy's transport dial_timeout: how long a connection to an upstream may take before the attempt fails; shorter than retry_window_ms.",
    )

    @model_validator(mode="after")
    def _coherent(self) -> EdgeSettings:
        if self.retry_interval_ms >= self.retry_window_ms:
            raise FieldProblem(
                "retry_interval_ms",
                f"{self.retry_interval_ms} is not shorter than retry_window_ms ({self.retry_window_ms}): no request would be tried twice",
            )
        if self.dial_timeout_ms >= self.retry_window_ms:
            raise FieldProblem(
                "dial_timeout_ms",
                f"{self.dial_timeout_ms} is not shorter than retry_window_ms ({self.retry_window_ms}): a request to an unreachable upstream could not be tried elsewhere",
            )
        return self


class FlapSettings(Strict):
    window_s: Seconds = Field(300, description="Window in which a node's state toggles are counted.")
    toggles: Annotated[int, Field(ge=2, le=100)] = Field(3, description="Toggles within window_s that make a node flapping.")
    hold_off_s: Seconds = Field(600, description="How long a flapping node is held off new placements.")


class RegistrySettings(Strict):
    backend: Literal["sqlite", "etcd"] = Field("sqlite", description="Where the live state lives: sqlite (one host, embedded) or etcd (a fleet).")
    path: AbsPath = Field("/var/lib/fabric/registry.sqlite", description="The sqlite registry's file.")
    endpoints: list[Annotated[str, StringConstraints(pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+$")]] = Field(
        [], description="etcd endpoints (http:// or https://); required with backend etcd."
    )
    prefix: Annotated[str, StringConstraints(pattern=r"^/[a-z0-9/_-]*$")] = Field("/fabric", description="Key prefix of the fabric's keys in etcd.")
    ca_file: AbsPath | None = Field(None, description="CA certificate that signs etcd's server certificate (with cert_file and key_file).")
    cert_file: AbsPath | None = Field(None, description="This host's etcd client certificate (CN = host name).")
    key_file: AbsPath | None = Field(None, description="The client certificate's private key.")
    joining_cert_file: AbsPath | None = Field(
        None,
        description="The joining identity's etcd client certificate (CN = fabric-joining): a machine without a host file "
        "reports itself pending with it, and it may write only the pending reports; unset: cert_file.",
    )
    joining_key_file: AbsPath | None = Field(None, description="The joining identity's private key (with joining_cert_file).")

    @model_validator(mode="after")
    def _etcd_needs_endpoints(self) -> RegistrySettings:
        if (self.joining_cert_file is None) != (self.joining_key_file is None):
            raise FieldProblem(
                "joining_key_file" if self.joining_key_file is None else "joining_cert_file", "joining_cert_file and joining_key_file go together"
            )
        if self.backend == "etcd" and not self.endpoints:
            raise FieldProblem("endpoints", "backend 'etcd' needs at least one endpoint")
        tls = {"ca_file": self.ca_file, "cert_file": self.cert_file, "key_file": self.key_file}
        if any(tls.values()) and not all(tls.values()):
            missing = next(k for k, v in tls.items() if v is None)
            raise FieldProblem(missing, "ca_file, cert_file and key_file go together")
        return self


class SchedulerSettings(Strict):
    # highest_tier: the seed's rule (best tier first). best_fit: the lowest tier
    # that satisfies, so CUDA boxes stay free for CUDA-only work.
    strategy: Literal["highest_tier", "best_fit"] = Field(
        "highest_tier",
        description="highest_tier: the best tier first; best_fit: the lowest tier that satisfies, so CUDA boxes stay free for CUDA-only work.",
    )
    # Cost among the rules (CostOrder): within_tier by default, since a tier
    # is a speed promise a service asked for; a service that does not care
    # for speed says cost_order = "before_tier" itself.
    cost_order: CostOrder = Field(
        "within_tier",
        description="Where a host's cost class ranks among the placement rules: within_tier (the best tier first, then the cheaper host), before_tier (the cheaper host first, down to the floor).",
    )
    # multi-compute.md's staleness gate: a lane job reaches the local lane once
    # it has waited this long with every cloud lane full.
    local_spill_after_s: Seconds = Field(
        900, description="Staleness gate: a lane job reaches the local lane once it has waited this long with every cloud lane full."
    )
    # ...or once this many cloud attempts failed.
    cloud_attempts: Annotated[int, Field(ge=1, le=100)] = Field(
        3, description="A lane job also reaches the local lane once this many cloud attempts failed."
    )
    # phaze's PHAZE_CLOUD_ROUTE_THRESHOLD_SEC: a lane job whose duration is
    # below this many seconds goes to the local lane only. 0: every job may go
    # to the cloud.
    cloud_route_threshold_s: Annotated[int, Field(ge=0, le=86_400)] = Field(
        0,
        description="phaze's PHAZE_CLOUD_ROUTE_THRESHOLD_SEC: a lane job shorter than this goes to the local lane only; 0: every job may go to the cloud.",
    )
    # The fabric's own lanes (core.scheduling.lanes, crashed runs): how often
    # their SAQ workers write their stats (saq's worker_info timer, default
    # 10 s; the row lives 1 s longer) ...
    lane_worker_beat_s: Seconds = Field(
        10, description="The fabric's own lanes: how often their SAQ workers write their stats (saq's worker_info timer)."
    )
    # ... and how long past that row's expiry a worker may stay silent before
    # the jobs it runs count as crashed and wait again.
    lane_crash_grace_s: Annotated[int, Field(ge=0, le=3_600)] = Field(
        2,
        description="The fabric's own lanes: how long past its stats row's expiry a worker may stay silent before its jobs count as crashed and wait again.",
    )
    # The SAQ heartbeat a dispatched job carries (saq's Job.heartbeat): a
    # worker must touch its job (`await job.update()`) at least this often,
    # or saq's sweep and the dispatcher end the run. 0: none.
    lane_job_heartbeat_s: Annotated[int, Field(ge=0, le=86_400)] = Field(
        0, description="The SAQ heartbeat each dispatched job of the fabric's own lanes carries; its function must touch its job more often. 0: none."
    )


# Directories a cloud hook's program may not be named in: scratch space any
# user or unit may write (a commit could name a program it planted there), the
# default prefixes a host hands to units (core.desired.confinement), and
# NixOS's profile, which exists on NixOS alone while a leader candidate may
# run any distribution (name such a program by its PATH name instead).
HOOK_PROGRAM_REFUSED = (
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/run/user",
    "/home",
    "/run/secrets",
    "/run/credentials",
    "/var/lib/phaze",
    "/srv",
    "/run/current-system",
)
_PROGRAM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")
# A hook's own time budget, and its ceiling: a hook deploys a worker group, it
# is not one.
HOOK_TIMEOUT_S = 60
HOOK_TIMEOUT_MAX_S = 3_600


def hook_program(value: str) -> str:
    """A cloud hook's program: a name looked up on the leader's PATH, or an
    absolute path outside the system directories a commit could write to
    (HOOK_PROGRAM_REFUSED); raises ValueError saying why not."""
    if "/" not in value:
        if not _PROGRAM_NAME_RE.match(value):
            raise ValueError(f"{value!r} is not a program name (letters, digits, '.', '_', '+', '-') or an absolute path")
        return value
    _abs_path(value)
    for refused in HOOK_PROGRAM_REFUSED:
        if lies_in(value, refused):
            why = "exists on NixOS alone" if refused == "/run/current-system" else "is writable by users or units"
            raise ValueError(f"{value!r} lies in {refused}, which {why}: name the program by its PATH name (e.g. {PurePosixPath(value).name!r})")
    return value


class CloudHook(Strict):
    """One cloud tier's hook: a transient systemd unit on the leader (systemd-run:
    a dynamic user, no capabilities, a private /tmp, the system read-only)."""

    command: NonEmptyArgv = Field(
        description=(
            "The argv (never through a shell of the fabric's); its program by PATH name (looked up on the leader's PATH) "
            "or absolute path (not under /tmp, /home, /srv, /run/secrets, /run/current-system, ...)."
        )
    )
    credentials: dict[EnvName, UnitPath] = Field(
        {},
        description=(
            "NAME -> a file on the leader (never in a system directory), handed to the hook as the systemd credential NAME "
            "(LoadCredential=); the hook finds its path in $NAME_FILE and $CREDENTIALS_DIRECTORY/NAME, never its value."
        ),
    )
    working_directory: UnitPath | None = Field(None, description="The hook's working directory on the leader (read-only to it; unset: '/').")
    timeout_s: Annotated[int, Field(ge=1, le=HOOK_TIMEOUT_MAX_S)] = Field(
        HOOK_TIMEOUT_S, description="The hook's own time budget (its unit's RuntimeMaxSec=): systemd stops it then."
    )
    group: Name | None = Field(
        None,
        description=(
            "The worker group ([groups.<name>], of this hook's tier) whose members the workers this hook starts join as; "
            "a run of the hook activates the group again after it was deactivated."
        ),
    )

    @model_validator(mode="after")
    def _program(self) -> CloudHook:
        try:
            hook_program(self.command[0])
        except ValueError as exc:
            raise FieldProblem("command.0", str(exc)) from exc
        return self


def _hook_table(value: Any) -> Any:
    if isinstance(value, list):
        raise ValueError(
            "a cloud hook is a table: command = [argv], credentials = { NAME = path }, working_directory, timeout_s "
            "(write [scaling.cloud_hooks.<tier>] with command = the argv)"
        )
    return value


class ScalingSettings(Strict):
    queue_high: Annotated[int, Field(ge=1)] = Field(10, description="Queue depth above which a burst begins (once held for burst_window_s).")
    burst_window_s: Seconds = Field(30, description="How long the queue depth must stay above queue_high to be a burst.")
    group_interval_s: Seconds = Field(60, description="At most one new worker group per tier, and one re-activation per node, in this many seconds.")
    scale_up_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        0.8,
        description="A node's utilization (in_flight / max_concurrent_tasks) above which its concurrency is raised; above scale_down_utilization.",
    )
    scale_up_window_s: Seconds = Field(300, description="How long a node's utilization must stay above scale_up_utilization.")
    scale_down_utilization: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.1, description="A node's utilization below which its worker group is scaled down."
    )
    scale_down_window_s: Seconds = Field(
        900, description="How long a node's utilization must stay below scale_down_utilization (with no burst under way)."
    )
    # Per cloud tier, the hook that deploys one more worker group (e.g. a
    # workflow dispatch), run as a transient sandboxed unit on the leader.
    cloud_hooks: dict[Tier, Annotated[CloudHook, BeforeValidator(_hook_table)]] = Field(
        {},
        description="Per cloud tier, the hook that deploys one more worker group (a workflow dispatch, say), run on the leader as a transient sandboxed systemd unit.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ScalingSettings:
        if self.scale_down_utilization >= self.scale_up_utilization:
            raise FieldProblem("scale_down_utilization", "must be below scale_up_utilization")
        return self


DEFAULT_GROUP_IDLE_WINDOW_S = 300
DEFAULT_GROUP_MAX_MEMBERS = 4


class WorkerGroup(Strict):
    """A group of ephemeral members: the workers a cloud hook starts join the
    fleet as its members (reconciler.core.scheduling.groups). Declared here, in
    git, it is what admits them: a member proves only which group it belongs
    to (the group's registry identity); its tier, labels, limits and cost are
    the group's, never what the member says."""

    tier: Tier = Field(description="The tier every member of the group has (never the tier a member reports).")
    max_members: Annotated[int, Field(ge=1, le=256)] = Field(
        DEFAULT_GROUP_MAX_MEMBERS, description="At most this many members are admitted at once (the earliest joined first); the rest are refused."
    )
    labels: dict[LabelKey, LabelValue] = Field({}, description="Labels every member has (a service's labels must be among them to run there).")
    max_concurrent_tasks: Annotated[int, Field(ge=1, le=1024)] = Field(1, description="Most tasks at once on one member.")
    cost: Cost = Field("paid", description="The members' cost class (cloud capacity: paid by default).")
    idle_window_s: Seconds = Field(
        DEFAULT_GROUP_IDLE_WINDOW_S,
        description="The group is deactivated once the queue has stayed empty this long with members admitted (the seed's 'Deactivate BATCH tier if queue empty').",
    )
    stop_hook: Annotated[CloudHook, BeforeValidator(_hook_table)] | None = Field(
        None,
        description="Run on the leader (a transient sandboxed unit, as a cloud hook) when the group is deactivated; unset: its members are refused and expire when they stop.",
    )


class ArchAgent(Strict):
    """One architecture's compute-agent image and launch command."""

    image: Image = Field(description="The compute agent's image for this architecture (aarch64: the '-arm64' tag).")
    command: NonEmptyArgv = Field(description="The agent's launch command (argv; aarch64: no 'uv run', the arm64 image has no .venv).")


DEFAULT_TOKEN_DIR = "/run/secrets/phaze/agents"
# phaze's agents consume phaze-agent-<agent id>[-<lane>] (phaze's
# agent_worker checks its token's agent id against PHAZE_AGENT_QUEUE, and
# services/agent_task_router.py names the lane queues): phaze's control plane
# writes jobs there, the fabric never does.
PHAZE_QUEUE_PREFIX = "phaze-agent-"
DEFAULT_AGENT_QUEUE_URL_FILE = "/run/secrets/phaze/queue_url"
DEFAULT_MODELS_DIR = "/var/lib/phaze/models"
# Variables of a compute agent that the fabric sets, per lane or from [phaze]
# and [agent] (phaze's agent_worker and AgentSettings read them), and from
# what: [agent.environment] cannot set them.
PER_AGENT_VARIABLES = {
    "PHAZE_ROLE": "phaze's agent role (agent)",
    "PHAZE_AGENT_KIND": "the lane's kind (compute)",
    "PHAZE_AGENT_QUEUE": "the lane's agent_ref (phaze-agent-<agent_ref>; queue_prefix + agent_ref for the fabric's own lanes)",
    "PHAZE_AGENT_LANE": "phaze.agent_lane",
    "PHAZE_LANE_ANALYZE_CONCURRENCY": "the lane's cap",
    "WORKER_MAX_JOBS": "the lane's cap",
    "PHAZE_AGENT_API_URL": "phaze.api_url",
    "PHAZE_AGENT_TOKEN_FILE": "the lane's token_file (default agent.token_dir/<agent_ref>/token)",
    "PHAZE_QUEUE_URL_FILE": "the lane's queue_url_file (default agent.queue_url_file)",
    "PHAZE_AGENT_CA_FILE": "agent.ca_file",
    "PHAZE_CLOUD_SCRATCH_DIR": "the lane's scratch_dir",
    "MODELS_PATH": "phaze.models_path (agent.models_dir bound there read-only)",
}


class AgentSettings(Strict):
    """The compute agent of multi-compute.md, run once per compute lane.

    The arm64 image is the `-arm64` tag started with `python3 -m saq ...` (Python
    3.13, no .venv); the x86 image has no suffix and is started with `uv run saq
    ...` (a .venv). Mixing them up makes the container fail to boot, so it is
    rejected here.
    """

    arch: dict[Arch, ArchAgent] = Field(min_length=1, description="Per architecture (x86_64, aarch64), the agent's image and command.")
    # The prefix of the fabric's own lanes' queues (<queue_prefix><agent_ref>),
    # never phaze's: in a phaze fleet the agents' queues are phaze's
    # (PHAZE_QUEUE_PREFIX, `phaze_agent_queue`) and this is not used.
    queue_prefix: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9-]*-$")] = Field(
        "fabric-lane-", description="The fabric's own lanes' queues are <queue_prefix><agent_ref>; never phaze-agent- (phaze's own)."
    )
    # Each agent's token file is <token_dir>/<agent_ref>/token unless its lane
    # names one (`token_file`): phaze's worker checks the token's agent id
    # against its queue, so agents never share a token.
    token_dir: UnitPath = Field(
        DEFAULT_TOKEN_DIR, description="Each agent's token file is <token_dir>/<agent_ref>/token unless its lane names one (token_file)."
    )
    # On each agent host: the file holding phaze's broker DSN (the agent's
    # PHAZE_QUEUE_URL_FILE), the CA of phaze's agent API (PHAZE_AGENT_CA_FILE;
    # phaze's agent reads /certs/phaze-ca.crt in its image when not given),
    # and phaze's models, bound read-only at [phaze] models_path.
    queue_url_file: UnitPath = Field(
        DEFAULT_AGENT_QUEUE_URL_FILE, description="On each agent host: the file holding phaze's broker DSN (the agent's PHAZE_QUEUE_URL_FILE)."
    )
    ca_file: UnitPath | None = Field(
        None, description="On each agent host: the CA of phaze's agent API (PHAZE_AGENT_CA_FILE); unset: the image's /certs/phaze-ca.crt."
    )
    models_dir: UnitPath = Field(DEFAULT_MODELS_DIR, description="On each agent host: phaze's models, bound read-only at [phaze] models_path.")
    environment: Environment = Field(
        {},
        description="Environment of every agent; secrets only as NAME_FILE absolute paths; never the per-agent variables the unit sets (PHAZE_ROLE, PHAZE_AGENT_QUEUE, ...).",
    )

    @model_validator(mode="after")
    def _own_prefix(self) -> AgentSettings:
        if self.queue_prefix.startswith(PHAZE_QUEUE_PREFIX):
            raise FieldProblem(
                "queue_prefix",
                f"{PHAZE_QUEUE_PREFIX}* queues are phaze's (its control plane dispatches into them): the fabric's own lanes need a prefix of their own",
            )
        return self

    @model_validator(mode="after")
    def _per_agent_variables(self) -> AgentSettings:
        # The environment is every agent's; these differ per agent, so the
        # renderer sets them from the lane (a shared value would give two
        # agents one queue, one token or one scratch dir).
        for key, where in PER_AGENT_VARIABLES.items():
            if key in self.environment:
                raise FieldProblem(f"environment.{key}", f"the fabric sets it for each agent, from {where}: [agent.environment] cannot override it")
        return self

    @model_validator(mode="after")
    def _image_command_swap(self) -> AgentSettings:
        arm = self.arch.get("aarch64")
        x86 = self.arch.get("x86_64")
        if arm is not None:
            if not arm.image.endswith("-arm64"):
                raise FieldProblem("arch.aarch64.image", "must be the '-arm64' tag (there is no multi-arch manifest)")
            if arm.command[:2] == ["uv", "run"]:
                raise FieldProblem("arch.aarch64.command", "must not use 'uv run': the arm64 image has no .venv")
        if x86 is not None and x86.image.endswith("-arm64"):
            raise FieldProblem("arch.x86_64.image", "must not be the '-arm64' tag: the x86 box cannot run it")
        return self


class Lane(Strict):
    """One lane: a `[[backends]]` entry of multi-compute.md (phaze calls lanes backends)."""

    kind: Literal["compute", "local"] = Field(
        description="compute: an agent on push_host runs its jobs; local: phaze's own processing on the control host."
    )
    id: Name = Field(description="The lane's id.")
    rank: Annotated[int, Field(ge=0, le=999)] = Field(description="Lanes fill in rank order, lowest first.")
    cap: Annotated[int, Field(ge=1, le=999)] = Field(description="Most jobs queued or active on the lane at once.")
    agent_ref: Name | None = Field(
        None, description="The compute lane's agent (its queue: <agent.queue_prefix><agent_ref>); compute lanes only, required there."
    )
    push_host: Name | None = Field(None, description="The host whose agent runs the lane's jobs; compute lanes only, required there.")
    scratch_dir: UnitPath | None = Field(
        None, description="Where phaze pushes the files (the agent's PHAZE_CLOUD_SCRATCH_DIR); compute lanes only, required there."
    )
    ssh_user: Name | None = Field(None, description="The user phaze pushes as; owns scratch_dir; compute lanes only, required there.")
    # A compute lane: must equal <queue_prefix><agent_ref> when given; derived
    # otherwise. The local lane of the fabric's own lanes: LOCAL_QUEUE unless
    # given. Not used in a phaze fleet (phaze names its queues).
    queue: Name | None = Field(
        None,
        description="The lane's SAQ queue (not used in a phaze fleet). A compute lane: must equal <queue_prefix><agent_ref> when given. The local lane: phaze-local unless given.",
    )
    # A compute lane's agent token (default <agent.token_dir>/<agent_ref>/token).
    token_file: UnitPath | None = Field(None, description="A compute lane's agent token (default <agent.token_dir>/<agent_ref>/token).")
    # A compute lane's agent's broker DSN file (its PHAZE_QUEUE_URL_FILE; default
    # agent.queue_url_file): with `fabric lane init-roles`, the DSN of the
    # lane's own role fabric-agent-<id>, which may touch only its queue's rows.
    queue_url_file: UnitPath | None = Field(
        None,
        description=(
            "A compute lane's agent's broker DSN file (PHAZE_QUEUE_URL_FILE; default agent.queue_url_file); "
            "with `fabric lane init-roles`, the DSN of its role fabric-agent-<id> (its own queue's rows only)."
        ),
    )

    @model_validator(mode="after")
    def _compute_fields(self) -> Lane:
        if self.kind == "compute":
            for key in ("agent_ref", "push_host", "scratch_dir"):
                if getattr(self, key) is None:
                    raise FieldProblem(key, "required for a compute lane")
        else:
            for key in ("agent_ref", "push_host", "scratch_dir", "ssh_user", "token_file", "queue_url_file"):
                if getattr(self, key) is not None:
                    raise FieldProblem(key, "not allowed on a local lane (phaze's own processing on the file server, no agent)")
        return self


# The fabric's own lanes: the local lane's queue unless `queue` names another.
# (A phaze fleet's local lane is the file server agent's own lane queue,
# `lane_queue_name`: phaze has no phaze-local.)
LOCAL_QUEUE = "phaze-local"
IMPLICIT_LOCAL_LANE = Lane(kind="local", id="local", rank=99, cap=1)
# Where phaze's control plane reads its lanes (PHAZE_BACKENDS_CONFIG_FILE's default).
PHAZE_BACKENDS_FILE = "/etc/phaze/backends.toml"
# The keys of a lane phaze's backends.toml has (configuration.md's field table).
PHAZE_BACKEND_FIELDS = ("kind", "id", "rank", "cap", "agent_ref", "push_host", "scratch_dir", "ssh_user")


def agent_token_file(agent: AgentSettings | None, lane: Lane) -> str | None:
    """A compute lane's agent token file: its own `token_file`, else
    <agent.token_dir>/<agent_ref>/token; None for the local lane (no agent)."""
    if lane.kind != "compute":
        return None
    if lane.token_file is not None:
        return lane.token_file
    token_dir = agent.token_dir if agent is not None else DEFAULT_TOKEN_DIR
    return f"{token_dir}/{lane.agent_ref}/token"


def listed_once(key: str) -> Callable[[list[str]], list[str]]:
    """A validator of list `key`: no value listed twice (the message names both indexes)."""

    def check(values: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        for i, value in enumerate(values):
            if value in seen:
                raise ValueError(f"{value} is listed twice ({key}[{seen[value]}] and {key}[{i}])")
            seen[value] = i
        return values

    return check


class PhazeSettings(Strict):
    """phaze's control plane on the host with the 'control' role."""

    # Its units: they read backends.toml at startup only, so a pass that
    # changes the file restarts those that run.
    control_units: Annotated[list[ServiceUnit], AfterValidator(listed_once("control_units"))] = Field(
        [],
        description="phaze's units on the control host: they read backends.toml at startup only, so a pass that changes it restarts those that run.",
    )
    # The file holding phaze's broker DSN (PHAZE_QUEUE_URL, PostgreSQL) that
    # reads the lanes: a pass (the in_flight of the lanes whose jobs run on its
    # host), `fabric status`, `fabric lane status`. With `fabric lane
    # init-roles`, the fabric-reader role's DSN (SELECT only). Never the DSN
    # itself: it carries a password and TOML is world-readable. The edge reads
    # no broker: its page shows the lanes of the leader's signed plan.
    queue_url_file: AbsPath | None = Field(
        None,
        description=(
            "The file holding the broker DSN that reads the lanes (passes of lane hosts, fabric status, fabric lane status); "
            "with `fabric lane init-roles`, fabric-reader's (SELECT only). Never the DSN itself."
        ),
    )
    # On the leader candidates: the DSN that dispatches (the leader's step,
    # `fabric lane dispatch` and `enqueue`): fabric-dispatcher's with `fabric
    # lane init-roles`. Unset: queue_url_file (one DSN for everything, as
    # before the roles).
    dispatcher_url_file: AbsPath | None = Field(
        None,
        description=(
            "On the leader candidates: the file holding the broker DSN that dispatches (the leader, fabric lane dispatch and enqueue); "
            "with `fabric lane init-roles`, fabric-dispatcher's. Unset: queue_url_file."
        ),
    )
    # The SAQ function a lane job runs on its lane's workers (phaze's agent
    # worker and the file server's processing both register it).
    job_function: Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")] = Field(
        "process_file", description="The SAQ function a lane job runs on its lane's workers."
    )
    # The leader dispatches the lane jobs at each step (the fleet's one
    # dispatcher). false: only `fabric lane dispatch` does, where the job
    # system or an operator drives each dispatch pass and reads its decisions.
    leader_dispatches: bool = Field(
        True, description="The leader dispatches the fabric's own lane jobs at each step; false: only `fabric lane dispatch` does."
    )
    # phaze's agent API (PHAZE_AGENT_API_URL: every agent asks it who it is at
    # start). Giving it makes this a phaze fleet: the [[backends]] are phaze's,
    # phaze's control plane selects and dispatches, and the fabric writes no
    # job (`FleetConfig.phaze_dispatches`).
    api_url: Annotated[str, AfterValidator(_http_url)] | None = Field(
        None, description="phaze's agent API (PHAZE_AGENT_API_URL). Set: a phaze fleet, where phaze dispatches and the fabric writes no job."
    )
    # The lane an agent serves (PHAZE_AGENT_LANE) and so the suffix of its
    # queue, phaze-agent-<agent_ref>-<agent_lane>; "" for a phaze without
    # lanes (its agents consume the bare phaze-agent-<agent_ref>).
    agent_lane: Literal["analyze", ""] = Field(
        "analyze",
        description="The lane each agent serves (PHAZE_AGENT_LANE): its queue is phaze-agent-<agent_ref>-<agent_lane>; empty for a phaze without lanes.",
    )
    # phaze's local lane: its LocalBackend.dispatch (services/backends/local.py,
    # phaze a3fd169) enqueues process_file on the file server agent's own
    # lane queue, phaze-agent-<its agent id>-analyze (agent_task_router.py
    # _queue_for). That agent id (phaze's agents.id, kind fileserver) names
    # the local lane's queue in a phaze fleet (`lane_queue_name`).
    fileserver_agent: Name | None = Field(
        None,
        description="phaze's file server agent id (PHAZE_AGENT_QUEUE phaze-agent-<it>): in a phaze fleet the local lane's queue is phaze-agent-<it>-<agent_lane>.",
    )
    # phaze's MODELS_PATH: where its agents find the models (process_file's
    # payload carries the control plane's, so agents use the same path).
    models_path: AbsPath = Field("/models", description="phaze's MODELS_PATH: where its agents find the models.")
    # The user phaze pushes files as (its file server's PHAZE_PUSH_SSH_USER):
    # a compute lane without its own ssh_user uses it (`ssh_user_for`).
    push_ssh_user: Name | None = Field(
        None, description="The user phaze pushes files as (PHAZE_PUSH_SSH_USER): a compute lane without its own ssh_user uses it."
    )
    # Steering (a phaze fleet): a compute lane dead this long (its host offline
    # or suspected, its agent unit failed, no SAQ worker on its queue) leaves
    # backends.toml; healthy this long, it comes back. phaze reads the file at
    # start only, so each change restarts control_units: at most one change
    # per restart_interval_s.
    steering_window_s: Annotated[int, Field(ge=0, le=86_400)] = Field(
        120, description="A compute lane dead (or healthy again) this long leaves (or rejoins) phaze's backends.toml."
    )
    restart_interval_s: Annotated[int, Field(ge=0, le=86_400)] = Field(
        600, description="At most one backends.toml change (a restart of phaze's control units) per this many seconds."
    )


class Route(Strict):
    host: HostName = Field(description="The DNS name the edge serves the service on.")
    path: Annotated[str, StringConstraints(pattern=r"^/[A-Za-z0-9._~/-]*$")] = Field("/", description="The path prefix routed to the service.")
    # Not rendered since the edge dropped Caddy's active health checks (they
    # held a new upstream out until their next probe; see fabric.caddy.j2);
    # kept so that fleet files which set it stay valid.
    health_path: Annotated[str, StringConstraints(pattern=r"^/[A-Za-z0-9._~/-]*$")] = Field(
        "/healthz", description="Not rendered (the edge has no active health checks); kept so that files which set it stay valid."
    )


class Service(Strict):
    id: Name = Field(description="The service's id (its unit is fabric-agent-<id>.service).")
    description: FreeText = Field("", description="A line for the unit's Description= (free text, never a secret).")
    min_tier: Tier = Field(description="The tier the service wants.")
    # Lowest tier the service may fall back to. Equal to min_tier means hard
    # fail: deferred rather than degraded (the seed's LUPINE).
    floor: Tier = Field("relay", description="The lowest tier it may fall back to; equal to min_tier: deferred rather than degraded.")
    replicas: Annotated[int, Field(ge=1, le=64)] = Field(1, description="Replicas, each on a distinct node.")
    arch: list[Arch] = Field([], description="Architectures it may run on (empty: any).")
    labels: dict[LabelKey, LabelValue] = Field({}, description="Host labels a node must carry to take it.")
    # Exactly one of command / image, keyed by architecture ("any" for both).
    command: dict[RunsOn, NonEmptyArgv] = Field(
        {}, description="The program to run, per architecture ('any' for both); exactly one of command and image."
    )
    image: dict[RunsOn, Image] = Field({}, description="The container image to run with podman, per architecture ('any' for both).")
    port: Annotated[int, Field(ge=1024, le=65535)] | None = Field(None, description="The port it listens on; required with route.")
    route: Route | None = Field(None, description="Serve it through the edge's Caddy.")
    environment: Environment = Field({}, description="Its environment; secrets only as NAME_FILE absolute paths.")
    # name -> absolute path on the host, delivered with LoadCredential=.
    credentials: dict[Name, UnitPath] = Field(
        {}, description="name -> absolute path on the host (never in a system directory), delivered with LoadCredential=."
    )
    # This service's place of cost among the placement rules; None: the
    # fleet's [scheduler] cost_order.
    cost_order: CostOrder | None = Field(None, description="This service's place of cost among the placement rules; unset: [scheduler] cost_order.")
    singleton: bool = Field(
        False,
        description="Must never run twice at once: a suspected node's replica gets no hedge and moves only when the node is offline at the node timeout.",
    )

    @model_validator(mode="after")
    def _rules(self) -> Service:
        if tier_score(self.floor) > tier_score(self.min_tier):
            raise FieldProblem("floor", f"{self.floor!r} is above min_tier {self.min_tier!r}")
        if bool(self.command) == bool(self.image):
            raise FieldProblem("command", "give exactly one of command or image")
        if self.route is not None and self.port is None:
            raise FieldProblem("port", "required for a service with a route")
        runs = self.command or self.image
        if "any" not in runs:
            archs = self.arch or list(ARCHES)
            missing = [a for a in archs if a not in runs]
            if missing:
                key = "command" if self.command else "image"
                raise FieldProblem(key, f"no entry for {', '.join(missing)} (add it, an 'any' entry, or restrict arch)")
        return self


def _cidr(value: str) -> str:
    """'203.0.113.0/24', '2001:db8::/32' (a bare address is its /32 or /128),
    normalized; host bits set is an error, not silently masked off."""
    if "%" in value:
        raise ValueError(f"{value!r} has a zone (%...): give the network alone")
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError:
        pass
    try:
        network = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR (an IPv4 or IPv6 network such as 203.0.113.0/24 or 2001:db8::/32)") from None
    raise ValueError(f"{value!r} has host bits set; the network is {network}")


Cidr = Annotated[str, AfterValidator(_cidr)]

# allow_from entries that open a port map to every address of their family.
EVERYONE = ("0.0.0.0/0", "::/0")


class PortMap(Strict):
    """A permanent socat redirect on one host (the seed's edge port maps)."""

    name: Name = Field(description="The port map's name (its unit is fabric-socat-<name>.service).")
    host: Name = Field(description="The host that listens.")
    protocol: Literal["tcp", "udp"] = Field("tcp", description="tcp or udp.")
    listen_port: Port = Field(description="The port it listens on.")
    target_host: Name = Field(description="The host it forwards to.")
    target_port: Port = Field(description="The port it forwards to.")
    # Who besides the tailnet may reach listen_port: CIDRs, IPv4 and IPv6;
    # 0.0.0.0/0 and ::/0 are everyone. Empty (the default): the tailnet only.
    allow_from: Annotated[list[Cidr], AfterValidator(listed_once("allow_from"))] = Field(
        [], description="Who besides the tailnet may reach listen_port: CIDRs, IPv4 and IPv6 (0.0.0.0/0 and ::/0: everyone). Empty: the tailnet only."
    )

    @property
    def open_to_everyone(self) -> bool:
        return any(cidr in EVERYONE for cidr in self.allow_from)


# An ed25519 public key is 32 raw bytes; fabric.toml holds them base64-encoded.
ED25519_PUBLIC_KEY_BYTES = 32


def _ed25519_public_key(value: str) -> str:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("is not base64 (the raw 32-byte ed25519 public key, as `fabric leader keygen` prints it)") from None
    if len(raw) != ED25519_PUBLIC_KEY_BYTES:
        raise ValueError(f"decodes to {len(raw)} bytes; an ed25519 public key is {ED25519_PUBLIC_KEY_BYTES}")
    return value


class PlanKey(Strict):
    """A public key a leader candidate signs its fleet plans with
    (`fabric leader keygen`). A candidate may have several (rotation): a plan
    signed by any of them verifies; removing one retires it."""

    host: Name = Field(description="The leader candidate whose key this is.")
    id: Name = Field(description="The key's id (several per candidate: rotation).")
    public_key: Annotated[str, AfterValidator(_ed25519_public_key)] = Field(
        description="The raw 32-byte ed25519 public key, base64, as `fabric leader keygen` prints it."
    )

    def public_bytes(self) -> bytes:
        return base64.b64decode(self.public_key)


# Ray's own default GCS port (`ray start --head`) and dashboard port.
RAY_DEFAULT_PORT = 6379
RAY_DEFAULT_DASHBOARD_PORT = 8265


class RaySettings(Strict):
    """The fabric's Ray cluster: a pass renders fabric-ray-head.service on
    `head` and fabric-ray-worker.service on each of `workers`, each node
    offering what its probe and limits allow (reconciler.core.render.ray_node).
    The hosts are checked against the declared ones when the files are loaded."""

    head: Name = Field(description="The host of the Ray head (a Ray node itself: not listed in workers).")
    # The head's GCS port, where the workers join (tailnet only: the head's
    # nftables opens it to the tailnet and drops it from elsewhere).
    port: Port = Field(RAY_DEFAULT_PORT, description="The head's GCS port, where the workers join (tailnet only).")
    # The hosts whose worker joins the head. The head is a Ray node itself
    # (with its own resources), so it is not listed here.
    workers: Annotated[list[Name], AfterValidator(listed_once("workers"))] = Field([], description="The hosts whose Ray worker joins the head.")
    # The `ray` program the units run (a virtualenv's bin/ray, a Nix store
    # path); None: the one on the pass's PATH (the NixOS module's
    # services.fabric.ray.package puts it there), else /usr/bin/ray.
    command: AbsPath | None = Field(None, description="The `ray` program the units run; unset: the one on the pass's PATH, else /usr/bin/ray.")
    # Ray's dashboard on the head: off unless asked for (it listens on the
    # tailnet address and has no authentication).
    dashboard: bool = Field(False, description="Ray's dashboard on the head (on the tailnet address, no authentication).")
    dashboard_port: Port = Field(RAY_DEFAULT_DASHBOARD_PORT, description="The dashboard's port; not the head's port.")

    @model_validator(mode="after")
    def _head_is_no_worker(self) -> RaySettings:
        if self.head in self.workers:
            raise FieldProblem("workers", f"{self.head!r} is the head: it is a Ray node already and cannot also join as a worker")
        if self.dashboard and self.dashboard_port == self.port:
            raise FieldProblem("dashboard_port", f"{self.dashboard_port} is the head's port")
        return self

    def hosts(self) -> tuple[str, ...]:
        """Every host that runs a Ray node: the head, then the workers."""
        return (self.head, *self.workers)


def phaze_agent_queue(agent_ref: str, agent_lane: str = "") -> str:
    """phaze's queue of agent `agent_ref`: phaze-agent-<agent_ref> (its
    PHAZE_AGENT_QUEUE), with `-<agent_lane>` the lane queue it consumes."""
    return f"{PHAZE_QUEUE_PREFIX}{agent_ref}" + (f"-{agent_lane}" if agent_lane else "")


def lane_queue_name(fleet: FleetConfig, lane: Lane) -> str | None:
    """The SAQ queue a lane's jobs run from: in a phaze fleet a compute lane's
    is phaze's agent lane queue (phaze-agent-<agent_ref>-<agent_lane>) and
    the local lane's the file server agent's own lane queue
    (phaze-agent-<[phaze] fileserver_agent>-<agent_lane>: phaze has no
    other local queue); else a compute lane's agent queue
    (<queue_prefix><agent_ref>); the local lane's own (LOCAL_QUEUE by
    default); None for a compute lane of the fabric's own without an
    [agent] table, or a phaze fleet's local lane without fileserver_agent
    (the load refuses that)."""
    if lane.kind == "local" and fleet.phaze_dispatches:
        agent = fleet.phaze.fileserver_agent
        return None if agent is None else phaze_agent_queue(agent, fleet.phaze.agent_lane)
    if lane.kind == "local":
        return lane.queue or LOCAL_QUEUE
    if fleet.phaze_dispatches:
        assert lane.agent_ref is not None  # a compute lane
        return phaze_agent_queue(lane.agent_ref, fleet.phaze.agent_lane)
    if fleet.agent is None:
        return lane.queue
    return lane.queue or f"{fleet.agent.queue_prefix}{lane.agent_ref}"


def agent_queue_name(fleet: FleetConfig, lane: Lane) -> str | None:
    """A compute lane's agent's PHAZE_AGENT_QUEUE: phaze's base queue
    phaze-agent-<agent_ref> in a phaze fleet (phaze's agent adds the lane's
    suffix itself and checks the base against its token's agent id), else the
    lane's queue; None for the local lane (no agent)."""
    if lane.kind != "compute":
        return None
    if fleet.phaze_dispatches:
        assert lane.agent_ref is not None  # a compute lane
        return phaze_agent_queue(lane.agent_ref)
    return lane_queue_name(fleet, lane)


class FleetConfig(Strict):
    """The whole of fabric.toml."""

    fleet: FleetSettings = Field(description="The fleet's name, domain and leader candidates.")
    timing: TimingSettings = Field(TimingSettings(), description="Heartbeats and node timeouts.")
    flap: FlapSettings = Field(FlapSettings(), description="When a node that comes and goes is held off new placements.")
    edge: EdgeSettings = Field(EdgeSettings(), description="How the edge's Caddy moves traffic between a service's upstreams.")
    registry: RegistrySettings = Field(RegistrySettings(), description="Where the live state lives.")
    scheduler: SchedulerSettings = Field(SchedulerSettings(), description="Placement and lane routing.")
    scaling: ScalingSettings = Field(ScalingSettings(), description="Bursts and vertical and cloud scaling.")
    groups: dict[Name, WorkerGroup] = Field(
        {}, description="Worker groups: the ephemeral members a cloud hook starts join as members of a group declared here (admitted for it)."
    )
    agent: AgentSettings | None = Field(None, description="The compute agent run once per compute lane.")
    phaze: PhazeSettings = Field(PhazeSettings(), description="phaze's control plane on the control host and its broker.")
    # The lanes, under phaze's name for them: fabric.toml's [[backends]].
    lanes: list[Lane] = Field(
        default=[],
        alias="backends",
        description="The lanes (phaze's name: backends): rank/cap queues of phaze's jobs. None declared: one local lane.",
    )
    services: list[Service] = Field([], description="Long-running programs the scheduler places.")
    port_maps: list[PortMap] = Field([], description="Permanent socat redirects (the edge's port maps).")
    # Leader candidates' public keys: when any are listed, hosts apply only
    # registry plans signed by a key of the candidate the plan names.
    plan_keys: list[PlanKey] = Field(
        [], description="Leader candidates' public keys: when any are listed, hosts apply only plans signed by a key of the candidate the plan names."
    )
    # The fabric's Ray cluster (optional): no [ray], no Ray units.
    ray: RaySettings | None = Field(None, description="The fabric's Ray cluster (optional: no [ray], no Ray units).")

    @property
    def phaze_dispatches(self) -> bool:
        """A phaze fleet ([phaze] api_url): phaze's control plane selects a
        lane and dispatches into its phaze-agent-* queues; the fabric deploys,
        watches and steers, and never writes a job."""
        return self.phaze.api_url is not None


# --------------------------------------------------------------------------
# hosts/<host>.toml

Role = Literal["edge", "compute", "control", "fileserver"]


# A network interface's name as the kernel takes it (IFNAMSIZ: 15 bytes) and
# nft can match it in a quoted string: no blank, quote, '/' or wildcard.
_INTERFACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$")


def _interface_name(value: str) -> str:
    if not _INTERFACE_RE.match(value):
        raise ValueError(f"{value[:40]!r} is not a network interface name (1-15 letters, digits, '_', '.', '-', starting with a letter or digit)")
    return value


InterfaceName = Annotated[str, AfterValidator(_interface_name)]


def _tailnet_ip(value: str) -> str:
    try:
        ip = ipaddress.ip_address(value)
    except ValueError as exc:
        raise ValueError(f"{value!r} is not an IP address") from exc
    return str(ip)


class HostLimits(Strict):
    max_concurrent_tasks: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None, description="Most tasks at once on this host (bounded by the probe unless overrides.limits_above_probe)."
    )
    # Concurrency may be raised by vertical scaling up to this ceiling.
    max_concurrent_ceiling: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None, description="Vertical scaling may raise concurrency up to this; at least max_concurrent_tasks."
    )

    @model_validator(mode="after")
    def _ceiling(self) -> HostLimits:
        if (
            self.max_concurrent_tasks is not None
            and self.max_concurrent_ceiling is not None
            and self.max_concurrent_ceiling < self.max_concurrent_tasks
        ):
            raise FieldProblem("max_concurrent_ceiling", "is below max_concurrent_tasks")
        return self


class HostOverrides(Strict):
    # Pin the tier below what the probe finds (never above it: the probe's
    # tier is a ceiling, so a typo cannot send CUDA work to a CPU box).
    tier: Tier | None = Field(None, description="Pin the tier below what the probe finds (never above it: the probe's tier is a ceiling).")
    arch: Arch | None = Field(None, description="Pin the architecture.")
    # Let [limits] stand above what the probe measured (a host whose probe
    # undercounts it). Without it the effective limits are the smaller of the
    # declared and the probed (reconciler.core.live.host_limits).
    limits_above_probe: bool = Field(
        False,
        description="Let [limits] stand above what the probe measured; without it the effective limits are the smaller of the declared and the probed.",
    )


class HostSettings(Strict):
    name: Name = Field(description="The host's name (its file's name).")
    roles: list[Role] = Field([], description="Its roles: edge, compute, control, fileserver.")
    # The address other hosts and the edge reach this host on (its tailnet IP).
    # Declared in git, not taken from the registry: a registry writer must not be
    # able to point the edge at an address of its choosing.
    address: Annotated[str, AfterValidator(_tailnet_ip)] = Field(
        description="The address other hosts and the edge reach it on (its tailnet IP); declared in git, never taken from the registry."
    )
    # The machine's DNS name on the tailnet ("qfox-1.tail-abc123.ts.net"): a
    # pass whose probe finds another name says so (probe.identity).
    tailnet_name: HostName | None = Field(None, description="The machine's DNS name on the tailnet; a pass whose probe finds another name says so.")
    # The tailnet's network interface: the nftables table accepts the tailnet's
    # source range on the fabric's ports only when it arrives there (a forged
    # 100.64.0.0/10 source on the public interface is dropped), and the
    # CachyOS/Arch forward fix names it.
    tailnet_interface: InterfaceName = Field(
        "tailscale0",
        description="The tailnet's network interface (Tailscale's tailscale0 by default): tailnet-only ports accept the tailnet's addresses only when they arrive on it.",
    )
    # Where the OS needs the nftables fix (CachyOS/Arch), or None to detect.
    nftables_fix: bool | None = Field(None, description="Whether the OS needs the nftables fix (CachyOS/Arch); unset: detect.")
    # The host's cost class (COST_ORDER): reported in its heartbeat, so the
    # leader places on cheaper hosts first and brings work home from paid ones.
    cost: Cost = Field(
        DEFAULT_COST,
        description="The host's cost class, cheapest first: free, owned (the default: no saving, no bill) or paid (takes overflow, and work comes home from it).",
    )

    @model_validator(mode="before")
    @classmethod
    def _node_id_was_renamed(cls, data: Any) -> Any:
        # Host files written before the rename say node_id: read it as
        # tailnet_name, so a fleet repo keeps validating until it is updated.
        if isinstance(data, dict) and "node_id" in data:
            if "tailnet_name" in data:
                raise FieldProblem("node_id", "the old name of tailnet_name: give only tailnet_name")
            data = {("tailnet_name" if key == "node_id" else key): value for key, value in data.items()}
        return data


class HostConfig(Strict):
    """The whole of hosts/<host>.toml."""

    host: HostSettings = Field(description="The host's name, roles and address.")
    labels: dict[LabelKey, LabelValue] = Field({}, description="Labels (a service's labels must be among them).")
    limits: HostLimits = Field(HostLimits(), description="Concurrency limits.")
    overrides: HostOverrides = Field(HostOverrides(), description="Pins over what the probe finds.")


class DesiredState(BaseModel):
    """fabric.toml plus every host, validated together."""

    model_config = ConfigDict(frozen=True)

    fleet: FleetConfig
    hosts: dict[str, HostConfig]
    # Source file of each part, for messages produced after loading.
    fleet_file: str = "fabric.toml"

    @property
    def lanes(self) -> list[Lane]:
        """The declared lanes, or the implicit single local lane."""
        return list(self.fleet.lanes) or [IMPLICIT_LOCAL_LANE]

    def service(self, service_id: str) -> Service | None:
        return next((s for s in self.fleet.services if s.id == service_id), None)

    def lane(self, lane_id: str) -> Lane | None:
        return next((b for b in self.lanes if b.id == lane_id), None)

    def hosts_with_role(self, role: str) -> list[str]:
        return sorted(n for n, h in self.hosts.items() if role in h.host.roles)

    def lane_hosts(self) -> set[str]:
        """The declared hosts some lane's jobs run on (`lanes_on` is not
        empty), in one pass over the lanes: asking `lanes_on` of every host
        sorts every host's roles once per host (seconds at 5,000 hosts)."""
        hosts = {lane.push_host for lane in self.lanes if lane.kind == "compute" and lane.push_host is not None}
        if any(lane.kind == "local" for lane in self.lanes):
            control = self.hosts_with_role("control")
            hosts.update(control[:1])
        return hosts & self.hosts.keys()

    def lanes_on(self, host: str) -> list[Lane]:
        """The lanes whose jobs run on `host`: a compute lane's on its push
        host (its agent), the local lane's on the (first) control host
        (phaze's own processing there; no fabric agent runs it)."""
        control = self.hosts_with_role("control")
        return [
            lane
            for lane in self.lanes
            if (lane.kind == "compute" and lane.push_host == host) or (lane.kind == "local" and bool(control) and control[0] == host)
        ]

    def queue_for(self, lane: Lane) -> str | None:
        """The queue a lane's jobs go to (`lane_queue_name`)."""
        return lane_queue_name(self.fleet, lane)

    def ssh_user_for(self, lane: Lane) -> str | None:
        """The user phaze pushes a compute lane's files as: its own ssh_user,
        else [phaze] push_ssh_user; None for the local lane (nothing pushed).
        The fabric gives the lane's scratch dir to that user and writes it
        into backends.toml, so phaze's own fallback is never needed."""
        if lane.kind != "compute":
            return None
        return lane.ssh_user or self.fleet.phaze.push_ssh_user

    def agent_queue_url_file(self, lane: Lane) -> str | None:
        """A compute lane's agent's broker DSN file: its own queue_url_file, else
        [agent] queue_url_file; None for the local lane (no agent)."""
        if lane.kind != "compute":
            return None
        if lane.queue_url_file is not None:
            return lane.queue_url_file
        return self.fleet.agent.queue_url_file if self.fleet.agent is not None else DEFAULT_AGENT_QUEUE_URL_FILE

    def token_file_for(self, lane: Lane) -> str | None:
        """A compute lane's agent token file; None for the local lane (no agent)."""
        return agent_token_file(self.fleet.agent, lane)


# --------------------------------------------------------------------------
# Live state: what the probe reports (the seed's registry data model)


class Gpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    vendor: GpuVendor
    model: str
    vram_mib: int | None = None
    integrated: bool
    tier: Tier
    pci_slot: str | None = None
    render_node: str | None = None
    # The group owning /dev/dri/<render_node> (stat): what a unit's dynamic user needs to open it.
    render_group: str | None = None
    driver: str | None = None


class Storage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    mount: str | None = None
    type: StorageType
    size_gib: int


class Framebuffer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str
    resolution: str


class Hardware(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str | None = None
    cpu_cores: int | None = None
    memory_mib: int | None = None
    gpus: list[Gpu] = []
    storage: list[Storage] = []
    ffmpeg: list[str] = []
    framebuffer: Framebuffer | None = None


class Limitations(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_tasks: int = 1
    # The most vertical scaling may raise concurrency to on this hardware.
    max_concurrent_ceiling: int = 1
    vram_mib: int | None = None
    notes: list[str] = []


class OperatingSystem(BaseModel):
    """From /etc/os-release: decides host-specific fixes (the seed's nftables
    fix on CachyOS/Arch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    id_like: list[str] = []
    name: str | None = None
    version_id: str | None = None

    @property
    def arch_based(self) -> bool:
        return self.id == "arch" or "arch" in self.id_like


class HostFacts(BaseModel):
    """One probe of one machine."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # The machine's DNS name on the tailnet ("qfox-1.tail-abc123.ts.net"), or its
    # host name without Tailscale. Not a node id: nodes are named by their host.
    # Its JSON key stays "node_id" (read and written): `fabric probe --json`
    # has always printed it so, and operators' scripts read it.
    tailnet_name: str = Field(alias="node_id")
    tailscale_ip: str | None = None
    tailscale_relayed: bool | None = None
    k3s_hostname: str
    hardware: Hardware
    tier: Tier
    labels: dict[str, str] = {}
    limitations: Limitations = Limitations()
    # fact name -> why it is absent (command missing, failed, timed out, odd value).
    missing: dict[str, str] = {}
    os: OperatingSystem | None = None

    @model_serializer(mode="wrap")
    def _json_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # The JSON key of `tailnet_name` whether or not the caller dumps by alias
        # (pydantic < 2.11, which nixpkgs carries, has no serialize_by_alias).
        data: dict[str, Any] = handler(self)
        return {("node_id" if key == "tailnet_name" else key): value for key, value in data.items()}
