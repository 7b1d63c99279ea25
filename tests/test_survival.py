"""The survival indicator of a zero-init tail (families.base.tail_log_survival) and the anchor offsets
(anchors.offsets)."""

import math

import torch
import torch.nn.functional as F

from tailreplay_sglang.cache.anchors import offsets
from tailreplay_sglang.ops.gdn import gdn_gating
from tailreplay_sglang.families.base import ReplayBatch, tail_log_survival


def test_tail_log_survival_is_the_largest_headwise_sum_of_log_gates_per_tail():
    lens, HV = [5, 1, 17], 4
    a, A_log, dt_bias = torch.randn(sum(lens), HV), torch.randn(HV), torch.randn(HV)
    batch = ReplayBatch(torch.zeros(0), torch.zeros(0), torch.zeros(3), lens, [None] * 3)
    got = tail_log_survival(gdn_gating(A_log, a, torch.zeros_like(a), dt_bias)[0][0], batch)
    start = 0
    for i, n in enumerate(lens):
        per_head = [sum(-math.exp(A_log[h]) * F.softplus(a[t, h] + dt_bias[h]).item() for t in range(start, start + n))
                    for h in range(HV)]
        assert abs(got[i].item() - max(per_head)) < 1e-4
        start += n
    assert (got <= 0).all()  # a surviving share exp(.) is at most 1


def test_anchor_offsets():
    assert offsets(1000, 256) == [256, 512, 768]
    assert offsets(512, 256) == [256]  # the extend's end is the chunk-end anchor's
    assert offsets(100, 256, at_start=True) == [0]
    assert offsets(1000, 0) == []
