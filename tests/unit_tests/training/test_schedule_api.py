"""Megatron's calling conventions for the schedule entry points (megatron/pipeline/
forward_backward.py): the selector without arguments, the 3-tuple loss_func, wrapped models."""

import functools
import types

import pytest
import torch

from megatron.pipeline import forward_backward as fb


def schedule_name(schedule_function) -> str:
    """Which schedule a selected function runs (a named entry point, or a partial of the
    registered schedule)."""
    if isinstance(schedule_function, functools.partial):
        return schedule_function.args[0].name
    return schedule_function.__name__.rsplit("_", 1)[-1]


def test_selector_resolves_a_schedule_by_name_and_megatrons_call_runs_the_attached_plan():
    assert schedule_name(fb.get_forward_backward_func("paci")) == "paci"
    assert schedule_name(fb.get_forward_backward_func("1f1b")) == "1f1b"
    assert schedule_name(fb.get_forward_backward_func("zb-h1")) == "zb-h1"
    # Megatron's virtual pipeline (vp_size 2): the schedule's variant over virtual stages
    assert schedule_name(fb.get_forward_backward_func("paci", 2)) == "paci-interleaved"
    assert schedule_name(fb.get_forward_backward_func("1f1b", 2)) == "interleaved-1f1b"
    assert schedule_name(fb.get_forward_backward_func("zb-v")) == "zb-v"  # its own 2 chunks
    with pytest.raises(ValueError, match="--pipeline-schedule 2bw with virtual pipeline"):
        fb.get_forward_backward_func("2bw", 2)
    # Megatron's calls (no argument; pp_size, vp_size) run the plan attached to the model
    unbound = fb.get_forward_backward_func()
    assert unbound is fb.get_forward_backward_func(4, 2)  # resolved when called, on the model
    with pytest.raises(RuntimeError, match="no RankRuntime attached"):
        unbound(forward_step_func=None, data_iterator=None, model=torch.nn.Linear(1, 1),
                num_microbatches=1, seq_length=1, micro_batch_size=1)  # fmt: skip


def test_the_plan_is_resolved_once_with_its_options():
    from megatron.pipeline.plan import resolve_plan

    plan = resolve_plan("paci", num_stages=4, arrival_rule="fixed")
    assert plan.placement is None and not plan.flushes and plan.schedule.name == "paci"
    assert plan.synchronous.schedule.name == "1f1b" and plan.synchronous.flushes
    chunked = resolve_plan("1f1b", num_stages=4, chunks_per_rank=2, microbatch_group_size=4)
    assert chunked.placement.shape == "interleaved" and chunked.placement.chunks_per_rank == 2
    v = resolve_plan("dualpipe-v", num_stages=4)
    assert v.placement.shape == "v" and v.chunks_per_rank == 2 and v.flushes
    with pytest.raises(ValueError, match="runs 2 model chunks per rank, not 3"):
        resolve_plan("zb-v", num_stages=4, chunks_per_rank=3)


def test_paci_weight_stashing_stashes_in_both_orders_and_only_for_plain_paci():
    """--paci-weight-stashing: the reactive schedule and the fixed order it falls back to
    (--deterministic-mode) both stash; PACI's order is unchanged; other schedules refuse it."""
    from small_run_flags import validated

    from megatron.common.errors import UserError
    from megatron.pipeline.plan import resolve_plan
    from megatron.training.config import pipeline_plan

    plain = resolve_plan("paci", num_stages=4, arrival_rule="backward-first")
    stashed = resolve_plan("paci", num_stages=4, arrival_rule="backward-first",
                           weight_stashing=True)  # fmt: skip
    assert not plain.schedule.stashes_weights and not plain.schedule.fixed_order.stashes_weights
    assert stashed.schedule.stashes_weights and stashed.schedule.fixed_order.stashes_weights
    assert stashed.schedule.next_action is plain.schedule.next_action
    assert [stashed.schedule.extra_weight_versions(s, 4) for s in range(4)] == [3, 2, 1, 0]
    for name, chunks in (("1f1b", None), ("2bw", None), ("paci", 2)):
        with pytest.raises(ValueError, match="weight stashing runs on plain PACI"):
            resolve_plan(name, num_stages=4, chunks_per_rank=chunks, weight_stashing=True)
    paci4 = ["--pipeline-model-parallel-size", "4", "--eval-iters", "0",
                    "--untie-embeddings-and-output-weights", "--paci-weight-stashing"]  # fmt: skip
    args = validated(paci4 + ["--pipeline-schedule", "paci"], world_size=4)
    assert pipeline_plan(args).schedule.stashes_weights
    with pytest.raises(UserError, match="applies to --pipeline-schedule paci only"):
        validated(paci4 + ["--pipeline-schedule", "1f1b"], world_size=4)
    with pytest.raises(UserError, match="not supported yet with --pipeline-schedule paci"):
        validated(paci4 + ["--pipeline-schedule", "paci", "--save", "/tmp/unused"], world_size=4)


def test_three_tuple_loss_is_the_mean_over_tokens():
    losses = torch.tensor([2.0, 4.0, 6.0, 8.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])

    def megatron_loss_func(output):  # Megatron's current contract
        loss_sum = torch.sum(output * mask)
        tokens = mask.sum().to(torch.int)
        return loss_sum, tokens, {"lm loss": torch.cat([loss_sum.view(1), tokens.view(1)])}

    def forward_step(data_iterator, model):
        return losses, megatron_loss_func

    output, loss_func = fb._megatron_loss_contract(forward_step)(None, None)
    loss, reduced = loss_func(output)
    assert loss.item() == pytest.approx(14.0 / 3) and reduced["lm loss"].item() == loss.item()


def test_two_tuple_loss_passes_through_unchanged():
    expected = (torch.tensor(1.5), {"lm loss": torch.tensor(1.5)})
    assert fb._two_tuple_loss(lambda output: expected, None) is expected


def test_runtime_found_through_a_data_parallel_wrapper():
    class Wrapper(torch.nn.Module):  # what megatron-core's DistributedDataParallel looks like
        def __init__(self, module):
            super().__init__()
            self.module = module

    model, runtime = torch.nn.Linear(2, 2), types.SimpleNamespace()
    fb.attach_stage_runtime(model, runtime)
    assert fb.stage_runtime_of(Wrapper(Wrapper(model))) is runtime
    with pytest.raises(RuntimeError):
        fb.stage_runtime_of(torch.nn.Linear(2, 2))


def test_the_named_entries_run_the_plan_attached_to_the_model():
    """forward_backward_pipelining_paci (and _1f1b) run the run's plan with its options when
    the model carries one; Megatron's call goes through the entry of the attached plan."""
    from megatron.pipeline.plan import resolve_plan

    model = torch.nn.Linear(1, 1)
    runtime = types.SimpleNamespace(plan=None)
    model.pipeline_runtime = runtime
    plain_paci, plain_flush = fb.paci.SCHEDULE, fb.flush_1f1b.SCHEDULE
    assert fb._attached_or(plain_paci, model) is plain_paci  # no plan: plain PACI
    runtime.plan = resolve_plan("paci", num_stages=4, arrival_rule="fixed", inflight_limit="flush")
    attached = fb._attached_or(plain_paci, model)
    assert attached is runtime.plan.schedule and attached is not plain_paci
    assert attached.inflight_window(0, 4, 2) == 2  # the flush limit: min(N - s, a)
    assert fb._attached_or(plain_flush, model) is plain_flush  # a PACI plan is no 1F1B plan
    assert fb._NAMED_ENTRIES[runtime.plan.name] is fb.forward_backward_pipelining_paci
