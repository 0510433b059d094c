"""The layer split that balances the pipeline, printed as Megatron flags, with each schedule's
pace on it against the even split.

    python tools/balance_layout.py --preset gpt2-medium --micro-batch-sizes 4 --microbatches 8
    python tools/balance_layout.py --calibration docs/calibration/cpu_small.json --stages 4 \\
        --micro-batch-sizes 1 --microbatches 4 --schedules 1f1b,paci

The costs come from the projection's cost model (the preset's model and hardware, any of
tools/project_paper_scale.py's flags) or from a calibration's per-layer profile
(tools/calibrate_stage.py); the throughputs from the simulator's steady state
(megatron/benchmarks/balance.py, projection.py). Prints one JSON object.
"""

import json
import sys

from megatron.benchmarks import balance, projection


def rows(options: projection.ProjectionOptions) -> list[dict]:
    shape = options.shape()
    calibration = options.calibration_data
    curve = None if calibration else projection.efficiency_curve(options)
    out = []
    for _, mbs, m in projection.configurations(options):
        if calibration:
            layers = balance.layer_costs_from_calibration(calibration, mbs)
            p2p = projection.calibrated_costs(options, mbs).p2p_latency
        else:
            layers = balance.layer_costs_from_model(options, shape, mbs, curve[mbs])
            p2p = projection.p2p_model(options, mbs)
        if options.enable_vocab_parallel:
            messages = projection.vocab_messages_s(options, mbs)
            layers = balance.partition_vocabulary(layers, options.stages, messages)
        even = list(options.stage_layers)
        throughput = {}

        def simulated(split: list[int]) -> dict[str, float]:
            key = tuple(split)
            if key not in throughput:
                costs = layers.stage_costs(split, p2p)
                throughput[key] = {
                    name: projection.steady_state(name, costs, m, mbs, 0.0).samples_per_s
                    for name in options.schedules
                }
            return throughput[key]

        # The split with the fastest slowest stage; of its equally slow orders, the one the
        # simulator finds fastest for the first schedule asked (PACI's pace is the default).
        target = "paci" if "paci" in options.schedules else options.schedules[0]
        candidates = balance.arrangements(balance.balanced_split(layers, options.stages, m))
        balanced = max(candidates, key=lambda split: simulated(split)[target])
        row = {"micro_batch_size": mbs, "microbatches": m, "even": even, "balanced": balanced,
               "flags": balance.megatron_flags(balanced),
               "layout": balance.layout_string(balanced)}  # fmt: skip
        for name, split in (("even", even), ("balanced", balanced)):
            row[f"slowest_stage_s_{name}"] = max(balance.pace(layers.stage_costs(split), m))
            for schedule, value in simulated(split).items():
                row[f"{schedule}_samples_per_s_{name}"] = value
        for schedule in options.schedules:
            row[f"{schedule}_gain"] = (
                row[f"{schedule}_samples_per_s_balanced"] / row[f"{schedule}_samples_per_s_even"]
            )
        out.append(row)
    return out


def main(argv=None) -> int:
    try:
        options = projection.parse_args(argv)
        result = {"preset": None if options.calibration_path else options.preset,
                  "calibration": options.calibration_path, "stages": options.stages,
                  "num_layers": options.num_layers, "rows": rows(options)}  # fmt: skip
    except (projection.SettingsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
