"""Multi-token prediction's flags, in process: Megatron's defaults reach megatron-core's
TransformerConfig, the MTP block wraps the decoder's last layer kind (with the portable spec's
norms where the decoder has them), and what is refused says so in one line. Training runs, the
last stage's embedding copy, flush parity and the asynchronous schedules' bounds with MTP:
tests/functional_tests/test_mtp_cases.py."""

import pytest
import torch
from small_run_flags import configured, validated

from megatron.common.errors import UserError
from megatron.model.build import transformer_config
from megatron.model.gpt import PortableNorm, SDPACoreAttention, layer_spec_for
from megatron.model.mtp import _mtp_beside_loss, mtp_block_spec

CPU = torch.device("cpu")
ROPE = ["--position-embedding-type", "rope"]


def test_megatrons_defaults_reach_the_config():
    config = transformer_config(configured(ROPE + ["--mtp-num-layers", "2"]), CPU)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.1)
    flags = ROPE + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]
    assert transformer_config(configured(flags), CPU).mtp_loss_scaling_factor == 0.3
    assert transformer_config(configured(ROPE), CPU).mtp_num_layers is None


def test_zero_layers_is_off_as_in_megatron():
    assert validated(["--mtp-num-layers", "0"]).mtp_num_layers is None


def test_the_block_wraps_the_decoders_last_layer():
    config = transformer_config(configured(ROPE + ["--mtp-num-layers", "2"]), CPU)
    layer = layer_spec_for(CPU, config)
    block = mtp_block_spec(layer, 2)
    assert len(block.layer_specs) == 2
    inner = block.layer_specs[0].submodules.transformer_layer
    assert inner == layer  # a copy: the MTP block's spec does not alias the decoder's
    assert inner.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    own = mtp_block_spec(layer, 1, norm=PortableNorm).layer_specs[0].submodules
    assert own.enorm is own.hnorm is own.layer_norm is PortableNorm


@pytest.mark.parametrize("extra, world_size, message", [
    (["--position-embedding-type", "learned_absolute"], 1,
     "--mtp-num-layers is not supported with --position-embedding-type learned_absolute"),
    (ROPE + ["--context-parallel-size", "2", "--attention-dropout", "0"], 2,
     "--mtp-num-layers with --context-parallel-size > 1 is not supported yet"),
    (ROPE + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
             "--num-layers", "4"], 2,
     "--mtp-num-layers with --pipeline-schedule zb-v is not supported yet"),
    (ROPE + ["--enable-vocab-parallel", "--pipeline-model-parallel-size", "2"], 2,
     "--mtp-num-layers"),
])  # fmt: skip
def test_bad_input_is_one_line(extra, world_size, message):
    with pytest.raises(UserError, match=message):
        validated(["--mtp-num-layers", "1"] + extra, world_size=world_size)


def test_a_negative_count_is_refused():
    with pytest.raises(UserError, match="--mtp-num-layers must be >= 0"):
        validated(["--mtp-num-layers", "-1"])


def test_mtp_goes_beside_the_loss_in_a_layout():
    assert _mtp_beside_loss("Et|tt|tmL") and _mtp_beside_loss("Ett|ttL")
    assert not _mtp_beside_loss("Etm|ttL")
    flags = ROPE + ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"]
    args = validated(flags + ["--pipeline-model-parallel-layout", "Etttt|mL"], world_size=2)
    assert args.stage_layers == [4, 0]  # the MTP layer on a stage of its own
    with pytest.raises(UserError, match="decoder layers must be placed before MTP layers"):
        validated(flags + ["--pipeline-model-parallel-layout", "Ettm|ttL"], world_size=2)
    three = ROPE + ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "3"]
    with pytest.raises(UserError, match="other than the loss's .m beside L. is not supported yet"):
        validated(three + ["--pipeline-model-parallel-layout", "Ett|ttm|L"], world_size=3)


@pytest.mark.parametrize("extra", [
    ["--num-virtual-stages-per-pipeline-rank", "2"],
    ["--pipeline-model-parallel-layout", "Et|t|t|tmL"],
    ["--pipeline-model-parallel-layout", "Et|t|t|tmL", "--pipeline-schedule", "paci"],
])  # fmt: skip
def test_interleaved_stages_take_mtp_on_the_last_chunk(extra):
    """Interleaved virtual stages, also from a layout with more stages than ranks: the MTP
    layer sits on the last rank's last chunk, beside the loss."""
    args = validated(ROPE + ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
                             "--num-layers", "4"] + extra, world_size=2)  # fmt: skip
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.chunk_layers == [[1, 1], [1, 1]]
