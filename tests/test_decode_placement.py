"""The default place of an exported program's decode method: the cost model's cheaper of the target's NPU and the
CPU, from the experts a decode token reads (the published config's arithmetic) and the launches it makes."""

import pytest

import npumoe
from npumoe.bench.scale import OLMOE_1B_7B_0924
from npumoe.core.ir.backend import capabilities
from npumoe.core.planning.placement import decode_placement
from npumoe.models.loader import config_spec

NPUS = ("htp", "ane", "intel_npu")


@pytest.mark.parametrize("target", NPUS)
def test_a_real_size_model_decodes_on_the_npu(target):
    """OLMoE-1B-7B: 16 layers, 8 of 64 experts a token, each 3 matrices of 2048 × 1024 in fp16."""
    cfg = OLMOE_1B_7B_0924
    placement = decode_placement(config_spec(cfg)[1], target)
    expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 2
    assert placement.expert_bytes == cfg["num_hidden_layers"] * cfg["num_experts_per_tok"] * expert
    assert placement.launches == cfg["num_hidden_layers"]
    caps = capabilities(target)
    assert placement.npu_seconds == pytest.approx(placement.expert_bytes / caps.weight_bytes_per_second
                                                  + 16 * caps.dispatch_seconds)
    assert placement.on == "npu" and placement.npu_seconds < placement.cpu_seconds
    assert "decode on the npu" in placement.reason() and "--decode-on cpu overrides" in placement.reason()


@pytest.mark.parametrize("target", NPUS)
def test_the_demo_whose_step_is_all_launches_decodes_on_the_cpu(target):
    placement = decode_placement(npumoe.load().spec, target)
    caps = capabilities(target)
    assert placement.launches * caps.dispatch_seconds > placement.cpu_seconds  # the launches alone cost more
    assert placement.on == "cpu" and placement.to_json()["chosen_by"] == "cost model"
