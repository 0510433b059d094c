"""Per-stage durations: what the event engine needs to know about a pipeline's stages."""

import argparse
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class StageCosts:
    """Per-stage seconds of one forward, backward, weight-gradient pass and optimizer step.

    ``backward`` is the input-gradient part when ``weight_grad`` is given (what ZB-H1's B runs);
    schedules without a split backward pay both. ``p2p_latency`` is per transfer, None when the
    source did not say; ``source`` names where the figures come from.
    """

    forward: list[float]
    backward: list[float]
    weight_grad: list[float]
    step: list[float]
    p2p_latency: float | None = None
    source: str = ""

    def simulate_kwargs(self) -> dict:
        """The cost keywords of `simulate` (latency excluded)."""
        return {
            "forward_cost": self.forward,
            "backward_cost": self.backward,
            "weight_grad_cost": self.weight_grad,
            "step_cost": self.step,
        }

    def uniform(self) -> "StageCosts":
        """Every stage at the mean of the stages: what the closed form (m + N - 1) / m assumes."""

        def mean(values):
            return [sum(values) / len(values)] * len(values)

        return StageCosts(
            mean(self.forward),
            mean(self.backward),
            mean(self.weight_grad),
            mean(self.step),
            self.p2p_latency,
            self.source + " (uniform stages)",
        )


def parse_stage_costs(text: str, name: str, num_stages: int) -> list[float]:
    """'2' or '1,1,3,1' -> one finite, non-negative number per stage; ValueError naming `name`."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--{name}: expected a number or a comma list, got {text!r}") from None
    if len(values) == 1:
        values *= num_stages
    if len(values) != num_stages:
        raise ValueError(f"--{name}: {len(values)} values for {num_stages} stages")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"--{name}: costs must be finite and >= 0, got {text!r}")
    return values


class CostNoise:
    """Seeded per-action noise: each action's cost is its stage's nominal cost times a lognormal
    factor of mean 1 and coefficient of variation ``cv[stage]`` (0: no noise on that stage).

    Factors are drawn per (stage, action kind) from their own stream, in the order the stage runs
    that kind (microbatch order for forwards and backwards), so two schedules simulated with the
    same seed see the same cost for the same microbatch on the same stage: comparisons between
    rules are not blurred by different draws.
    """

    def __init__(self, cv: float | list[float], seed: int = 0):
        self.cv = cv
        self.seed = int(seed)
        self._streams: dict[tuple[int, str], tuple[random.Random, list[float]]] = {}

    def cv_of(self, stage: int) -> float:
        return float(self.cv if isinstance(self.cv, (int, float)) else self.cv[stage])

    def factor(self, stage: int, kind: str, index: int) -> float:
        """The factor of the `index`-th (0-based) action of `kind` ('F', 'B', 'W', 'S') on `stage`."""
        cv = self.cv_of(stage)
        if cv <= 0:
            return 1.0
        key = (stage, kind)
        if key not in self._streams:
            # A string seed is hashed with SHA-512 by `random`: the same stream in every process.
            self._streams[key] = (random.Random(f"{self.seed}/{stage}/{kind}"), [])
        stream, drawn = self._streams[key]
        while len(drawn) <= index:
            drawn.append(lognormal_factor(stream, cv))
        return drawn[index]


def lognormal_factor(rng: random.Random, cv: float) -> float:
    """One lognormal draw of mean 1 and coefficient of variation `cv` (1.0 when cv is 0)."""
    if cv <= 0:
        return 1.0
    sigma = math.sqrt(math.log1p(cv * cv))
    return rng.lognormvariate(-sigma * sigma / 2.0, sigma)


def stage_values(text: str) -> float | list[float]:
    """argparse type of the per-stage flags: '20' -> 20.0 (every stage), '20,40,20,20' -> one
    finite, non-negative value per stage (the count is checked against the pipeline later)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or a comma list, got {text!r}")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be finite and >= 0, got {text!r}")
    return values[0] if len(values) == 1 else values


def value_of_stage(values: float | list[float], stage: int, num_stages: int, name: str) -> float:
    """Stage `stage`'s entry of a `stage_values` result; ValueError when the count is wrong."""
    if isinstance(values, (int, float)):
        return float(values)
    if len(values) != num_stages:
        raise ValueError(f"{name}: {len(values)} values for {num_stages} pipeline stages")
    return float(values[stage])
