"""fp16 loss scaling, one scaler per pipeline stage.

Megatron's rules (`--loss-scale` static, else dynamic from `--initial-loss-scale`, never below
`--min-loss-scale`, halved after `--hysteresis` overflowing steps, doubled after
`--loss-scale-window` clean steps in a row). Megatron decides "found inf" with one all-reduce
over the model; here each stage owns a scaler and decides from its own gradients, so PACI keeps
its only-point-to-point traffic. How the scales of neighbouring stages are reconciled (every
gradient message carries its sender's scale) is in docs/precision.md.

`MEGATRON_INJECT_GRAD_OVERFLOW=STAGE:STEP[,STAGE:STEP...]` (tests only) puts an inf into the
gradient of pipeline stage STAGE at its STEP-th optimizer step (1-based, skipped steps count).
"""

import os

import torch

INJECT_ENV = "MEGATRON_INJECT_GRAD_OVERFLOW"


class StaticLossScaler:
    """`--loss-scale S`: the same scale all run; an overflow still skips the step."""

    dynamic = False

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def can_back_off(self) -> bool:
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass  # the command line's static scale wins


class DynamicLossScaler:
    """Megatron's dynamic scaler: back off by 2 once `hysteresis` overflows have been seen
    since the last growth (and at every overflow after that), grow by 2 after `window` clean
    steps in a row; never below `min_scale`."""

    dynamic = True

    def __init__(self, initial: float, *, min_scale: float, window: int, hysteresis: int):
        self.scale, self.min_scale = float(initial), float(min_scale)
        self.window, self.hysteresis = int(window), int(hysteresis)
        self.clean_steps = 0  # steps without overflow since the last overflow or growth
        self.hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def can_back_off(self) -> bool:
        """False once the scale sits at its minimum: an overflow then is divergence."""
        return self.scale > self.min_scale

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


def build_loss_scaler(config):
    """The stage's scaler for an fp16 model (an OptimizerConfig), else None (fp32 and bf16
    runs do not scale)."""
    if config.params_dtype != torch.float16:
        return None
    if config.loss_scale is not None:
        return StaticLossScaler(config.loss_scale)
    return DynamicLossScaler(
        config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        window=config.loss_scale_window,
        hysteresis=config.hysteresis,
    )


# ---------------------------------------------------------------------------- test hook
def injected_overflow_steps(stage: int) -> set[int]:
    """The steps of `stage` that MEGATRON_INJECT_GRAD_OVERFLOW names."""
    steps = set()
    for item in filter(None, os.environ.get(INJECT_ENV, "").split(",")):
        where, _, when = item.partition(":")
        if int(where) == stage:
            steps.add(int(when))
    return steps


def inject_overflow(grad: torch.Tensor) -> None:
    """An inf in the first element of a gradient, as a real fp16 overflow leaves."""
    grad.view(-1)[0] = float("inf")
