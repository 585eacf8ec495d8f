"""What a host offers Ray when it joins the fabric's Ray cluster (pure).

One spec per node, the single source for both the rendered `ray start` units
and anything that builds a Ray node for that host (tests replaying a probe):

- `resources`: one custom resource per tier at or below the node's own
  (`tier_gpu_cuda`, `tier_gpu_vaapi`, ... `tier_relay`), each as many as the
  node's effective `max_concurrent_tasks`. A task that needs at least a tier
  asks for one unit of that tier's resource, so a gpu_cuda node can take CUDA
  work and APU work alike, and an APU node never takes CUDA work.
- `num_cpus`: the effective `max_concurrent_tasks` (Ray's own CPU count is the
  concurrency the fabric allows, not the cores the machine has).
- `num_gpus`: the GPUs CUDA can use (the probe's gpu_cuda ones). Ray hands
  GPUs out through CUDA_VISIBLE_DEVICES, so a VA-API GPU or an iGPU counted
  here would be a device index CUDA does not have; those GPUs' capability
  is in the tier resources.
- `memory_bytes`: the probe's memory less the OS reserve, or None when unknown.
- `labels`: the node's `topology.researchstack.io/...` labels from the probe,
  plus its host name and architecture, so a driver can find the Ray node that
  is a given fabric host. Ray 2.60 takes label values in Kubernetes' syntax
  only (ray/_private/label_utils.py refuses `ray start` otherwise), so a ':'
  of the probe's values ("nvidia:rtx4070") becomes '-', as for k3s, and a
  value that is still not valid is left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from reconciler.core.desired.model import TIER_ORDER, TIER_SCORE, HostFacts
from reconciler.core.live.host_limits import EffectiveLimits
from reconciler.core.probe.tiering import LABEL_PREFIX, OS_RESERVE_MIB

# The units a pass renders for the fabric's Ray cluster: the head on the
# `[ray]` head host, a worker on each joining host.
RAY_HEAD_UNIT = "fabric-ray-head.service"
RAY_WORKER_UNIT = "fabric-ray-worker.service"

TIER_RESOURCE_PREFIX = "tier_"
HOST_LABEL = f"{LABEL_PREFIX}host"
ARCH_LABEL = f"{LABEL_PREFIX}arch"


# Kubernetes' label value syntax, which Ray enforces for node labels.
_RAY_LABEL_VALUE_RE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def ray_label_value(value: str) -> str | None:
    """`value` as Ray takes it (':' -> '-'), or None when Ray would refuse it."""
    value = value.replace(":", "-")
    return value if _RAY_LABEL_VALUE_RE.match(value) else None


def tier_resource(tier: str) -> str:
    """The Ray custom resource that stands for `tier` ("tier_gpu_cuda")."""
    if tier not in TIER_SCORE:
        raise ValueError(f"unknown tier {tier!r}")
    return f"{TIER_RESOURCE_PREFIX}{tier}"


def offered_tiers(tier: str) -> tuple[str, ...]:
    """The node's own tier and every tier below it, best first."""
    own = TIER_SCORE[tier]
    return tuple(t for t in TIER_ORDER if TIER_SCORE[t] <= own)


@dataclass(frozen=True)
class RayNodeSpec:
    host: str
    tier: str
    num_cpus: int
    num_gpus: int
    memory_bytes: int | None
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


def ray_node_spec(host: str, facts: HostFacts, limits: EffectiveLimits) -> RayNodeSpec:
    slots = limits.max_concurrent_tasks
    memory_mib = facts.hardware.memory_mib
    labels = {key: ray_label_value(value) for key, value in facts.labels.items() if key.startswith(LABEL_PREFIX)}
    labels[HOST_LABEL] = host
    if facts.hardware.arch:
        labels[ARCH_LABEL] = facts.hardware.arch
    return RayNodeSpec(
        host=host,
        tier=facts.tier,
        num_cpus=slots,
        num_gpus=sum(1 for gpu in facts.hardware.gpus if gpu.tier == "gpu_cuda"),
        memory_bytes=max(0, memory_mib - OS_RESERVE_MIB) * 1024 * 1024 if memory_mib else None,
        resources={tier_resource(t): float(slots) for t in offered_tiers(facts.tier)},
        labels={key: value for key, value in sorted(labels.items()) if value is not None},
    )
