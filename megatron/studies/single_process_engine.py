"""An exact single-process trainer for long studies: 1F1B-flush and PACI on the real model.

PACI: the N stages of the model are built side by side in one process (the layout-independent
initialization of the distributed run), each with its own optimizer, LR schedule and stage-local
gradient clipping, as PACI's ranks have them. Between two drain points (evaluations, the phase
ends of `--paci-accumulation-schedule`, the end) each stage replays its own order of forwards,
backwards and steps, taken from the simulator with uniform costs; a stage's numbers depend only
on that order, so any global order that respects the data dependencies gives what the
distributed runtime gives. Activations and gradients are handed over as plain tensors. That is
the runtime's order exactly under the default `fixed` arrival rule (and --deterministic-mode);
a reactive rule's order depends on timing, and the engine replays the one it takes with uniform
stage costs.

1F1B-flush: every step is synchronous, so the pipeline split does not change the numbers
(the functional tests check 4 stages against 1); the engine trains the whole model as one
stage, with the gradient norm over the whole model as flush takes it.

Mitigations are the optimizer's (`build_optimizer`: `--async-error-feedback`,
`--delay-compensation-lambda`, every `--optimizer`). Validation uses the same fixed set of
`--eval-iters` batches of the validation split at every evaluation, as `pretrain` does.

    from megatron.studies.single_process_engine import parse_engine_args, train
    result = train(parse_engine_args(flags))   # flags: pretrain_gpt.py's
"""

import functools
import os
import time
from dataclasses import dataclass, field

import torch

from megatron.training.errors import UserError

# Flags whose runtime behaviour the engine does not reproduce.
UNSUPPORTED = {
    "async_sync_warmup_iters": "--async-sync-warmup-iters",
    "async_sync_cooldown_iters": "--async-sync-cooldown-iters",
    "rampup_batch_size": "--rampup-batch-size",
    "fp16": "--fp16",
    "bf16": "--bf16",
    "use_distributed_optimizer": "--use-distributed-optimizer",
    "calculate_per_token_loss": "--calculate-per-token-loss",
    "load": "--load",
    "save": "--save",
}
SCHEDULES = ("1f1b", "paci")


@dataclass
class EngineRun:
    losses: list[float] = field(default_factory=list)  # training lm loss per iteration
    validation: list[dict] = field(default_factory=list)  # {"iteration", "lm loss", "tokens"}
    tokens: list[int] = field(default_factory=list)  # tokens consumed after each iteration
    # PACI: per phase of the accumulation schedule, {"a", "iterations", "max_drift" by stage}
    phases: list[dict] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "loss": self.losses,
            "validation": self.validation,
            "tokens": self.tokens,
            "phases": self.phases,
            "wall_s": self.wall_s,
        }


def parse_engine_args(argv: list[str]):
    """pretrain_gpt.py flags validated for the world the flags describe (pipeline size N,
    tensor and data parallel 1); flush runs then train the whole model as one stage."""
    from megatron.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(argv)
    if args.pipeline_schedule not in SCHEDULES:
        raise UserError(
            f"the single-process engine runs --pipeline-schedule {' or '.join(SCHEDULES)}, "
            f"not {args.pipeline_schedule}"
        )
    if args.tensor_model_parallel_size != 1:
        raise UserError("the single-process engine runs --tensor-model-parallel-size 1 only")
    for name, flag in UNSUPPORTED.items():
        if getattr(args, name, None):
            raise UserError(f"{flag} is not supported yet by the single-process engine")
    validate_args(args, world_size=args.pipeline_model_parallel_size)
    if args.pipeline_schedule == "1f1b":
        from megatron.studies.delayed_reference import as_one_stage

        as_one_stage(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return args


def phases_of(args) -> list[tuple[int, int]]:
    """(a, iterations) of each phase: `--paci-accumulation-schedule`'s, then the configured a."""
    from megatron.training.batch_schedule import accumulation_phases

    return accumulation_phases(args)


@functools.cache
def _stage_orders(num_stages: int, a: int, steps: int, rule: str | None, limit: str | None,
                  deterministic: bool) -> tuple:  # fmt: skip
    """((stage, kind, microbatch), ...) of `steps` PACI steps from an empty pipeline, in an
    order that respects the data dependencies (the simulator's start times)."""
    from megatron.pipeline.schedules import get_schedule
    from megatron.pipeline.schedules.paci import with_paci_options
    from megatron.pipeline.simulation import simulate

    schedule = with_paci_options(get_schedule("paci"), rule, limit)
    if deterministic and schedule.fixed_order is not None:
        schedule = schedule.fixed_order
    timeline = simulate(schedule, num_stages=num_stages, microbatches_per_step=a, steps=steps,
                        forward_cost=1.0, backward_cost=2.0).timeline  # fmt: skip
    ordered = sorted(timeline, key=lambda e: (e.start_s, e.stage))
    return tuple((e.stage, e.action.kind.name, e.action.microbatch) for e in ordered)


class _Stages:
    """The model's stages in one process, their data iterators and optimizer steps."""

    def __init__(self, args):
        from megatron.studies.delayed_reference import (
            build_local_stage,
            ensure_single_process_groups,
        )
        from megatron.training.batch_schedule import total_train_samples
        from megatron.training.data.datasets import data_iterators_from_args
        from megatron.training.tokenizer.tokenizer import build_tokenizer_from_args
        from megatron.training.training import padded_vocab_size, stage_layout

        ensure_single_process_groups()
        torch.manual_seed(args.seed)
        device = torch.device("cpu")
        tokenizer = build_tokenizer_from_args(args)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
        self.count = args.pipeline_model_parallel_size
        self.models, self.steps = [], []
        for stage in range(self.count):
            layout = stage_layout(args)
            layout.pipeline_rank = stage
            model, step = build_local_stage(args, layout, device, args.padded_vocab_size)
            self.models.append(model)
            self.steps.append(step)
        evaluations = args.eval_iters and args.train_iters >= args.eval_interval

        def iterators():
            return data_iterators_from_args(
                args,
                tokenizer,
                train_samples=total_train_samples(args),
                valid_samples=args.eval_iters * args.global_batch_size if evaluations else 0,
            )

        # The first and the last stage read the same streams, as on separate ranks.
        self.train_first, self.valid_first = iterators()
        if self.count > 1:
            self.train_last, self.valid_last = iterators()
        else:
            self.train_last, self.valid_last = self.train_first, self.valid_first

    def forward(self, stage: int, data_first, data_last, input_tensor):
        """Stage `stage`'s forward: (output, loss function of the last stage or None)."""
        from pretrain_gpt import forward_step

        model = self.models[stage]
        if stage > 0:
            model.set_input_tensor(input_tensor)
        data = data_first if stage == 0 else data_last if stage == self.count - 1 else None
        output, loss_func = forward_step(data, model)
        return output, loss_func if stage == self.count - 1 else None


def _flush_segment(stages: _Stages, a: int, iterations: int, result: EngineRun) -> None:
    """Synchronous steps of the whole model (one stage): a microbatches, then the step."""
    step = stages.steps[0]
    for _ in range(iterations):
        total = 0.0
        for _ in range(a):
            output, loss_func = stages.forward(0, stages.train_first, stages.train_first, None)
            loss, reduced = loss_func(output)
            (loss / a).backward()
            total += float(reduced["lm loss"])
        step()
        result.losses.append(total / a)


def _paci_segment(args, stages: _Stages, a: int, iterations: int, drift: list[int]) -> list:
    """`iterations` PACI steps from an empty pipeline to an empty one; the per-iteration mean
    losses. `drift[s]` is raised to the most steps a microbatch crossed on stage s."""
    from megatron.pipeline.accounting import preserve_versions

    n = stages.count
    inputs = [dict() for _ in range(n)]
    outputs = [dict() for _ in range(n)]
    version_at_forward = [dict() for _ in range(n)]
    version = [0] * n
    losses: dict[int, float] = {}
    order = _stage_orders(n, a, iterations, args.paci_arrival_rule, args.paci_inflight_limit,
                          bool(args.deterministic_mode))  # fmt: skip
    for s, kind, mb in order:
        if kind == "FORWARD":
            input_tensor = None
            if s > 0:
                input_tensor = outputs[s - 1][mb].detach().requires_grad_(True)
            output, loss_func = stages.forward(s, stages.train_first, stages.train_last,
                                               input_tensor)  # fmt: skip
            if loss_func is not None:
                loss, reduced = loss_func(output)
                losses[mb] = float(reduced["lm loss"])
                output = loss / a
            inputs[s][mb], outputs[s][mb] = input_tensor, output
            version_at_forward[s][mb] = version[s]
        elif kind == "BACKWARD":
            output = outputs[s].pop(mb)
            if s == n - 1:
                torch.autograd.backward(output)
            else:
                torch.autograd.backward(output, grad_tensors=inputs[s + 1].pop(mb).grad)
            if s == 0:
                inputs[s].pop(mb)
            drift[s] = max(drift[s], version[s] - version_at_forward[s].pop(mb))
        elif kind == "STEP":
            with preserve_versions(stages.models[s].parameters()):
                stages.steps[s]()
            version[s] += 1
    return [sum(losses[j] for j in range(k * a, (k + 1) * a)) / a for k in range(iterations)]


@torch.no_grad()
def evaluate(args, stages: _Stages) -> float:
    """Mean lm loss over `--eval-iters` batches of `--global-batch-size` validation samples
    (the same set every time: the validation iterator cycles over exactly these)."""
    for model in stages.models:
        model.eval()
    total, count = 0.0, args.eval_iters * args.num_microbatches
    for _ in range(count):
        hidden = None
        for s in range(stages.count):
            hidden, loss_func = stages.forward(s, stages.valid_first, stages.valid_last, hidden)
        total += float(loss_func(hidden)[1]["lm loss"])
    for model in stages.models:
        model.train()
    return total / count


def train(args, *, log=None) -> EngineRun:
    """Train `args.train_iters` iterations of `args.pipeline_schedule`; evaluate every
    `--eval-interval` iterations when `--eval-iters` > 0."""
    start = time.perf_counter()
    torch.set_num_threads(1)
    stages = _Stages(args)
    result, iteration, tokens = EngineRun(), 0, 0
    phase_ends, end = [], 0
    for a, iterations in phases_of(args):
        end += iterations
        phase_ends.append((a, end))
        result.phases.append({"a": a, "iterations": iterations, "max_drift": [0] * stages.count})
    from megatron.training.training import drain_points

    for point in drain_points(args, 0):
        while iteration < point:  # a segment never spans a phase end: those are drain points
            index = next(i for i, (_, e) in enumerate(phase_ends) if e > iteration)
            a, phase_end = phase_ends[index]
            count = min(point, phase_end) - iteration
            if stages.count == 1:
                _flush_segment(stages, a, count, result)
            else:
                drift = result.phases[index]["max_drift"]
                result.losses += _paci_segment(args, stages, a, count, drift)
            for _ in range(count):
                tokens += a * args.micro_batch_size * args.seq_length
                result.tokens.append(tokens)
            iteration += count
        if args.eval_iters and iteration % args.eval_interval == 0:
            loss = evaluate(args, stages)
            result.validation.append({"iteration": iteration, "lm loss": loss, "tokens": tokens})
            if log is not None:
                log(f"iteration {iteration}: train {result.losses[-1]:.4f}, valid {loss:.4f}")
    result.wall_s = time.perf_counter() - start
    return result
