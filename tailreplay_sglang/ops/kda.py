"""Kimi Delta Attention's (KDA) gate in pure torch: the log decay per key channel.

The KDA replay takes its tails' decays from it on every device. The chunked prefill and decode update are SGLang's
kernels; on a CPU, the torch bodies of the separate CPU port (`sglang_cpu_compat/ops/kda.py`), which use it too.
"""

import torch
import torch.nn.functional as F


def kda_gate(raw, A_log, dt_bias, lower_bound: float | None = None) -> torch.Tensor:
    """Log decay per channel, float32 `[..., HV, K]`, from the raw forget-gate projection `[..., HV, K]`:
    `-exp(A_log) * softplus(raw + dt_bias)`, or Kimi's safe gate `lower_bound * sigmoid(exp(A_log) (raw + dt_bias))`
    where the checkpoint sets `gate_lower_bound`."""
    HV, K = raw.shape[-2:]
    x = raw.float() + dt_bias.float().view(HV, K)
    A = A_log.float().reshape(HV, 1).exp()
    if lower_bound is None:
        return -A * F.softplus(x)
    return lower_bound * torch.sigmoid(A * x)

