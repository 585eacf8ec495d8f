"""A GPU workload opens the host's render nodes through the group the probe saw owning them.

/dev/dri/renderDN is 0660 root:render (udev), and every fabric unit runs as a
dynamic user: without that group in SupplementaryGroups= the unit sees the
device (PrivateDevices=no) but cannot open it. The group is the host's own
(`stat --format=%G`, the `dri-groups` capture), never assumed.
"""

from __future__ import annotations

import pytest

from reconciler.core.desired.load import load_desired
from reconciler.core.live.models import Placement
from reconciler.core.probe.parsers import ParseError, parse_dri_groups
from reconciler.core.render.artifacts import render, render_devices
from tests.conftest import EXAMPLE_FLEET
from tests.support.probe_fixtures import fixture_facts
from tests.support.render import golden_plan

UNITS = "etc/systemd/system"


def rendered(host: str, facts=None, plan=None) -> tuple[dict[str, str], tuple[str, ...]]:
    desired = load_desired(EXAMPLE_FLEET)
    result = render(desired, host, facts or fixture_facts(host), plan or golden_plan())
    return {a.path: a.content for a in result.artifacts}, result.notes


def unit(files: dict[str, str], name: str) -> str:
    return next(text for path, text in files.items() if path.endswith(f"{UNITS}/{name}"))


def test_qfox1s_probe_sees_both_render_nodes_owned_by_render():
    assert render_devices(fixture_facts("qfox-1")) == (("renderD128", "renderD129"), ("render",))


def test_a_gpu_service_joins_the_render_group_and_a_cpu_host_adds_none():
    files, _ = rendered("qfox-1")
    lupine = unit(files, "fabric-agent-lupine.service")
    assert "SupplementaryGroups=render" in lupine.splitlines()
    assert "PrivateDevices=yes" not in lupine
    # flac-fft's second replica runs on x86-spill, which has no render node.
    spill, _ = rendered("x86-spill")
    assert "SupplementaryGroups" not in unit(spill, "fabric-agent-flac-fft.service")


def test_a_cpu_service_gets_no_group_on_a_gpu_host():
    plan = golden_plan(placements=[Placement(service="flac-fft", replica=0, node="qfox-1", tier="gpu_cuda")])
    # flac-fft wants cpu_ffmpeg: it is not a GPU workload wherever it lands.
    files, _ = rendered("qfox-1", plan=plan)
    assert "SupplementaryGroups" not in unit(files, "fabric-agent-flac-fft.service")


def test_a_gpu_container_gets_the_render_nodes_as_devices():
    plan = golden_plan(placements=[Placement(service="braid", replica=0, node="qfox-1", tier="gpu_apu")])
    files, _ = rendered("qfox-1", plan=plan)
    braid = unit(files, "fabric-agent-braid.service")
    start = next(line for line in braid.splitlines() if line.startswith("ExecStart="))
    assert "--device=/dev/dri/renderD128" in start and "--device=/dev/dri/renderD129" in start
    assert "SupplementaryGroups=render" in braid.splitlines()


def test_the_ray_worker_of_a_gpu_host_opens_its_render_nodes_with_one_cuda_gpu():
    files, _ = rendered("qfox-1")
    worker = unit(files, "fabric-ray-worker.service")
    assert "SupplementaryGroups=render" in worker.splitlines()
    assert '"--num-gpus=1"' in worker
    assert "PrivateDevices=yes" not in worker


def test_a_render_node_whose_group_was_not_seen_adds_no_group_and_says_so():
    facts = fixture_facts("qfox-1")
    blind = facts.model_copy(
        update={"hardware": facts.hardware.model_copy(update={"gpus": [g.model_copy(update={"render_group": None}) for g in facts.hardware.gpus]})}
    )
    files, notes = rendered("qfox-1", facts=blind)
    assert "SupplementaryGroups" not in unit(files, "fabric-agent-lupine.service")
    assert any("lupine" in n and "no group owning renderD128, renderD129" in n for n in notes)


def test_the_group_is_read_per_render_node_from_stat():
    text = "### /dev/dri/renderD128\nrender\n### /dev/dri/renderD129\nvideo\n"
    assert parse_dri_groups(text) == {"renderD128": "render", "renderD129": "video"}


@pytest.mark.parametrize(
    "text",
    [
        "### /dev/dri/renderD128\nstat: cannot statx '/dev/dri/renderD128': Permission denied\n",
        "### /dev/dri/renderD128\nrender; rm -rf /\n",
        "### /dev/dri/../../etc/shadow\nroot\n",
        "render\n",
    ],
)
def test_what_is_not_a_group_name_of_a_render_node_is_no_group(text):
    with pytest.raises(ParseError):
        parse_dri_groups(text)
