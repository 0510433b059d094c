"""Benchmarks, projections and reports of the pipeline schedules, built on the simulator core
(`megatron.pipeline.simulation`) and, for the measured ones, on real runs of pretrain_gpt.py.
`tools/` holds their command lines.

* `calibration_file`: the calibration file format (measured per-stage or per-layer costs), its
  reader and its writer;
* `projection`, `projection_report`: the cost model and the paper-scale projection, its report;
* `balance`: the layer split that balances a pipeline, as Megatron's layout flags;
* `comparison`: every schedule side by side on one model (pace, memory, drift);
* `emulated_benchmark`: real runs with emulated compute against the simulator's prediction;
  `runtime_comparison`: every runtime schedule measured side by side on one model's costs;
* `real_compute`: real GPT runs on 2 stages, flush vs PACI, and the balancing split;
* `arrival_study`: PACI's arrival rules on uneven and noisy stages;
* `gantt`: Gantt charts of simulated or traced timelines.
"""

from megatron.common import core_import  # noqa: F401  (megatron-core imported lean: see there)
