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
