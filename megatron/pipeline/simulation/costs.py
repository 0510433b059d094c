"""Per-stage durations: what the event engine needs to know about a pipeline's stages."""

import math
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
