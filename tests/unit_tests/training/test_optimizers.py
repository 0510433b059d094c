"""The optimizer suite: who steps which parameter, Muon's scale modes, split QKV, and what
Muon orthogonalizes under tensor parallelism (the local shard)."""

import math

import pytest
import torch
from conftest import TinyGPT, optimizer_config, schedule_config

from megatron.training.optimizer.build import build_lr_scheduler, build_optimizer
from megatron.training.optimizer.config import LRScheduleConfig
from megatron.training.optimizer.suite import OPTIMIZERS, OptimizerChain

NS = torch.optim._muon._zeropower_via_newtonschulz
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalized(grad: torch.Tensor, momentum: float = 0.9) -> torch.Tensor:
    """NS of the first step's momentum buffer (torch's Muon keeps an EMA: (1 - momentum) g)."""
    buffer = torch.zeros_like(grad).lerp_(grad, 1 - momentum)
    return NS(buffer, NS_COEFFICIENTS, 5, 1e-7).to(grad.dtype)


def set_random_grads(model: torch.nn.Module, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, param in model.named_parameters():
        param.grad = torch.randn(param.shape, generator=generator)
        grads[name] = param.grad.clone()
    return grads


def built(model, config):
    optimizer = build_optimizer(model, config)
    return optimizer, build_lr_scheduler(optimizer, schedule_config(config))


def test_argument_names_match_the_suite():
    from megatron.training.optimizer.flags import OPTIMIZER_NAMES

    assert OPTIMIZER_NAMES == OPTIMIZERS


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_updates_every_parameter(name):
    model = TinyGPT()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer, _ = built(model, optimizer_config(name, weight_decay=0.1))
    for step in range(2):  # SOAP's first step only sets up its preconditioner
        set_random_grads(model, step)
        optimizer.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        assert not torch.equal(p.detach(), before[n]), f"{name} left {n} unchanged"


@pytest.mark.parametrize("name", ["muon", "soap"])
def test_matrix_optimizers_take_hidden_matrices_only(name):
    model = TinyGPT()
    optimizer, _ = built(model, optimizer_config(name))
    assert isinstance(optimizer, OptimizerChain)
    adamw_params = {id(p) for g in optimizer.optimizers["adamw"].param_groups for p in g["params"]}
    matrix_params = {id(p) for g in optimizer.optimizers[name].param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        hidden = p.ndim == 2 and n.startswith("decoder.")
        if name == "muon" and n.endswith("linear_qkv.weight"):  # stepped as Q, K, V blocks
            assert id(optimizer.stand_ins[p]) in matrix_params and id(p) not in adamw_params
            continue
        assert (id(p) in matrix_params) == hidden and (id(p) in adamw_params) == (not hidden), n


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_adam_and_sgd_are_the_torch_optimizers_with_decay_groups(name):
    ours, theirs = TinyGPT(), TinyGPT()
    config = optimizer_config(name, weight_decay=0.1)
    optimizer, _ = built(ours, config)
    decay = [p for n, p in theirs.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in theirs.named_parameters() if p.ndim < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adam":
        reference = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8,
                                      weight_decay=0.1)  # fmt: skip
    else:
        reference = torch.optim.SGD(groups, lr=config.lr, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        set_random_grads(ours, step), set_random_grads(theirs, step)
        optimizer.step(), reference.step()
    for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "mode, scale",
    [("spectral", math.sqrt(24)), ("unit_rms_norm", math.sqrt(3)), ("shape_scaling", math.sqrt(3))],
)
def test_muon_update_is_scaled_newton_schulz_of_the_momentum(mode, scale):
    """First step: the update is lr x scale x NS(momentum buffer)."""
    model = TinyGPT()
    weight = model.decoder.layers[0].self_attention.linear_qkv.weight  # 24 x 8
    before = weight.detach().clone()
    config = optimizer_config("muon", muon_split_qkv=False, muon_scale_mode=mode,
                          muon_extra_scale_factor=0.5)  # fmt: skip
    optimizer, _ = built(model, config)
    grads = set_random_grads(model, 0)
    optimizer.step()
    expected = before - config.lr * scale * 0.5 * orthogonalized(
        grads["decoder.layers.0.self_attention.linear_qkv.weight"]
    )
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-5, atol=1e-7)


def test_muon_orthogonalizes_query_key_value_apart():
    model, fused = TinyGPT(), TinyGPT()
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    before = dict(model.named_parameters())[name].detach().clone()
    optimizer, _ = built(model, optimizer_config("muon"))
    grad = set_random_grads(model, 0)[name]
    optimizer.step()
    # Megatron's layout: per query group (2 here), that group's query rows, key rows, value rows.
    blocks = grad.view(2, 12, 8).split((4, 4, 4), dim=1)
    updates = [orthogonalized(b.reshape(8, 8)).view(2, 4, 8) * math.sqrt(8) for b in blocks]
    expected = before - 1e-2 * torch.cat(updates, dim=1).view(24, 8)
    actual = dict(model.named_parameters())[name].detach()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)
    fused_optimizer, _ = built(fused, optimizer_config("muon", muon_split_qkv=False))
    set_random_grads(fused, 0)
    fused_optimizer.step()
    assert not torch.allclose(dict(fused.named_parameters())[name], actual, atol=1e-4)


class ColumnParallelStandIn(torch.nn.Module):
    """One hidden matrix, as a tensor-parallel rank holds it: a row shard (partition_dim 0)."""

    def __init__(self, shard: torch.Tensor):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.linear_fc1 = torch.nn.Linear(shard.shape[1], shard.shape[0], bias=False)
        with torch.no_grad():
            self.decoder.linear_fc1.weight.copy_(shard)
        self.decoder.linear_fc1.weight.tensor_model_parallel = True
        self.decoder.linear_fc1.weight.partition_dim = 0


def test_muon_under_tensor_parallelism_orthogonalizes_the_local_shard():
    """--muon-tp-mode blockwise: each TP rank orthogonalizes (and scales by) its own shard;
    the result is not the shard of the whole matrix's update."""
    generator = torch.Generator().manual_seed(0)
    full, grad = torch.randn(16, 8, generator=generator), torch.randn(16, 8, generator=generator)
    lr = 1e-2
    updated = []
    for rank in range(2):
        shard = slice(8 * rank, 8 * (rank + 1))
        model = ColumnParallelStandIn(full[shard])
        config = optimizer_config("muon", tensor_model_parallel_size=2, muon_tp_mode="blockwise")
        optimizer, _ = built(model, config)
        model.decoder.linear_fc1.weight.grad = grad[shard].clone()
        optimizer.step()
        local = full[shard] - lr * math.sqrt(8) * orthogonalized(grad[shard])
        torch.testing.assert_close(model.decoder.linear_fc1.weight.detach(), local)
        updated.append(model.decoder.linear_fc1.weight.detach())
    gathered = full - lr * math.sqrt(16) * orthogonalized(grad)
    assert not torch.allclose(torch.cat(updated), gathered, atol=1e-4)


def test_muon_weight_decay_is_not_scaled_by_the_muon_lr_multiplier():
    model = TinyGPT()
    weight = model.decoder.layers[0].self_attention.linear_proj.weight
    before = weight.detach().clone()
    optimizer, _ = built(model, optimizer_config("muon", weight_decay=0.1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    torch.testing.assert_close(weight.detach(), before * (1 - 1e-2 * 0.1))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_copy_that_follows_the_first_stage_is_never_moved(name, bf16):
    """The last stage's tied copy under an asynchronous schedule sits in a group with LR and
    weight decay 0: bit for bit unchanged by every optimizer (fp32, or bf16 over fp32 main
    weights), while the other parameters are updated."""
    model = TinyGPT().to(torch.bfloat16 if bf16 else torch.float32)
    model.output_layer.weight.follows_first_stage = True
    config = optimizer_config(name, weight_decay=0.1, bf16=bf16)
    optimizer, scheduler = built(model, config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        for seed, (n, param) in enumerate(model.named_parameters()):
            generator = torch.Generator().manual_seed(10 * step + seed)
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            if bf16:
                param.main_grad.copy_(grad)
            else:
                param.grad = grad
        optimizer.step()
        scheduler.step(increment=1)
        optimizer.zero_grad(set_to_none=not bf16)
    after = dict(model.named_parameters())
    assert torch.equal(after["output_layer.weight"], before["output_layer.weight"])
    moved = [n for n in before if not torch.equal(after[n], before[n])]
    assert "embedding.word_embeddings.weight" in moved
    assert "decoder.layers.0.self_attention.linear_proj.weight" in moved


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", ["adam", "sgd", "muon"])
def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule(name, bf16):
    """--decoupled-lr / --decoupled-min-lr: the parameters megatron-core marks (word
    embedding, output layer) warm up to their own peak and decay to their own floor, the rest
    follow --lr / --min-lr; fp32 main copies keep the mark."""
    model = TinyGPT().to(torch.bfloat16 if bf16 else torch.float32)
    config = optimizer_config(name, lr=1e-2, min_lr=1e-3, decoupled_lr=3e-2,
                              decoupled_min_lr=2e-3, bf16=bf16)  # fmt: skip
    optimizer = build_optimizer(model, config)
    scheduler = build_lr_scheduler(optimizer, LRScheduleConfig(
        max_lr=1e-2, min_lr=1e-3, warmup_steps=2, decay_steps=6, decay_style="cosine",
        weight_decay=0.0))  # fmt: skip
    marked = {id(p) for p in _stepped(optimizer, model, "embedding", "output_layer")}
    own_lrs, shared_lrs = [], []
    for step in range(8):
        for group in optimizer.param_groups:
            own = group.get("is_decoupled_lr", False)
            assert own == any(id(p) in marked for p in group["params"])
            assert own == all(id(p) in marked for p in group["params"])
        own_lrs.append({g["lr"] for g in optimizer.param_groups if g.get("is_decoupled_lr")})
        # groups on the --lr schedule (Muon's own groups scale it by their shape)
        shared_lrs.append({g["lr"] for g in optimizer.param_groups if "max_lr" not in g})
        scheduler.step(increment=1)
    assert all(len(lrs) == 1 for lrs in own_lrs + shared_lrs)
    own_lrs, shared_lrs = [lrs.pop() for lrs in own_lrs], [lrs.pop() for lrs in shared_lrs]
    # warm-up from 0 over 2 steps, the peak, cosine decay until step 6, the floor
    assert own_lrs[:3] == pytest.approx([0.0, 1.5e-2, 3e-2]) and own_lrs[-1] == 2e-3
    assert shared_lrs[:3] == pytest.approx([0.0, 5e-3, 1e-2]) and shared_lrs[-1] == 1e-3
    middle = 2e-3 + 0.5 * (3e-2 - 2e-3) * (1 + math.cos(math.pi * (4 - 2) / (6 - 2)))
    assert own_lrs[4] == pytest.approx(middle)


def _stepped(optimizer, model, *prefixes):
    """What the optimizer steps for the model parameters whose names start with a prefix:
    the parameters themselves, or their fp32 main copies."""
    wanted = [p for n, p in model.named_parameters() if n.startswith(prefixes)]
    mains = getattr(optimizer, "main", None)
    if mains is None:
        return wanted
    by_param = {id(p): m for p, m in zip(optimizer.params, mains)}
    return [by_param[id(p)] for p in wanted]


def test_without_decoupled_lr_every_parameter_follows_lr():
    model = TinyGPT()
    optimizer = build_optimizer(model, optimizer_config("adam"))
    assert not any(g.get("is_decoupled_lr") for g in optimizer.param_groups)
    assert [g["wd_mult"] for g in optimizer.param_groups] == [1.0, 0.0]


def test_lr_warmup_init_starts_the_warmup_there():
    """--lr-warmup-init 1e-4 with 4 warmup steps to 1e-3: 1e-4 at step 0, linear up to 1e-3
    (megatron-core's scheduler, as Megatron builds it); the default starts at 0."""
    from small_run_flags import configured

    flags = [
        "--lr-warmup-iters",
        "4",
        "--lr-warmup-init",
        "1e-4",
        "--lr-decay-iters",
        "8",
        "--lr-decay-style",
        "constant",
    ]
    config = configured(flags).lr
    assert config.warmup_init == 1e-4 and configured([]).lr.warmup_init == 0.0
    scheduler = build_lr_scheduler(build_optimizer(TinyGPT(), optimizer_config("adam")), config)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    assert lrs == pytest.approx([1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3, 1e-3])
