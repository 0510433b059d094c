"""The largest stable step of each PACI stage on a quadratic, against flush's: a linear model of
the LR a stale stage can take.

    .venv/bin/python tools/delay_stability.py --stages 4 --accumulation 4 --beta 0.9,0.95

One direction of curvature `h` of the loss, a momentum optimizer with a fixed preconditioner
(Adam's first moment `m <- beta m + (1 - beta) g` over a second moment that has settled:
the update is `lr m / sqrt(v)`, so `k = lr h / sqrt(v)` is the step in units of the
curvature). Stage s of N with accumulation a takes its gradient at weights `D = (N-1-s)/a`
optimizer steps old on average: a share `D - floor(D)` of its microbatches at `floor(D) + 1`
steps back, the rest at `floor(D)`. With error feedback the stage steps
`x <- x - 2u(t) + u(t-1)`. The step is stable while every eigenvalue of the iteration lies
inside the unit circle; the table gives the largest such `k`. Flush (no delay) is stable to
`2 (1 + beta) / (1 - beta)`: 38 at beta 0.9, the preconditioned sharpness at which Adam trains
at the edge of stability. A stage stable only to a smaller `k` cannot follow flush into the
sharper regions a higher LR reaches.
"""

import argparse
import sys

import numpy as np

from megatron.common.errors import UserError, run_tool


def iteration_matrix(k: float, beta: float, delay: float, error_feedback: bool) -> np.ndarray:
    """The linear map of the state (x(t), ..., x(t-L), m(t-1), u(t-1)), L = ceil(delay)."""
    lower = int(np.floor(delay))
    share = delay - lower  # of the gradient taken one step further back
    depth = lower + 2  # x(t) .. x(t - lower - 1)
    size = depth + 2

    def step(state: np.ndarray) -> np.ndarray:
        xs, m_previous, u_previous = state[:depth], state[depth], state[depth + 1]
        gradient = k * ((1 - share) * xs[lower] + share * xs[lower + 1])
        m = beta * m_previous + (1 - beta) * gradient
        x_next = xs[0] - 2 * m + u_previous if error_feedback else xs[0] - m
        return np.concatenate([[x_next], xs[:-1], [m, m]])

    return np.stack([step(unit) for unit in np.eye(size)], axis=1)


def spectral_radius(k: float, beta: float, delay: float, error_feedback: bool) -> float:
    return float(max(abs(np.linalg.eigvals(iteration_matrix(k, beta, delay, error_feedback)))))


def largest_stable_step(beta: float, delay: float, error_feedback: bool = False,
                        ceiling: float = 1e4) -> float:  # fmt: skip
    """The largest k below which the iteration is stable from k = 0 on (to 0.1%)."""
    stable = lambda k: spectral_radius(k, beta, delay, error_feedback) < 1 - 1e-12  # noqa: E731
    grid = np.geomspace(1e-4, ceiling, 400)
    unstable = next((k for k in grid if not stable(k)), None)
    if unstable is None:
        return float("inf")
    low = grid[max(0, int(np.searchsorted(grid, unstable)) - 1)]
    high = unstable
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if stable(middle) else (low, middle)
    return float(low)


def stage_delays(stages: int, accumulation: int) -> list[float]:
    """Each PACI stage's mean gradient age in optimizer steps, (N - 1 - s) / a."""
    return [(stages - 1 - s) / accumulation for s in range(stages)]


def table(stages: int, accumulation: int, betas: list[float]) -> str:
    delays = stage_delays(stages, accumulation)
    head = " | ".join(f"stage {s} (delay {d:.2f})" for s, d in enumerate(delays))
    lines = [f"| first moment | flush | {head} |", "|---" * (len(delays) + 2) + "|"]
    for beta in betas:
        flush = largest_stable_step(beta, 0.0)
        for feedback in (False, True):
            cells = " | ".join(f"{largest_stable_step(beta, d, feedback):.1f}" for d in delays)
            name = f"{beta}, PACI{' with error feedback' if feedback else ''}"
            lines.append(f"| {name} | {flush:.1f} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=4, help="PACI's a")
    parser.add_argument("--beta", default="0.9", help="first-moment coefficients, comma list")
    options = parser.parse_args(argv)
    try:
        betas = [float(text) for text in options.beta.split(",")]
    except ValueError:
        raise UserError(f"--beta takes numbers separated by commas, not {options.beta!r}")
    if options.stages < 1 or options.accumulation < 1 or not all(0 <= b < 1 for b in betas):
        raise UserError("--stages and --accumulation must be >= 1 and each --beta in [0, 1)")
    print(f"largest stable step k = lr * curvature / sqrt(v), {options.stages} stages, "
          f"a = {options.accumulation}:")  # fmt: skip
    print(table(options.stages, options.accumulation, betas))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
