"""The study of PACI's arrival rules under uneven and noisy stage times (simulator only).

Every rule of `megatron.pipeline.schedules.paci.ARRIVAL_RULES` runs the same cases: N stages
whose forward/backward cost 1/2 except one slow stage (first, middle or last) at `factor` times
that, optionally with per-action lognormal noise of coefficient of variation `cv` (`CostNoise`,
the same seeded draws for every rule). For each run:

* pace: throughput relative to the slowest stage's bound, measured as the busiest stage's busy
  fraction inside the steady-state window (`SimulationResult.steady_utilization`): 1.0 means the
  pipeline runs exactly at that stage's pace (forward + backward per microbatch); with noise the
  bound is the work the busiest stage actually drew;
* drift: the largest per-stage drift against PACI's bound ceil((N - 1 - s) / a);
* peak in-flight microbatches per stage against admission's N - s, which is also the activation
  memory in microbatches (stage 0 holds the most: N).

`tools/study_arrival_rules.py` is the command line; docs/arrival_rules.md holds its results.
"""

import statistics
from dataclasses import asdict, dataclass

from megatron.pipeline.schedules.paci import ARRIVAL_RULES, drift_bound
from megatron.pipeline.simulation.costs import CostNoise
from megatron.pipeline.simulation.engine import simulate

FORWARD_COST, BACKWARD_COST = 1.0, 2.0
POSITIONS = ("first", "middle", "last")


@dataclass(frozen=True)
class Case:
    num_stages: int
    accumulation: int
    slow_position: str  # first, middle or last
    slow_factor: float
    cv: float = 0.0
    seed: int = 0

    @property
    def slow_stage(self) -> int:
        return {"first": 0, "middle": self.num_stages // 2 - 1, "last": self.num_stages - 1}[
            self.slow_position
        ]

    def costs(self) -> tuple[list[float], list[float]]:
        forward = [FORWARD_COST] * self.num_stages
        backward = [BACKWARD_COST] * self.num_stages
        forward[self.slow_stage] *= self.slow_factor
        backward[self.slow_stage] *= self.slow_factor
        return forward, backward


def grid(
    stages=(4, 8), accumulations=(1, 4, 8), factors=(1.2, 1.5, 2.0, 3.0), cvs=(0.0,), seeds=(0,)
) -> list[Case]:
    """Every combination; a noiseless case is run once, whatever the seeds."""
    cases = []
    for n in stages:
        for a in accumulations:
            for position in POSITIONS:
                for factor in factors:
                    for cv in cvs:
                        for seed in seeds if cv > 0 else seeds[:1]:
                            cases.append(Case(n, a, position, factor, cv, seed))
    return cases


def run_case(case: Case, rule: str, microbatches: int = 96) -> dict:
    """Simulate `case` under arrival `rule` over about `microbatches` microbatches."""
    n, a = case.num_stages, case.accumulation
    steps = max(microbatches // a, 4 + -(-n // a))
    forward, backward = case.costs()
    result = simulate(
        ARRIVAL_RULES[rule],
        num_stages=n,
        microbatches_per_step=a,
        steps=steps,
        forward_cost=forward,
        backward_cost=backward,
        noise=CostNoise(case.cv, seed=case.seed) if case.cv > 0 else None,
        record_timeline=False,
    )
    bounds = [drift_bound(s, n, a) for s in range(n)]
    return {
        **asdict(case),
        "rule": rule,
        "pace": max(result.steady_utilization),
        "max_drift": result.max_drift_per_stage,
        "drift_bound": bounds,
        "drift_within_bound": all(d <= b for d, b in zip(result.max_drift_per_stage, bounds)),
        "peak_inflight": result.peak_inflight_per_stage,
        "inflight_within_admission": all(
            p <= n - s for s, p in enumerate(result.peak_inflight_per_stage)
        ),
    }


def run_study(cases: list[Case], rules=None, microbatches: int = 96, pool=None) -> list[dict]:
    """Every rule on every case; `pool` (a multiprocessing pool) spreads the runs."""
    jobs = [(case, rule, microbatches) for case in cases for rule in rules or ARRIVAL_RULES]
    if pool is None:
        return [run_case(*job) for job in jobs]
    return pool.starmap(run_case, jobs)


def _key(row: dict) -> tuple:
    return (row["num_stages"], row["accumulation"], row["slow_position"], row["slow_factor"])


def summarize(rows: list[dict], default_rule: str) -> dict:
    """Per noise level: each rule's mean and worst pace, and the default's largest shortfall
    against the best rule of each case (seeds averaged); plus the invariant checks."""
    rules = sorted({row["rule"] for row in rows})
    levels = {}
    for cv in sorted({row["cv"] for row in rows}):
        at_level = [row for row in rows if row["cv"] == cv]
        per_case: dict[tuple, dict[str, list[float]]] = {}
        for row in at_level:
            per_case.setdefault(_key(row), {}).setdefault(row["rule"], []).append(row["pace"])
        means = {k: {r: statistics.fmean(v) for r, v in d.items()} for k, d in per_case.items()}
        shortfall = max(max(m.values()) - m[default_rule] for m in means.values())
        levels[cv] = {
            "cases": len(means),
            "runs_per_rule": len(at_level) // len(rules),
            "mean_pace": {r: statistics.fmean(m[r] for m in means.values()) for r in rules},
            "worst_pace": {r: min(m[r] for m in means.values()) for r in rules},
            "default_shortfall_vs_best": shortfall,
        }
    return {
        "default_rule": default_rule,
        "noise_levels": levels,
        "drift_within_bound": {
            r: all(x["drift_within_bound"] for x in rows if x["rule"] == r) for r in rules
        },
        "inflight_within_admission": {
            r: all(x["inflight_within_admission"] for x in rows if x["rule"] == r) for r in rules
        },
    }


def noiseless_table(rows: list[dict]) -> str:
    """Markdown: pace per rule for every noiseless case (one line per N, a, slow stage)."""
    rules = sorted({row["rule"] for row in rows})
    factors = sorted({row["slow_factor"] for row in rows})
    header = "| N | a | slow | " + " | ".join(f"{r} x{f:g}" for r in rules for f in factors)
    lines = [header + " |", "|" + "---|" * (3 + len(rules) * len(factors))]
    table: dict[tuple, float] = {(*_key(r), r["rule"]): r["pace"] for r in rows if r["cv"] == 0}
    for n in sorted({row["num_stages"] for row in rows}):
        for a in sorted({row["accumulation"] for row in rows}):
            for position in POSITIONS:
                cells = [table.get((n, a, position, f, r)) for r in rules for f in factors]
                text = ["-" if c is None else f"{c:.3f}" for c in cells]
                lines.append(f"| {n} | {a} | {position} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def noise_table(summary: dict) -> str:
    """Markdown: per noise level, each rule's mean / worst pace and the default's shortfall."""
    levels = summary["noise_levels"]
    rules = sorted(next(iter(levels.values()))["mean_pace"])
    header = "| CV | cases x seeds | " + " | ".join(f"{r} mean / worst" for r in rules)
    lines = [header + " | default's largest shortfall vs best |", "|" + "---|" * (3 + len(rules))]
    for cv, level in levels.items():
        cells = [f"{level['mean_pace'][r]:.3f} / {level['worst_pace'][r]:.3f}" for r in rules]
        seeds = level["runs_per_rule"] // max(level["cases"], 1)
        lines.append(
            f"| {cv:g} | {level['cases']} x {seeds} | "
            + " | ".join(cells)
            + f" | {100 * level['default_shortfall_vs_best']:.2f}% |"
        )
    return "\n".join(lines)
