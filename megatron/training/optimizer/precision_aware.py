"""Megatron's precision-aware optimizer for Adam: the moments stored in a lower precision.

`--use-precision-aware-optimizer` with `--exp-avg-dtype` / `--exp-avg-sq-dtype` (fp32, bf16,
fp16) keeps Adam's first and second moments in that dtype; the step computes in fp32: for one
parameter at a time the moments are read into fp32, updated with torch's AdamW arithmetic
(decoupled decay, `lerp` for the first moment, bias corrections), the parameter (an fp32 main
weight) updated, and the moments rounded back to their dtype. Only one parameter's fp32
moments exist at a time, so the state takes 2 + 2 bytes per parameter with bf16 moments instead
of 4 + 4. With fp32 moments it is torch's AdamW (`foreach=False`) bit for bit (tested).

Main weights stay fp32 and main gradients fp32 (`--main-params-dtype fp32`,
`--main-grads-dtype fp32`, Megatron's defaults); their other dtypes and fp8 moments are not
supported yet.
"""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MOMENTS = ("exp_avg", "exp_avg_sq")


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored as `moment_dtypes` (exp_avg, exp_avg_sq)."""

    def __init__(self, params, *, lr, betas, eps, weight_decay, moment_dtypes):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.moment_dtypes = dict(zip(MOMENTS, moment_dtypes))

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in MOMENTS:
                state[name] = torch.zeros_like(param, dtype=self.moment_dtypes[name])
        return state

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self._state_of(param)
                state["step"] += 1
                step = state["step"].item()
                param.mul_(1 - lr * group["weight_decay"])
                exp_avg = state["exp_avg"].float()
                exp_avg_sq = state["exp_avg_sq"].float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded state to the parameter's dtype: the moments go back to theirs."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in MOMENTS:
                if name in state:
                    state[name] = state[name].to(self.moment_dtypes[name])
