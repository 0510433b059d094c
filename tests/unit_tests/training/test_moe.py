"""Mixture of experts: Megatron's MoE flags reach megatron-core, bad settings fail in one line,
and the fixes applied to megatron-core 0.16.1 at model build do what they say (megatron/model/moe/).
"""

import argparse

import pytest
import torch
from small_run_flags import configured, error_of, validated

from megatron.model.gpt import StageLayout, global_parameter_name, is_expert_parameter
from megatron.model.moe import (
    _all_to_all_with_int_splits,
    moe_layer_pattern,
    parse_moe_layer_freq,
    patch_megatron_core_moe,
)

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.mark.parametrize(
    "extra, world_size, message",
    [
        (["--moe-router-topk", "5"], 1, "--moe-router-topk 5 must be between 1 and --num-experts 4"),
        (["--expert-model-parallel-size", "3"], 3,
         "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
        (["--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"], 6,
         "world size 6 is not divisible by pipeline x expert tensor x expert parallel size "
         "2 x 1 x 4 = 8"),
        (["--tensor-model-parallel-size", "2"], 2,
         "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (as Megatron)"),
        (["--moe-token-dispatcher-type", "flex"], 1,
         "--moe-token-dispatcher-type flex is not supported yet (DeepEP / HybridEP need CUDA): "
         "use allgather or alltoall"),
        (["--moe-enable-deepep"], 1, "--moe-enable-deepep is not supported yet (GPU-only: DeepEP)"),
        (["--overlap-moe-expert-parallel-comm"], 1,
         "--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1 (as in "
         "Megatron)"),
        (["--fp8-format", "hybrid"], 1, "--fp8-format is not supported yet (GPU-only: FP8 needs "
         "Transformer Engine on a Hopper or newer GPU)"),
        (["--moe-flex-dispatcher-backend", "deepep"], 1,
         "--moe-flex-dispatcher-backend is not supported yet (GPU-only: the flex dispatcher's "
         "DeepEP and HybridEP kernels)"),
        (["--expert-model-parallel-size", "4", "--use-distributed-optimizer",
          "--num-distributed-optimizer-instances", "2"], 4,
         "--num-distributed-optimizer-instances 2 must divide the experts' data-parallel size 1"),
        (["--expert-model-parallel-size", "2", "--ckpt-format", "torch", "--save", "x"], 2,
         "--ckpt-format torch with expert parallelism is not supported yet (torch_dist, the "
         "default, is)"),
        (["--moe-layer-freq", "[1,0,1]"], 1, "--moe-layer-freq lists 3 layers, the model has 4"),
        (["--moe-layer-freq", "[0,0,0,0]"], 1, "--moe-layer-freq puts no MoE layer in the model"),
        (["--moe-router-num-groups", "2"], 1,
         "--moe-router-num-groups and --moe-router-group-topk go together"),
        (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
         "--moe-router-num-groups 3 must divide --num-experts 4 and --moe-router-group-topk 1 be "
         "between 1 and it"),
        (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"], 1,
         "--moe-router-load-balancing-type sinkhorn takes no aux loss: pass it alone, with "
         "--moe-aux-loss-coeff 0"),
        (["--moe-router-load-balancing-type", "quantile_balancing"], 1,
         "--moe-router-load-balancing-type quantile_balancing is not supported yet"),
        (["--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2",
          "--expert-model-parallel-size", "2"], 4,
         "--use-tp-pp-dp-mapping with MoE needs the experts' data-parallel size (1) to equal "
         "the data-parallel size (2); drop the flag or change the expert sizes"),
    ],
)  # fmt: skip
def test_bad_moe_settings_fail_in_one_line(extra, world_size, message):
    assert error_of(MOE + extra, world_size) == message


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--moe-router-topk", "1"], "Please use --moe-router-pre-softmax when topk is 1."),
        (["--moe-router-enable-expert-bias"], "only supports sigmoid score function"),
        (["--moe-pad-expert-input-to-capacity"], "moe_expert_capacity_factor must be set"),
        (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
         "--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type (2), got 1"),
    ],
)  # fmt: skip
def test_megatron_cores_own_moe_rules_are_one_line(extra, needle):
    message = error_of(MOE + extra)
    assert needle in message and "\n" not in message


def test_expert_tensor_parallel_size_of_a_dense_model_changes_nothing():
    from megatron.model.moe import moe_config_fields
    from megatron.training.config import RunConfig

    config = RunConfig.from_args(validated(["--expert-tensor-parallel-size", "4"]))
    assert config.moe is None
    assert moe_config_fields(config.moe, config.parallel) == {}  # no expert field reaches mcore


def test_moe_flags_need_experts_and_biases_are_refused():
    assert error_of(["--moe-ffn-hidden-size", "32"]) == "--moe-ffn-hidden-size needs --num-experts"
    message = error_of(["--num-experts", "4"])
    assert message == "MoE with linear biases is not supported yet: add --disable-bias-linear"


def test_moe_flags_reach_transformer_config():
    from megatron.model.build import transformer_config

    args = configured(MOE + [
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
        "--moe-z-loss-coeff", "0.001", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
        "--moe-token-dispatcher-type", "alltoall", "--moe-ffn-hidden-size", "48",
        "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate",
        "--moe-layer-freq", "([1]*1+[0]*1)*2", "--moe-expert-capacity-factor", "1.5",
        "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position",
        "--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
    ])  # fmt: skip
    config = transformer_config(args, torch.device("cpu"))
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert config.moe_aux_loss_coeff == 0.01 and config.moe_z_loss_coeff == 0.001
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 0.01
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_dtype == "fp32"
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_ffn_hidden_size == 48
    assert config.moe_shared_expert_intermediate_size == 64 and config.moe_shared_expert_gate
    assert config.moe_layer_freq == [1, 0, 1, 0]
    assert config.moe_expert_capacity_factor == 1.5 and config.moe_pad_expert_input_to_capacity
    assert config.moe_token_drop_policy == "position"
    # on CPU: SequentialMLP experts and the unfused permutation and router (docs/moe.md)
    assert not config.moe_grouped_gemm and not config.moe_permute_fusion
    assert not config.moe_router_fusion
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (1, 1)


def test_expert_tensor_parallel_size_defaults_to_tensor_parallel_size():
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = validated(MOE + tp2, 2)
    assert args.expert_tensor_parallel_size == 2
    args = validated(MOE + tp2 + ["--expert-model-parallel-size", "2",
                                  "--expert-tensor-parallel-size", "1"], 2)  # fmt: skip
    assert args.expert_tensor_parallel_size == 1 and args.data_parallel_size == 1


def test_moe_layer_freq_parses_like_megatron():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("([1]*3+[0]*1)*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert parse_moe_layer_freq("[0,1]") == [0, 1]
    for bad in ("__import__('os')", "[2,0]", "[1]*x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_moe_layer_freq(bad)
    assert moe_layer_pattern(2, 5) == [True, False, True, False, True]
    assert moe_layer_pattern([0, 1], 2) == [False, True]


def test_the_router_runs_without_transformer_engine_after_the_patch():
    """megatron-core's router gating reads `te_general_gemm`, bound only when TE imports."""
    from megatron.core.transformer.moe import moe_utils

    patch_megatron_core_moe()
    assert moe_utils.te_general_gemm is None or moe_utils.HAVE_TE
    weight = torch.randn(4, 8, requires_grad=True)
    inputs = torch.randn(3, 8, requires_grad=True)
    logits = moe_utils.router_gating_linear(inputs, weight, None, torch.float32)
    logits.sum().backward()
    torch.testing.assert_close(logits, inputs @ weight.t())
    torch.testing.assert_close(weight.grad, inputs.sum(0).expand(4, 8))


def test_all_to_all_split_sizes_reach_the_collective_as_lists_of_ints():
    seen = []

    def all_to_all(group, tensor, output_splits, input_splits):
        seen.append((output_splits, input_splits))
        return tensor

    wrapped = _all_to_all_with_int_splits(all_to_all)
    wrapped(None, torch.zeros(5), torch.tensor([2, 3]), torch.tensor([4, 1]))
    wrapped(None, torch.zeros(5), None, None)
    assert seen == [([2, 3], [4, 1]), (None, None)]
    assert all(type(n) is int for n in seen[0][0] + seen[0][1])
    patch_megatron_core_moe()
    patch_megatron_core_moe()  # idempotent: wrapped once
    from megatron.core.transformer.moe import token_dispatcher

    assert token_dispatcher.all_to_all.with_int_splits
    assert token_dispatcher.all_to_all.__closure__[0].cell_contents.__name__ == "all_to_all"


def test_experts_are_initialized_by_their_global_index():
    """Expert-parallel rank 1 of 2, two experts each: its local expert 0 is global expert 2,
    on any pipeline stage (layer offset applied too)."""
    layout = StageLayout(pipeline_rank=1, pipeline_size=2, tensor_rank=0, tensor_size=1,
                         num_layers=4, expert_rank=1, expert_size=2, local_experts=2)  # fmt: skip
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert is_expert_parameter(name)
    assert global_parameter_name(name, layout) == (
        "decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight"
    )
    shared = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    assert not is_expert_parameter(shared)
    assert (
        global_parameter_name(shared, layout)
        == "decoder.layers.3.mlp.shared_experts.linear_fc1.weight"
    )


def test_host_streams_stand_in_for_cuda_streams():
    from megatron.model.gpt import _HostCuda

    cuda = _HostCuda()
    stream = cuda.Stream()
    stream.wait_stream(cuda.current_stream())
    event = stream.record_event()
    event.synchronize()
    assert event.query() and cuda.current_device() == "cpu"
    with cuda.stream(stream):
        pass


def test_aux_loss_gradient_scale_is_what_each_backward_announces():
    """The runtime announces each backward's loss-gradient scale (tests/unit_tests/pipeline/
    test_rank_runtime.py checks the values per schedule); the aux-loss scaler takes it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron.model.moe import set_aux_loss_scale

    set_aux_loss_scale(0.25)
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 0.25
    set_aux_loss_scale(256.0)  # fp16: a stage's loss scale 1024 over 4 microbatches
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 256.0


def test_flag_coverage_of_megatron_moe_command_lines():
    """Megatron-LM's MoE and Mixtral pretraining configs (tools/megatron_flag_coverage.py
    --moe, figures in docs/megatron_flags.md): each is accepted or names what it lacks, at the
    world size its layout needs; with --pipeline-schedule paci the same ones start."""
    import json
    import os

    from megatron.studies import flag_coverage as coverage

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    with open(os.path.join(repo, "tools", "data", "megatron_moe_command_lines.json")) as handle:
        command_lines = coverage.decode(json.load(handle))
    assert len(command_lines) == 59
    outcomes = [coverage.classify(flags) for flags in command_lines.values()]
    kinds = [outcome for outcome, _ in outcomes]
    assert kinds.count("other error") == 0
    assert kinds.count("parse error") <= 13  # flags of features this project does not parse
    assert kinds.count("accepted") >= 37  # 33 before the distributed Muon (4 dist_muon lines)
    for flags, (outcome, _) in zip(command_lines.values(), outcomes):
        if outcome == "accepted":
            assert coverage.classify(coverage.with_schedule(flags, "paci"))[0] == "accepted"
    mixtral = command_lines["mixtral_8x7b_alltoall_tp2pp4ep4_release"]
    assert coverage.world_size_of(mixtral) == 4 * 8  # PP 4 x lcm(TP 2, ETP 2 (= TP) x EP 4)


def test_pretrain_gpt_stops_a_bad_moe_setting_with_one_line(capsys, monkeypatch):
    from small_run_flags import BASE

    monkeypatch.setenv("RANK", "0")
    import pretrain_gpt

    assert pretrain_gpt.main(BASE + MOE + ["--expert-model-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --num-experts 4 is not divisible by --expert-model-parallel-size 3\n"


class _BiasRoutedLayer(torch.nn.Module):
    """A router with megatron-core's sigmoid top-k routing and an expert bias buffer (which
    picks the experts, as megatron-core's TopKRouter's), and one linear expert per expert."""

    def __init__(self, hidden: int = 6, experts: int = 4):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(experts, hidden, generator=generator))
        self.experts = torch.nn.Parameter(torch.randn(experts, hidden, hidden, generator=generator))
        self.register_buffer("expert_bias", torch.zeros(experts))

    def forward(self, x):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        probs, routing_map = topk_routing_with_score_function(
            x @ self.router.t(), 2, score_function="sigmoid", expert_bias=self.expert_bias
        )
        outputs = torch.einsum("th,eoh->teo", x, self.experts)
        return (probs.unsqueeze(-1) * outputs).sum(dim=1), routing_map

    def recomputed(self, x):  # activation recomputation: the forward runs again in backward
        inputs = x.detach().requires_grad_(True)  # (a stage's input, as received)
        return torch.utils.checkpoint.checkpoint(lambda t: self(t)[0], inputs, use_reentrant=True)


@pytest.mark.parametrize("stash_the_bias", [True, False])
def test_a_backward_on_a_stashed_version_routes_as_its_forward_did(stash_the_bias):
    """2BW and PipeDream keep the expert bias with each weight version (routing_buffers, the
    runtime's versioned_buffers). A forward on version 0, then a step that changes the weights
    and the bias in place (the bias now prefers other experts), then the backward on version 0
    with the forward recomputed: with the bias stashed, the recomputation routes every token
    as the forward did and the gradients are those of version 0 (a copy of it, no step, no
    recomputation). With only the weights stashed (the live bias), it routes differently and
    the gradients are wrong: the case the stash exists for."""
    from megatron.model.moe import routing_buffers
    from megatron.pipeline.weight_stash import WeightStash

    layer, x = _BiasRoutedLayer(), torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    reference = _BiasRoutedLayer()
    expected_out, routed = reference(x)
    expected_out.pow(2).sum().backward()
    buffers = [layer.expert_bias] if stash_the_bias else []
    stash = WeightStash(layer.parameters(), buffers)
    out = layer.recomputed(x)  # version 0, live
    torch.testing.assert_close(out, expected_out)
    stash.keep_live_version()  # the step: weights and bias change in place
    with torch.no_grad():
        layer.router.mul_(0.9)
        layer.experts.add_(0.1)
        layer.expert_bias.copy_(10.0 * (~routed).float().mean(dim=0))  # prefer the unpicked
    stash.stepped()
    assert not torch.equal(layer(x)[1], routed)  # the live version routes differently
    with stash.swapped_in(0):
        if stash_the_bias:
            assert torch.equal(layer(x)[1], routed)
        out.pow(2).sum().backward()
    gradients = [layer.router.grad, layer.experts.grad]
    expected = [reference.router.grad, reference.experts.grad]
    same = all(torch.allclose(g, e, rtol=1e-6, atol=1e-7) for g, e in zip(gradients, expected))
    assert same == stash_the_bias
    assert torch.equal(layer.expert_bias, 10.0 * (~routed).float().mean(dim=0))  # live again
    assert routing_buffers(torch.nn.Module()) == []  # no router: nothing versioned


def test_expert_all_to_all_overlap_is_accepted_where_megatron_accepts_it_and_changes_nothing():
    """--overlap-moe-expert-parallel-comm is speed only (the all-to-alls overlap another
    microbatch's compute on CUDA streams in Megatron): the run's configuration is the one
    without it; Megatron's conditions hold, one line each."""
    layout = MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                    "alltoall", "--bf16"]  # fmt: skip
    assert configured(layout + ["--overlap-moe-expert-parallel-comm"], 2) == configured(layout, 2)
    without_bf16 = [flag for flag in layout if flag != "--bf16"]
    assert error_of(without_bf16 + ["--overlap-moe-expert-parallel-comm"], 2) == (
        "--overlap-moe-expert-parallel-comm needs --bf16 or --fp16 (as in Megatron)"
    )
    stages = layout + ["--overlap-moe-expert-parallel-comm", "--pipeline-model-parallel-size", "2"]
    assert error_of(stages, 4) == (
        "--overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size > 1 needs "
        "virtual pipeline stages (as in Megatron)"
    )
