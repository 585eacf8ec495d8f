"""The Ray node spec of a replayed probe: tiers at or below the node's own, concurrency, GPUs, labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reconciler.core.desired.model import HostFacts
from reconciler.core.live.host_limits import EffectiveLimits
from reconciler.core.render.ray_node import HOST_LABEL, offered_tiers, ray_node_spec, tier_resource

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "probe"


def facts(machine: str) -> HostFacts:
    return HostFacts.model_validate(json.loads((FIXTURES / machine / "expected.json").read_text()))


def test_a_cuda_node_offers_every_tier_down_to_relay_as_many_as_its_limit():
    qfox = facts("qfox-1")
    spec = ray_node_spec("qfox-1", qfox, EffectiveLimits(4, 5))
    assert qfox.tier == "gpu_cuda"
    assert spec.resources[tier_resource("gpu_cuda")] == 4.0
    assert spec.resources[tier_resource("gpu_apu")] == 4.0
    assert spec.resources[tier_resource("relay")] == 4.0
    assert spec.num_cpus == 4
    assert spec.num_gpus == sum(gpu.tier == "gpu_cuda" for gpu in qfox.hardware.gpus) == 1
    assert spec.labels[HOST_LABEL] == "qfox-1"
    assert spec.labels["topology.researchstack.io/tier"] == "gpu_cuda"


def test_an_arm_node_offers_nothing_above_its_tier():
    a1 = facts("a1-arm64")
    spec = ray_node_spec("a1-arm64", a1, EffectiveLimits(1, 2))
    assert tier_resource("gpu_cuda") not in spec.resources
    assert set(spec.resources) == {tier_resource(t) for t in offered_tiers(a1.tier)}
    assert spec.num_gpus == 0
    assert spec.labels["topology.researchstack.io/arch"] == "aarch64"
    assert spec.memory_bytes is not None and spec.memory_bytes > 0


def test_offered_tiers_are_the_own_and_the_lower_ones_best_first():
    assert offered_tiers("gpu_apu")[0] == "gpu_apu"
    assert "gpu_vaapi" not in offered_tiers("gpu_apu")
    assert offered_tiers("relay") == ("relay",)


def test_an_unknown_tier_has_no_resource():
    with pytest.raises(ValueError, match="unknown tier"):
        tier_resource("quantum")


@pytest.mark.parametrize(("machine", "cuda_gpus"), [("radeon-desktop", 0), ("intel-nuc", 0), ("amd-apu-laptop", 0), ("multi-gpu-server", 2)])
def test_ray_is_offered_only_the_gpus_cuda_can_use(machine: str, cuda_gpus: int) -> None:
    """A VA-API GPU or an APU is a tier resource, never a Ray GPU: Ray hands GPUs out as CUDA devices."""
    host = facts(machine)
    spec = ray_node_spec(machine, host, EffectiveLimits(2, 2))
    assert spec.num_gpus == cuda_gpus
    assert spec.resources[tier_resource(host.tier)] == 2.0
