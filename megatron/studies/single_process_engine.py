"""An exact single-process trainer for long studies: 1F1B-flush, PACI, PipeDream-2BW and
PipeDream on the real model.

PACI: the N stages of the model are built side by side in one process (the layout-independent
initialization of the distributed run), each with its own optimizer, LR schedule and stage-local
gradient clipping, as PACI's ranks have them, and each run by the real rank executor
(`megatron.pipeline.runtime.RankRuntime`) on its own thread, the stages joined by the
in-process transport (`megatron.pipeline.transport`). Between two drain points (evaluations,
the phase ends of `--paci-accumulation-schedule` and of `--async-sync-warmup-iters` /
`--async-sync-cooldown-iters`, the end) each stage's executor asks the run's PACI schedule for
its next pass, as a rank does (1F1B-flush's in the synchronous phases, each stage still clipping
and stepping on its own as PACI's ranks do there); under the default `fixed` arrival rule (and
under --deterministic-mode, whatever the rule) that decision reads the stage's counters alone,
so a stage's numbers are those of the distributed run. A reactive rule's order depends on
arrival times, which one process does not have: the engine refuses it without
--deterministic-mode. With `--paci-weight-stashing` the executors stash weights as the ranks
do.

PipeDream-2BW and PipeDream: the same stages and executors, each stage in the schedule's fixed
1F1B order (which weight version a pass sees depends on microbatch numbers alone, so the numbers
are those of any arrival order); the executor stashes weights as on a rank.

1F1B-flush: every step is synchronous, so the pipeline split does not change the numbers
(the functional tests check 4 stages against 1); the engine trains the whole model as one
stage (one executor), with the gradient norm over the whole model as flush takes it.

MoE models (megatron-core's MoE layer, expert parallel size 1) train as in `pretrain`: the aux
and z losses take each backward's loss-gradient scale from the executor, and each stage updates
its expert bias and resets its counters at its own step (`_with_moe`).

Mitigations are the optimizer's (`build_optimizer`: `--async-error-feedback`,
`--delay-compensation-lambda`, every `--optimizer`). Each evaluation reads the next
`--eval-iters` batches of the validation split, as `pretrain`'s do.

A run given a checkpoint file (`train(..., checkpoint=PATH)`) writes it at a drain point every
ten minutes and, started again, goes on from it with the numbers of an uninterrupted run (not
yet for the schedules that stash weight versions).

    from megatron.studies.single_process_engine import parse_engine_args, train
    result = train(parse_engine_args(flags))   # flags: pretrain_gpt.py's
"""

import collections
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from megatron.common.errors import UserError
from megatron.model.mtp import set_mtp_loss_scale

# Flags whose runtime behaviour the engine does not reproduce.
UNSUPPORTED = {
    "rampup_batch_size": "--rampup-batch-size",
    "step_batch_size_schedule": "--step-batch-size-schedule",
    "fp16": "--fp16",
    "bf16": "--bf16",
    "use_distributed_optimizer": "--use-distributed-optimizer",
    "calculate_per_token_loss": "--calculate-per-token-loss",
    "load": "--load",
    "save": "--save",
}
SCHEDULES = ("1f1b", "paci", "2bw", "pipedream")
# The final evaluation's batches of --global-batch-size, read from the validation split's start:
# the same batches for every run of a seed, whatever its iterations (each periodic evaluation
# reads on through the split, so two runs' last ones read the same batches only when they
# evaluated as often; the batches differ in difficulty by a few percent).
FINAL_EVAL_BATCHES = 64


@dataclass
class EngineRun:
    losses: list[float] = field(default_factory=list)  # training lm loss per iteration
    validation: list[dict] = field(default_factory=list)  # {"iteration", "lm loss", "tokens"}
    tokens: list[int] = field(default_factory=list)  # tokens consumed after each iteration
    # PACI: per phase of the accumulation schedule, {"a", "iterations", "max_drift" by stage}
    phases: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time, every thread's (a resumed run's parts summed)
    # lm loss over the first FINAL_EVAL_BATCHES validation batches after training (with evaluations)
    final_validation: float | None = None
    # where --exit-interval stopped the run before --train-iters (its checkpoint holds it there)
    stopped_at: int | None = None

    def to_dict(self) -> dict:
        return {
            "loss": self.losses,
            "validation": self.validation,
            "final_validation": self.final_validation,
            "tokens": self.tokens,
            "phases": self.phases,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
        }


def parse_engine_args(argv: list[str]):
    """pretrain_gpt.py flags validated for the world the flags describe (pipeline size N,
    tensor and data parallel 1); flush runs then train the whole model as one stage."""
    from megatron.training.arguments import build_parser, pipeline_plan, validate_args

    args = build_parser().parse_args(argv)
    if args.pipeline_schedule not in SCHEDULES:
        raise UserError(
            f"the single-process engine runs --pipeline-schedule {', '.join(SCHEDULES[:-1])} "
            f"or {SCHEDULES[-1]}, not {args.pipeline_schedule}"
        )
    if args.tensor_model_parallel_size != 1:
        raise UserError("the single-process engine runs --tensor-model-parallel-size 1 only")
    if args.expert_model_parallel_size != 1:
        raise UserError("the single-process engine runs --expert-model-parallel-size 1 only")
    for name, flag in UNSUPPORTED.items():
        if getattr(args, name, None):
            raise UserError(f"{flag} is not supported yet by the single-process engine")
    validate_args(args, world_size=args.pipeline_model_parallel_size)
    plan = pipeline_plan(args)
    if plan.schedule.depends_on_arrivals and not args.deterministic_mode:
        raise UserError(
            f"--paci-arrival-rule {args.paci_arrival_rule} orders passes by arrival times, "
            "which the single-process engine does not have: add --deterministic-mode (the "
            "rule's fixed order, as on the ranks) or train with torchrun"
        )
    if plan.flushes:  # the whole model as one stage
        from megatron.studies.delayed_reference import as_one_stage

        as_one_stage(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return args


def phases_of(config) -> list[tuple[int, int]]:
    """(a, iterations) of each phase: `--paci-accumulation-schedule`'s, then the configured a."""
    from megatron.training.batch_schedule import accumulation_phases

    return accumulation_phases(config)


def _local_stages(config, device) -> tuple[list, list]:
    """Each pipeline stage's model and optimizer step, built as its rank builds them."""
    from megatron.model.build import stage_layout
    from megatron.studies.delayed_reference import build_local_stage

    models, steps = [], []
    for stage in range(config.parallel.pipeline_model_parallel_size):
        layout = stage_layout(config)
        layout.pipeline_rank = stage
        model, step = build_local_stage(config, layout, device)
        models.append(model)
        steps.append(step)
    return models, steps


class _Stages:
    """The model's stages in one process, their data iterators and optimizer steps."""

    def __init__(self, config, consumed: tuple[int, int] = (0, 0)):
        from megatron.studies.delayed_reference import ensure_single_process_groups, prepare_host
        from megatron.training.batch_schedule import total_train_samples
        from megatron.training.data.datasets import data_iterators_of_run
        from megatron.training.tokenizer.tokenizer import build_tokenizer_of_run

        ensure_single_process_groups()
        torch.manual_seed(config.training.seed)
        device = torch.device("cpu")
        prepare_host(config, device)  # MoE: megatron-core's CUDA-minded parts on the host
        tokenizer = build_tokenizer_of_run(config.data)
        config = config.with_vocabulary(tokenizer.vocab_size)
        self.count = config.parallel.pipeline_model_parallel_size
        self.models, self.steps = _local_stages(config, device)
        training = config.training
        # evaluations, the final one included (when the run evaluates at all)
        self.evaluates = (
            bool(training.eval_iters) and training.train_iters >= training.eval_interval
        )
        valid_batches = training.eval_iters if self.evaluates else 0

        def iterators(valid_batches: int, consumed: tuple[int, int]):
            return data_iterators_of_run(
                config,
                tokenizer,
                train_samples=total_train_samples(config),
                valid_samples=valid_batches * training.global_batch_size,
                consumed_train_samples=consumed[0],
                consumed_valid_samples=consumed[1],
            )

        # The first and the last stage read the same streams, as on separate ranks.
        self.train_first, self.valid_first = iterators(valid_batches, consumed)
        if self.count > 1:
            self.train_last, self.valid_last = iterators(valid_batches, consumed)
        else:
            self.train_last, self.valid_last = self.train_first, self.valid_first
        self._iterators = iterators
        self.runtimes = _executors(config, self.models, device)
        if config.moe is not None:
            self.steps = _with_moe(self.runtimes, self.models, self.steps)
        for runtime in self.runtimes if config.model.mtp_num_layers else ():
            runtime.backward_scale_listeners.append(set_mtp_loss_scale)  # the main loss's
        self.tied = _tied_exchanges(config, self.models, self.steps) if self.count > 1 else []
        for s, exchange in zip((0, self.count - 1), self.tied):
            self.steps[s] = _around(self.steps[s], exchange)
        deferred = config.pipeline.paci_deferred_step
        if deferred:  # (validation refuses it with tied embeddings or MoE)
            self.steps = [_Deferred(step, runtime, deferred)
                          for step, runtime in zip(self.steps, self.runtimes)]  # fmt: skip

    def validation_from_start(self, batches: int) -> tuple:
        """The first and the last stage's validation iterators over the split's first
        `batches` batches."""
        first = self._iterators(batches, (0, 0))[1]
        return first, self._iterators(batches, (0, 0))[1] if self.count > 1 else first

    def state_dict(self) -> dict:
        """What a resumed run needs at a drain point (the pipeline empty, deferred updates
        landed): each stage's weights, optimizer (its delay corrections' buffers included),
        LR schedule and step counters."""
        stages = []
        for model, step in zip(self.models, self.steps):
            step = _stage_step(step)
            stages.append({
                "model": model.state_dict(), "optimizer": step.optimizer.state_dict(),
                "scheduler": step.scheduler.state_dict(),
                "counters": (step.calls, step.skipped_steps, step.consecutive_skips),
            })  # fmt: skip
        return {"stages": stages}

    def load_state_dict(self, state: dict) -> None:
        for model, step, saved in zip(self.models, self.steps, state["stages"], strict=True):
            step = _stage_step(step)
            model.load_state_dict(saved["model"])
            step.optimizer.load_state_dict(saved["optimizer"])
            step.scheduler.load_state_dict(saved["scheduler"])
            step.calls, step.skipped_steps, step.consecutive_skips = saved["counters"]

    def at_drain(self) -> None:
        """The pipeline is empty: deferred updates land; the last stage's tied copy catches up
        with the first's."""
        for step in self.steps:
            if isinstance(step, _Deferred):
                step.land()
        for exchange in self.tied:
            exchange.catch_up()

    def data_of(self, stage: int, first, last):
        """What stage `stage` reads: the first stage's stream, the last one's, or nothing."""
        return first if stage == 0 else last if stage == self.count - 1 else None

    def forward(self, stage: int, data_first, data_last, input_tensor):
        """Stage `stage`'s forward: (output, loss function of the last stage or None)."""
        from megatron.training.gpt_step import forward_step

        model = self.models[stage]
        if stage > 0:
            model.set_input_tensor(input_tensor)
        data = data_first if stage == 0 else data_last if stage == self.count - 1 else None
        output, loss_func = forward_step(data, model)
        return output, loss_func if stage == self.count - 1 else None


class _QueueChannel:
    """One side of the tied-embedding exchange between two stages' threads of this process:
    messages are copies through a queue, received in the order they were sent."""

    class _Sent:
        def wait(self) -> None:  # a put message is there for the peer
            return None

    def __init__(self, outbox: queue.Queue, inbox: queue.Queue):
        self.outbox, self.inbox = outbox, inbox

    def send(self, tensor: torch.Tensor):
        self.outbox.put(tensor.clone())
        return self._Sent()

    def receive(self, buffer: torch.Tensor) -> None:
        buffer.copy_(self.inbox.get())


def _tied_exchanges(config, models, steps) -> list:
    """Tied embeddings under PACI, 2BW and PipeDream: the first and the last stage's sides of
    the exchange the ranks run (optimizer/tied_embeddings.py), over queues; none when the
    embeddings are untied."""
    from megatron.training.optimizer.tied_embeddings import TiedEmbeddingExchange
    from megatron.training.training import tied_lag

    ends = (models[0], models[-1])
    shared = [[p for p in m.parameters() if getattr(p, "shared_embedding", False)] for m in ends]
    if not all(shared):
        return []
    down, up = queue.Queue(), queue.Queue()  # first -> last (weights), last -> first (gradients)
    channels = (_QueueChannel(down, up), _QueueChannel(up, down))
    exchanges = []
    for index, (weights, channel, step) in enumerate(zip(shared, channels, (steps[0], steps[-1]))):
        exchanges.append(
            TiedEmbeddingExchange(
                weights[0], is_first=index == 0, channel=channel, lag=tied_lag(config),
                gradient_of=_stage_step(step).gradient_of,
                refresh_main=getattr(_stage_step(step).optimizer, "refresh_from_model", None),
            )
        )  # fmt: skip
    return exchanges


def _stage_step(step):
    """The StageOptimizerStep under the MoE hooks' wrapper, if any."""
    return getattr(step, "stage_step", step)


def _around(step, exchange):
    """`step` with the tied exchange around it, as the ranks' MegatronStep runs it."""

    def run():
        exchange.before_step()
        report = step()
        exchange.after_step()
        return report

    run.stage_step = _stage_step(step)
    return run


class _Deferred:
    """--paci-deferred-step on one stage, as the ranks' MegatronStep runs it: the schedule's step
    sets the gradients aside (a reduction over one rank is a copy), the update lands before the
    stage's `passes`-th backward after the step or at a drain."""

    def __init__(self, step, runtime, passes: int):
        from megatron.training.optimizer.build import attach_reduction

        self.step, self.runtime, self.pending, self.passes = step, runtime, False, passes
        attach_reduction(step, bucket_size=None, overlap=False, force=True)
        runtime.gradient_syncs.append(self)

    def __call__(self):
        self.step.launch()
        self.pending = True
        self.runtime.pending_updates += 1
        return self.step.last

    def land(self) -> None:
        if self.pending:
            self.step.land()
            self.pending = False
            self.runtime.pending_updates -= 1

    def before_gradient_pass(self, chunk: int, passes: int) -> None:
        if passes >= self.passes:
            self.land()

    def before_final_pass(self, chunk: int) -> None:
        self.land()

    def chunk_complete(self, chunk: int) -> None:
        pass

    @property
    def stage_step(self):
        return self.step


def _executors(config, models, device) -> list:
    """One rank executor per stage, joined by an in-process transport."""
    from megatron.pipeline.runtime import PipelineContext, RankRuntime
    from megatron.pipeline.transport import InProcessTransport

    transport = InProcessTransport(tree_arity=config.pipeline.vocab_parallel_tree_arity)
    n = len(models)
    shape = (config.model.seq_length, config.training.micro_batch_size, config.model.hidden_size)
    return [
        RankRuntime(PipelineContext(stage=s, num_stages=n, device=device, backend="gloo"), model,
                    tensor_shape=shape, dtype=torch.float32, transport=transport.for_rank([s]))
        for s, model in enumerate(models)
    ]  # fmt: skip


def _with_moe(runtimes, models, steps) -> list:
    """MoE per stage, as the training loop has it: each backward sets the aux and z losses'
    gradient scale (the runtime announces it: 1/m for flush, 1/a for PACI), and each stage's
    step first updates its routers' expert bias and resets their per-step counters; the
    weight-stashing schedules keep the expert bias with each weight version. Returns
    the steps to run. (megatron-core keeps one aux-loss scale per process; the stages' threads
    all set the same value between two drain points, where a changes.)"""
    from megatron.model.moe import MoEStepHooks, routing_buffers, set_aux_loss_scale

    def with_hooks(step, hooks):
        def run():
            hooks.before_step()
            return step()

        run.stage_step = step
        return run

    for runtime, model in zip(runtimes, models):
        runtime.backward_scale_listeners.append(set_aux_loss_scale)
        runtime.versioned_buffers.extend(routing_buffers(model))  # stashed with the weights
    return [with_hooks(step, MoEStepHooks(model)) for step, model in zip(steps, models)]


def _run_stages(stages: _Stages, work) -> None:
    """`work(stage)` for every stage, each on its own thread (the executors wait on each
    other's tensors); the first error is raised here."""
    errors: list[BaseException] = []

    def guarded(stage: int) -> None:
        try:
            work(stage)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(stages.count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _segment(
    config, stages: _Stages, a: int, first: int, iterations: int, drift: list[int]
) -> list[float]:
    """`iterations` steps from an empty pipeline to an empty one, the first of them iteration
    `first` (1-based): 1F1B-flush on the one stage, or the schedule of those iterations on each
    stage (PACI's order, or 1F1B-flush's in a synchronous phase: a segment never spans a
    switch, which is a drain point); the per-iteration mean losses. `drift[s]` is raised to the
    most steps a microbatch crossed on stage s."""
    from megatron.training.gpt_step import forward_step
    from megatron.training.optimizer.delay_mitigation import (
        plan_of_iteration,
        set_synchronous_phase,
    )

    n, losses = stages.count, []
    plan = plan_of_iteration(config.pipeline, config.training.train_iters, first)
    for step in stages.steps:  # fresh gradients in a synchronous phase: nothing to correct
        set_synchronous_phase(_stage_step(step).optimizer, plan is not config.pipeline.plan)
    schedule = plan.schedule  # the run's, with its options
    schedule = schedule.fixed_order or schedule  # what --deterministic-mode runs on a rank

    def run(s: int) -> None:
        runtime = stages.runtimes[s]
        seen = collections.Counter(runtime.stats.drift_histogram)
        data = stages.data_of(s, stages.train_first, stages.train_last)
        for k in range(iterations):
            out = runtime.run_training(schedule, forward_step_func=forward_step,
                                       data_iterator=data, num_microbatches=a,
                                       optimizer_step_func=stages.steps[s],
                                       microbatches_before_drain=(iterations - k) * a)  # fmt: skip
            if s == n - 1:
                losses.append(sum(float(d["lm loss"]) for d in out) / len(out))
        grown = runtime.stats.drift_histogram - seen
        drift[s] = max(drift[s], max(grown, default=0))

    _run_stages(stages, run)
    return losses


@torch.no_grad()
def evaluate(training, stages: _Stages, batches: int | None = None, iterators=None) -> float:
    """Mean lm loss over the next `batches` (default `--eval-iters`) batches of
    `--global-batch-size` validation samples (each evaluation reads on through the validation
    split, starting over at its end, as `pretrain`'s evaluations do), or over `iterators`'."""
    first, last = iterators or (stages.valid_first, stages.valid_last)
    for model in stages.models:
        model.eval()
    total, count = 0.0, (batches or training.eval_iters) * training.num_microbatches
    for _ in range(count):
        hidden = None
        for s in range(stages.count):
            hidden, loss_func = stages.forward(s, first, last, hidden)
        total += float(loss_func(hidden)[1]["lm loss"])
    for model in stages.models:
        model.train()
    return total / count


def train(
    args, *, log=None, checkpoint: str | None = None, checkpoint_interval_s: float = 600.0
) -> EngineRun:
    """Train --train-iters iterations of --pipeline-schedule; evaluate every --eval-interval
    iterations when --eval-iters > 0. `args`: the flags of `parse_engine_args`, read once into
    the run's configuration. With `checkpoint` (a file), the run goes on from it when it
    exists and writes it (atomically) at the first drain point after every
    `checkpoint_interval_s` seconds of training, so a stopped study loses at most that much;
    the numbers are those of an uninterrupted run. --exit-interval stops the run at its first
    multiple (checkpoint written, no final evaluation, `stopped_at` set), for a later call to
    go on."""
    from megatron.training.config import RunConfig
    from megatron.training.training import drain_points

    start, cpu_start = time.perf_counter(), time.process_time()
    torch.set_num_threads(1)
    config = RunConfig.from_args(args)
    training = config.training
    stages, result, iteration, phase_ends = _start(config, args, checkpoint)
    result.stopped_at = None  # a run stopped by --exit-interval goes on
    tokens = result.tokens[-1] if result.tokens else 0
    start -= result.wall_s  # a resumed run's times count its earlier parts
    cpu_start -= result.cpu_s
    last_save = time.perf_counter()
    for point in drain_points(config, iteration):
        while iteration < point:  # a segment never spans a phase end: those are drain points
            index = next(i for i, (_, e) in enumerate(phase_ends) if e > iteration)
            a, phase_end = phase_ends[index]
            count = min(point, phase_end) - iteration
            drift = result.phases[index]["max_drift"]
            result.losses += _segment(config, stages, a, iteration + 1, count, drift)
            stages.at_drain()
            for _ in range(count):
                tokens += a * training.micro_batch_size * config.model.seq_length
                result.tokens.append(tokens)
            iteration += count
        if training.eval_iters and iteration % training.eval_interval == 0:
            loss = evaluate(training, stages)
            result.validation.append({"iteration": iteration, "lm loss": loss, "tokens": tokens})
            if log is not None:
                log(f"iteration {iteration}: train {result.losses[-1]:.4f}, valid {loss:.4f}")
        done = iteration >= training.train_iters
        if checkpoint and not done and time.perf_counter() - last_save >= checkpoint_interval_s:
            _save(checkpoint, args, config, stages, result, iteration, tokens, (start, cpu_start))
            last_save = time.perf_counter()
    if iteration < training.train_iters:  # --exit-interval: stopped here, goes on from here
        result.stopped_at = iteration
        if checkpoint:
            _save(checkpoint, args, config, stages, result, iteration, tokens, (start, cpu_start))
        return result
    if stages.evaluates:
        from_start = stages.validation_from_start(FINAL_EVAL_BATCHES)
        result.final_validation = evaluate(training, stages, FINAL_EVAL_BATCHES, from_start)
    result.wall_s = time.perf_counter() - start
    result.cpu_s = time.process_time() - cpu_start
    return result


def _save(checkpoint, args, config, stages, result, iteration: int, tokens: int, clocks):
    """The run's checkpoint now, with its times so far (`clocks`: the wall and CPU starts)."""
    training, seq_length = config.training, config.model.seq_length
    result.wall_s = time.perf_counter() - clocks[0]
    result.cpu_s = time.process_time() - clocks[1]
    samples = tokens // seq_length  # a varies with PACI's schedule
    evaluated = len(result.validation) * training.eval_iters * training.global_batch_size
    _write_checkpoint(checkpoint, args, stages, result, iteration, (samples, evaluated))


def _start(config, args, checkpoint: str | None):
    """The stages, the result so far, the iteration and the phase ends ((a, last iteration)
    per phase): a new run's, or the checkpoint's when it exists."""
    if checkpoint and not resumable(config):
        raise UserError(
            f"--pipeline-schedule {args.pipeline_schedule} keeps weight versions across drain "
            "points, which the single-process engine's checkpoints do not hold yet"
        )
    saved = _read_checkpoint(checkpoint, args)
    # the data iterators start where the checkpoint's run stopped reading (evaluations too)
    consumed = (
        (saved["consumed_train_samples"], saved["consumed_valid_samples"]) if saved else (0, 0)
    )
    stages = _Stages(config, consumed)
    result, phase_ends, end = EngineRun(), [], 0
    for a, iterations in phases_of(config):
        end += iterations
        phase_ends.append((a, end))
        result.phases.append({"a": a, "iterations": iterations, "max_drift": [0] * stages.count})
    if not saved:
        return stages, result, 0, phase_ends
    stages.load_state_dict(saved["stages"])
    torch.set_rng_state(saved["rng_state"])
    return stages, EngineRun(**saved["result"]), saved["iteration"], phase_ends


def resumable(config) -> bool:
    """Whether `train` can checkpoint the run: not the schedules that stash weight versions
    (2BW, PipeDream, PACI with --paci-weight-stashing), whose executors keep older versions
    from one drain point to the next."""
    return not config.pipeline.plan.schedule.stashes_weights


def _run_flags(args) -> dict:
    """The flags that decide a run's numbers, to refuse a checkpoint of another run
    (--exit-interval does not: a run stopped and resumed has the uninterrupted run's)."""
    kinds = (int, float, str, bool, list, tuple, type(None))
    return {k: v for k, v in sorted(vars(args).items())
            if isinstance(v, kinds) and k != "exit_interval"}  # fmt: skip


def _read_checkpoint(path: str | None, args) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    saved = torch.load(path, weights_only=False)
    changed = _differing_flags(saved["flags"], _run_flags(args))
    if changed:
        raise UserError(
            f"{path} is the checkpoint of another run (flags that differ: "
            f"{', '.join(changed)}): remove it to train this run from the start"
        )
    return saved


def _differing_flags(saved: dict, now: dict) -> list[str]:
    """The flags whose values differ; a flag one side lacks (added to the project since the
    checkpoint was written, or removed) is at its default there."""
    if saved == now:
        return []
    from megatron.training.arguments import build_parser

    default = build_parser().get_default
    return sorted(k for k in saved.keys() | now.keys()
                  if saved.get(k, default(k)) != now.get(k, default(k)))  # fmt: skip


def _write_checkpoint(path, args, stages, result, iteration: int, consumed: tuple) -> None:
    """At a drain point: the stages, the RNG, the (training, validation) samples read, what the
    run measured so far; written under a temporary name and renamed, so a stop while writing
    keeps the previous checkpoint."""
    payload = {
        "flags": _run_flags(args),
        "iteration": iteration,
        "consumed_train_samples": consumed[0],
        "consumed_valid_samples": consumed[1],
        "stages": stages.state_dict(),
        "rng_state": torch.get_rng_state(),
        "result": dataclasses.asdict(result),
    }
    temporary = f"{path}.tmp"
    torch.save(payload, temporary)
    os.replace(temporary, path)
