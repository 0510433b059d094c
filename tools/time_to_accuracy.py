"""Time to accuracy: iterations to target validation losses per schedule and optimizer on the
default corpus (seeds, median and range), and the projected time-to-accuracy ratio at the
paper's scale. The logic is in megatron/studies/time_to_accuracy.py.

    .venv/bin/python tools/time_to_accuracy.py --output runs/tta --seeds 1,2,3 \
        --config flush=1f1b:1e-3 --config paci=paci:1e-3 \
        --config paci-ef=paci:1e-3:--async-error-feedback --targets 5.6,5.4

Runs that already have a summary.json under --output are reused (the study resumes); --report
only reads them. Prints one JSON object and a markdown table.

`--engine single-process` trains each run in this process with the exact single-process engine
(megatron/studies/single_process_engine.py: 1f1b, paci, 2bw and pipedream) instead of a
4-process torchrun; `--model small` is the long-horizon study's model and `--model small-moe`
the same model with 8 experts, top-2 (docs/moe_study.md). With `--reference`,
`--calibration FILE.json` adds the projected time to each target: each run's segments between
drain points simulated with the file's per-stage costs (projected, not measured).
"""

import argparse
import json
import sys

from megatron.common.errors import run_tool
from megatron.studies import time_to_accuracy as tta


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--config", action="append", required=True, type=tta.parse_configuration,
        help="NAME=SCHEDULE:LR[:flag,flag=value,...]; repeat")  # fmt: skip
    add("--seeds", default="1,2,3")
    add("--iterations", type=int, default=200)
    add("--eval-interval", type=int, default=20)
    add("--targets", default="6.0,5.6", help="comma list of validation losses")
    add("--output", default="runs/time_to_accuracy")
    add("--report", action="store_true", help="do not train: read the runs under --output")
    add("--engine", choices=("torchrun", "single-process"), default="torchrun")
    add("--model", choices=sorted(tta.MODELS), default="demo")
    add("--eval-iters", type=int, default=5)
    add("--warmup-iters", type=int, default=None, help="default: the model's (demo: 10)")
    add("--exit-interval", type=int, default=None, metavar="N",
        help="single-process engine: stop each unfinished run at its first iteration that N "
        "divides, with its checkpoint, and print the curves so far (a screen: the next call "
        "without it goes on from there)")  # fmt: skip
    add("--reference", action="append", default=[], metavar="NAME=REFERENCE",
        help="also print the long-horizon table: NAME's final loss over REFERENCE's, by seed")  # fmt: skip
    add("--calibration", default=None, metavar="FILE.json",
        help="with --reference: also the projected time to each target, the simulator's pace "
        "for each run's pipeline with this calibration's costs (docs/calibration/)")  # fmt: skip
    options = parser.parse_args(argv)
    if options.engine == "torchrun" and (options.model, options.eval_iters, options.warmup_iters,
                                         options.exit_interval) != ("demo", 5, None, None):  # fmt: skip
        parser.error("--model, --eval-iters, --warmup-iters and --exit-interval need --engine "
                     "single-process")  # fmt: skip
    if options.exit_interval is not None and (options.exit_interval < 1 or options.report):
        parser.error("--exit-interval needs a value >= 1 and no --report")
    return options


def main(argv=None) -> int:
    options = parse_args(argv)
    seeds = [int(s) for s in options.seeds.split(",")]
    targets = [float(t) for t in options.targets.split(",")]
    configs = options.config
    if options.report:
        runs = [tta._read_run(options.output, c.name, s) for c in configs for s in seeds]
    elif options.engine == "single-process":
        runs = tta.run_all_single_process(
            configs, seeds, options.output, iterations=options.iterations,
            eval_interval=options.eval_interval, model=options.model,
            eval_iters=options.eval_iters, warmup_iters=options.warmup_iters,
            exit_interval=options.exit_interval,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
        if options.exit_interval:  # some runs unfinished: their curves so far, no table
            curves = {f"{r.configuration} seed {r.seed}": r.validation for r in runs}
            print(json.dumps({"validation_curves": curves}, indent=2))
            return 0
    else:
        runs = tta.run_all(configs, seeds, options.iterations, options.eval_interval,
                           options.output)  # fmt: skip
    table = tta.iteration_table(runs, targets)
    by_name = {c.name: c for c in configs}
    speed = tta.projected_speed(tuple(dict.fromkeys(c.schedule for c in configs)))
    report = {
        "configurations": {c.name: {"schedule": c.schedule, "lr": c.lr, "flags": list(c.flags)}
                           for c in configs},  # fmt: skip
        "seeds": seeds,
        "iterations": options.iterations,
        "eval_interval": options.eval_interval,
        "validation_curves": {f"{r.configuration} seed {r.seed}": r.validation for r in runs},
        "iterations_to_target": table,
        "projected_speed_over_flush": speed,
        "projected_time_to_accuracy_over_best_flush": tta.projected_ratios(
            table, by_name, targets, speed, options.iterations
        ),
    }
    print(json.dumps(report, indent=2))
    print(tta.markdown(report, targets))
    if options.reference:
        references = dict(text.split("=", 1) for text in options.reference)
        print()
        print(tta.long_horizon_markdown(runs, targets, references))
        if options.calibration:
            print()
            print(tta.projected_time_markdown(runs, targets, references, options.calibration))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
