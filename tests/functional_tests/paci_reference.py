"""A single-process reference for pipelined training: every stage in one process, no runtime.

The stages of the model are built side by side (same layout-independent initialization as
the distributed run) and each stage's actions are replayed in the order the schedule gives
that stage, taken from the simulator with uniform costs. A stage's numerics depend only on its
own order of forwards, backwards and steps, so any global order that respects data
dependencies (the simulator's start times do) gives the numbers a correct distributed runtime
must give. Activations and gradients are handed over as plain tensors: no process groups, no
p2p, no RankRuntime.

    python tests/functional_tests/paci_reference.py <pretrain_gpt.py flags>
prints a JSON list: the lm loss of each iteration.
"""

import json
import sys


def main(argv: list[str]) -> int:
    from megatron.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(argv)
    num_stages = args.pipeline_model_parallel_size
    validate_args(args, world_size=num_stages * args.tensor_model_parallel_size)
    if args.tensor_model_parallel_size != 1:
        raise SystemExit("the reference runs tensor-parallel size 1 only")

    import torch
    import torch.distributed as dist

    from megatron.model.build import stage_layout
    from megatron.pipeline.accounting import preserve_versions
    from megatron.pipeline.schedules import get_schedule
    from megatron.pipeline.schedules.paci import with_paci_options
    from megatron.pipeline.simulation import simulate
    from megatron.studies.delayed_reference import build_local_stage, ensure_single_process_groups
    from megatron.training.config import RunConfig
    from megatron.training.data.datasets import data_iterators_of_run
    from megatron.training.tokenizer.tokenizer import build_tokenizer
    from pretrain_gpt import forward_step

    torch.set_num_threads(1)
    ensure_single_process_groups()
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    tokenizer = build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size)
    config = RunConfig.from_args(args, vocab_size=tokenizer.vocab_size)

    stages = []
    for stage in range(num_stages):
        layout = stage_layout(config)
        layout.pipeline_rank = stage
        model, step = build_local_stage(config, layout, device)
        stages.append({"model": model, "step": step, "inputs": {}, "outputs": {}})

    def data_iterator():  # first and last stage read the same stream, as on separate ranks
        samples = args.train_iters * args.global_batch_size
        return data_iterators_of_run(config, tokenizer, train_samples=samples, valid_samples=0)[0]

    stages[0]["data"] = data_iterator()
    stages[-1]["data"] = data_iterator() if num_stages > 1 else stages[0]["data"]

    schedule = with_paci_options(
        get_schedule(args.pipeline_schedule), args.paci_arrival_rule, args.paci_inflight_limit
    )
    if args.deterministic_mode and schedule.fixed_order is not None:
        schedule = schedule.fixed_order
    a = args.num_microbatches
    timeline = simulate(
        schedule,
        num_stages=num_stages,
        microbatches_per_step=a,
        steps=args.train_iters,
        forward_cost=1.0,
        backward_cost=2.0,
    ).timeline
    losses: dict[int, float] = {}
    for event in sorted(timeline, key=lambda e: (e.start_s, e.stage)):
        s, kind, mb = event.stage, event.action.kind.name, event.action.microbatch
        st = stages[s]
        model = st["model"]
        if kind == "FORWARD":
            input_tensor = None
            if s > 0:
                input_tensor = stages[s - 1]["outputs"][mb].detach().requires_grad_(True)
                model.set_input_tensor(input_tensor)
            output, loss_func = forward_step(st.get("data"), model)
            if s == num_stages - 1:
                loss, reduced = loss_func(output)
                losses[mb] = float(reduced["lm loss"])
                output = loss / a
            st["inputs"][mb], st["outputs"][mb] = input_tensor, output
        elif kind == "BACKWARD":
            output = st["outputs"].pop(mb)
            if s == num_stages - 1:
                torch.autograd.backward(output)
            else:
                grad = stages[s + 1]["inputs"].pop(mb).grad
                torch.autograd.backward(output, grad_tensors=grad)
            if s == 0:
                st["inputs"].pop(mb)
        elif kind == "STEP":
            with preserve_versions(model.parameters()):
                st["step"]()
    per_iteration = [
        sum(losses[j] for j in range(k * a, (k + 1) * a)) / a for k in range(args.train_iters)
    ]
    print(json.dumps(per_iteration))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
