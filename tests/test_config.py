import pytest

from tailreplay_sglang.config import TailReplayConfig, TailReplayConfigError


@pytest.mark.parametrize("kwargs,flag", [
    ({"ratio": 0.0}, "--tail-replay-ratio"),
    ({"ratio": 1.5}, "--tail-replay-ratio"),
    ({"min_tokens": 0}, "--tail-replay-min-tokens"),
    ({"max_tokens": 0}, "--tail-replay-max-tokens"),
    ({"min_tokens": 100, "max_tokens": 10}, "--tail-replay-min-tokens"),
    ({"mode": "half"}, "--tail-replay-mode"),
    ({"hidden_dtype": "int8"}, "--tail-replay-hidden-dtype"),
    ({"hidden_tier": "disk"}, "--tail-replay-hidden-tier"),
    ({"h2d": "async"}, "--tail-replay-h2d"),
])
def test_invalid_values_name_the_flag(kwargs, flag):
    with pytest.raises(TailReplayConfigError, match=flag):
        TailReplayConfig(enabled=True, **kwargs)


@pytest.mark.parametrize("cfg,matched,expected", [
    (TailReplayConfig(ratio=0.05, min_tokens=64), 10_000, 500),  # ceil(0.05 * 10000)
    (TailReplayConfig(ratio=0.05, min_tokens=64), 1_000, 64),  # clamped up to min
    (TailReplayConfig(ratio=0.05, min_tokens=64), 40, 40),  # never more than the match
    (TailReplayConfig(ratio=0.1, min_tokens=1, max_tokens=300), 10_000, 300),  # clamped down to max
    (TailReplayConfig(ratio=0.1, min_tokens=1), 101, 11),  # ceil, not round
    (TailReplayConfig(ratio=1.0), 777, 777),  # ratio 1 == full
    (TailReplayConfig(mode="full", ratio=0.05), 777, 777),
    (TailReplayConfig(mode="zero"), 777, 0),
    (TailReplayConfig(), 0, 0),
])
def test_tail_len(cfg, matched, expected):
    assert cfg.tail_len(matched) == expected


def test_env_round_trip(monkeypatch):
    cfg = TailReplayConfig(enabled=True, ratio=0.1, min_tokens=8, max_tokens=512, hidden_dtype="float32", mode="full")
    monkeypatch.delenv("TAILREPLAY_CONFIG", raising=False)
    assert TailReplayConfig.from_env() == TailReplayConfig()
    cfg.to_env()
    assert TailReplayConfig.from_env() == cfg


@pytest.mark.parametrize("kwargs,flag", [
    ({"anchor_interval": 100}, "--tail-replay-anchor-interval"),  # not a multiple of the 64-token GDN chunk
    ({"anchor_interval": -64}, "--tail-replay-anchor-interval"),
    ({"exact_budget": -1}, "--tail-replay-exact-budget"),
    ({"host_anchors": -1}, "--tail-replay-host-anchors"),
    ({"host_anchors": 8, "exact_budget": 0}, "--tail-replay-host-anchors"),  # host anchors without anchors
    ({"host_anchors": 1.5}, "--tail-replay-host-anchors"),
    ({"fold_tokens": -1}, "--tail-replay-fold-tokens"),
    ({"anchor_keep": "mru"}, "--tail-replay-anchor-keep"),
    ({"store_tp": "split"}, "--tail-replay-store-tp"),
    ({"store_tp": 2}, "--tail-replay-store-tp"),
])
def test_invalid_anchor_values_name_the_flag(kwargs, flag):
    with pytest.raises(TailReplayConfigError, match=flag):
        TailReplayConfig(enabled=True, **kwargs)


def test_exact_budget_defaults_to_the_larger_of_tail_and_interval():
    cfg = TailReplayConfig(ratio=0.05, min_tokens=64, anchor_interval=512)
    assert cfg.anchored and cfg.budget(1_000) == 512 and cfg.budget(20_000) == 1_000  # max(512, ceil(0.05 m))
    assert TailReplayConfig(exact_budget=300).budget(20_000) == 300
    assert not TailReplayConfig(exact_budget=0).anchored  # the paper's mode: no anchor kept or used
    assert TailReplayConfig(mode="full").is_exact_fallback(500) and not TailReplayConfig().is_exact_fallback(500)


def test_hidden_dtype_auto_is_the_models_dtype():
    import torch

    assert TailReplayConfig().hidden_torch_dtype(torch.float32) == torch.float32
    assert TailReplayConfig().hidden_torch_dtype(torch.bfloat16) == torch.bfloat16
    assert TailReplayConfig(hidden_dtype="bfloat16").hidden_torch_dtype(torch.float32) == torch.bfloat16
