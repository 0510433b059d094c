"""Muon under Megatron's flags: torch's update with per-step Newton-Schulz coefficients
(`--muon-coefficient-type`), the full matrix under tensor parallelism (`--muon-tp-mode
duplicated`, TP = 2 against TP = 1 over two processes), Lion for the other parameters."""

import os
import socket

import pytest
import torch
from conftest import HEADS, HIDDEN, VOCAB, TinyGPT, optimizer_config
from rank_processes import start_ranks

from megatron.training.optimizer.muon import COEFFICIENT_SETS, Muon, coefficient_schedule
from megatron.training.optimizer.suite import build_suite_optimizer

STEPS = 3


def random_grads(model: torch.nn.Module, step: int) -> dict:
    generator = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}


@pytest.mark.parametrize("nesterov", [False, True])
def test_simple_coefficients_are_torchs_muon_bit_for_bit(nesterov):
    weights = [torch.nn.Parameter(torch.randn(12, 8)), torch.nn.Parameter(torch.randn(8, 20))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    ours = Muon(weights, coefficients=coefficient_schedule("simple", 5), **settings)
    torchs = torch.optim.Muon(copies, ns_steps=5, adjust_lr_fn="original", **settings)
    for step in range(STEPS):
        for a, b in zip(weights, copies):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            b.grad = a.grad.clone()
        ours.step()
        torchs.step()
    for a, b in zip(weights, copies):
        assert torch.equal(a, b)


def test_coefficient_types_change_the_update():
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    updates = {}
    for kind, steps in (("simple", 5), ("quintic", 5), ("polar_express", 8), ("aol", 4)):
        weight = torch.nn.Parameter(torch.zeros(16, 8))
        weight.grad = grad.clone()
        Muon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False,
             coefficients=coefficient_schedule(kind, steps)).step()  # fmt: skip
        updates[kind] = weight.detach()
        singular = torch.linalg.svdvals(updates[kind].float()) / 2**0.5  # LR x sqrt(16 / 8)
        assert 0.3 < singular.min() and singular.max() < 1.3, kind  # near-orthogonal
    assert len({tuple(u.flatten().tolist()) for u in updates.values()}) == len(COEFFICIENT_SETS)
    assert coefficient_schedule("quintic", 10) == COEFFICIENT_SETS["quintic"] * 2
    assert (
        coefficient_schedule("polar_express", 9)[-2:] == [COEFFICIENT_SETS["polar_express"][-1]] * 2
    )


def test_lion_for_the_other_parameters_with_megatrons_betas():
    import pytorch_optimizer

    model = TinyGPT()
    config = optimizer_config("muon", muon_scalar_optimizer="lion", lion_beta1=0.9, lion_beta2=0.97)
    chain = build_suite_optimizer(model, config)
    assert set(chain.optimizers) == {"lion", "muon"}
    lion = chain.optimizers["lion"]
    assert isinstance(lion, pytorch_optimizer.Lion) and lion.defaults["betas"] == (0.9, 0.97)
    embedding = model.embedding.word_embeddings.weight
    assert any(p is embedding for g in lion.param_groups for p in g["params"])


# ---------------------------------------------------------------------------- TP = 2 vs TP = 1
# The tiny model's tensor-parallel weights, as megatron-core shards them: the fused QKV and
# fc1-like weights by rows (partition_dim 0: query groups for the QKV), linear_proj by columns.
SHARDED = {"decoder.layers.0.self_attention.linear_qkv.weight": 0,
           "decoder.layers.0.self_attention.linear_proj.weight": 1}  # fmt: skip


def run_muon(model, config, tp_rank: int = 0, tp_size: int = 1, *, resume_at=None) -> dict:
    """STEPS Muon steps on `model` (its tensor-parallel weights this rank's shards); with
    `resume_at`, the optimizer is rebuilt there from its state_dict (a checkpoint's path)."""
    chain = build_suite_optimizer(model, config)
    for step in range(STEPS):
        if step == resume_at:
            saved = chain.state_dict()
            chain = build_suite_optimizer(model, config)
            chain.load_state_dict(saved)
        grads = random_grads(TinyGPT(), step)
        for name, param in model.named_parameters():
            grad = grads[name]
            if name in SHARDED:
                grad = grad.chunk(tp_size, dim=SHARDED[name])[tp_rank]
            param.grad = grad.clone()
        chain.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_model(tp_rank: int, tp_size: int) -> TinyGPT:
    model = TinyGPT()
    for name, param in model.named_parameters():
        if name in SHARDED:
            param.data = param.data.chunk(tp_size, dim=SHARDED[name])[tp_rank].clone()
            param.tensor_model_parallel, param.partition_dim = True, SHARDED[name]
    return model


def _tp_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        for mode in ("duplicated", "blockwise"):
            config = optimizer_config("muon", tensor_model_parallel_size=2, muon_tp_mode=mode,
                                      muon_coefficient_type="quintic", weight_decay=0.1)  # fmt: skip
            results[(mode, rank)] = run_muon(sharded_model(rank, 2), config, rank, 2)
            if mode == "duplicated":  # the full momentum survives a state_dict round trip
                results[("resumed", rank)] = run_muon(sharded_model(rank, 2), config, rank, 2,
                                                      resume_at=2)  # fmt: skip
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_duplicated_tp_mode_at_tp2_equals_tp1_and_blockwise_does_not():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = torch.multiprocessing.Manager().dict()
    start_ranks(_tp_worker, (port, results), nprocs=2)
    config = optimizer_config("muon", muon_coefficient_type="quintic", weight_decay=0.1)
    reference = run_muon(TinyGPT(), config)
    initial = dict(TinyGPT().named_parameters())
    assert HEADS % 2 == 0  # one query group per rank: the QKV splits by rows
    for name, full in reference.items():
        shards = [results[("duplicated", rank)][name] for rank in range(2)]
        gathered = torch.cat(shards, dim=SHARDED[name]) if name in SHARDED else shards[0]
        torch.testing.assert_close(gathered, full, rtol=1e-5, atol=1e-5)
        assert not torch.equal(full, initial[name].detach())  # the steps moved it
    for rank in range(2):
        for name, value in results[("duplicated", rank)].items():
            assert torch.equal(results[("resumed", rank)][name], value), name
    blockwise = torch.cat([results[("blockwise", r)][next(iter(SHARDED))] for r in range(2)])
    assert not torch.allclose(blockwise, reference[next(iter(SHARDED))], atol=1e-4)


def test_megatrons_muon_command_line_trains():
    """Megatron's Muon spelling, end to end in one process (megatron-core's GPT, mock data)."""
    from megatron.studies.delayed_reference import parse_reference_args, run_delayed

    flags = (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 1e-2 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 200 --attention-dropout 0 "
        "--hidden-dropout 0 --eval-iters 0 --optimizer muon --muon-momentum 0.95 "
        "--muon-nesterov --muon-tp-mode duplicated --muon-coefficient-type quintic "
        "--muon-num-ns-steps 5 --muon-scale-mode spectral --muon-extra-scale-factor 0.2 "
        "--muon-fp32-matmul-prec medium --muon-scalar-optimizer lion --lion-beta1 0.95"
    ).split()
    args = parse_reference_args(flags)
    assert (args.muon_nesterov, args.muon_coefficient_type) == (True, "quintic")
    losses = run_delayed(args, delay=0, evaluate=False).losses
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("split_qkv", [True, False])
def test_zero_grad_clears_every_weight_a_stand_in_steps(split_qkv):
    """The split QKV weight is stepped through its Q, K and V blocks, so it is in no
    optimizer's groups; zero_grad must still clear its gradient, or backward passes add each
    step's gradient to all the earlier ones (fp32 runs, where the model's gradient is the
    optimizer's: the QKV update and the clipping norm then drifted from step 2 on)."""
    model = TinyGPT()
    chain = build_suite_optimizer(model, optimizer_config("muon", muon_split_qkv=split_qkv))
    for step in range(2):
        tokens = torch.arange(VOCAB)
        hidden = model.embedding.word_embeddings(tokens)
        hidden = model.decoder.layers[0].self_attention.linear_qkv(hidden)[:, :HIDDEN]
        model.output_layer(hidden).square().mean().backward()
        chain.step()
        chain.zero_grad(set_to_none=True)
        assert [n for n, p in model.named_parameters() if p.grad is not None] == []


def test_vocabulary_shards_are_not_orthogonalized():
    """--enable-vocab-parallel's rows of the output layer and the input embedding are no
    transformer matrices: Muon leaves them to its AdamW part, as the whole layers."""
    from megatron.model.gpt import EMBEDDING_WEIGHT, VocabularyShardModule
    from megatron.training.optimizer.suite import is_hidden_matrix

    for whole in (EMBEDDING_WEIGHT, "output_layer.weight"):
        shard = VocabularyShardModule(0, 8, 16, 4, (0, 2), whole)
        assert not is_hidden_matrix("output_shard.weight", shard.weight)
    assert is_hidden_matrix("decoder.layers.0.mlp.linear_fc1.weight", torch.nn.Parameter(
        torch.empty(4, 4)))  # fmt: skip
