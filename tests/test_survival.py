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


def test_the_per_layer_survival_fold_builds_nothing_from_the_host(monkeypatch):
    """GPU path review N7: every replayed recurrent layer folds its log-decays into the survival bound. The tail
    index of each token is built on the host once per pass (a device `repeat_interleave` and a tensor from a list
    are each a sync on a GPU), and a pass of exact hits, which report no bound, computes none at all."""
    built = []
    for name in ("tensor", "repeat_interleave"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _o=original, _n=name, **k: (built.append(_n), _o(*a, **k))[1])
    lens, layers = [5, 1, 17], 6
    gates = [-torch.rand(sum(lens), 4) for _ in range(layers)]
    for needs_survival in (False, True):
        batch = ReplayBatch(torch.zeros(0), torch.zeros(0), torch.zeros(3), lens, [None] * 3,
                            log_survival=torch.full((3,), float("-inf")), needs_survival=needs_survival)
        built.clear()
        for g in gates:
            batch.observe_decay(g)
        if not needs_survival:
            assert built == [] and batch.log_survival.isinf().all()
        else:
            assert built.count("repeat_interleave") == 1 and built.count("tensor") == 1  # once for the pass
            expected = torch.stack([torch.stack([g[sum(lens[:i]):sum(lens[:i + 1])].sum(0).max() for i in range(3)])
                                    for g in gates]).max(0).values
            torch.testing.assert_close(batch.log_survival, expected)
