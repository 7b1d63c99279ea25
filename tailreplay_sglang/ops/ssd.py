"""Mamba2's `dt` as its kernels use it, in pure torch.

The Mamba2 replay takes its tails' decays from it on every device. The SSD scan and decode update are SGLang's
kernels; on a CPU, the torch bodies of the separate CPU port (`sglang_cpu_compat/ops/ssd.py`), which use it too.
"""

import torch.nn.functional as F


def process_dt(dt, dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, float("inf"))):
    """dt as the kernels use it: plus bias, through softplus, clamped to dt_limit (float32)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt

