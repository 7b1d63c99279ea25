"""Tail-Replay configuration: one frozen, validated dataclass built from the server flags.

The launcher parses the flags (see `plugin.py`) and hands the config to SGLang's scheduler processes through the
environment (`TAILREPLAY_CONFIG`), since they are spawned, not forked, and never see our argv.
"""

import json
import math
import os
from dataclasses import asdict, dataclass

ENV_VAR = "TAILREPLAY_CONFIG"
MODES = ("ratio", "full", "zero")
HIDDEN_DTYPES = ("bfloat16", "float32")
HIDDEN_TIERS = ("device", "host")
H2D_MODES = ("ser", "ovl")


class TailReplayConfigError(ValueError):
    """A flag value or combination the server must refuse at start-up; the message names the flag."""


@dataclass(frozen=True)
class TailReplayConfig:
    enabled: bool = False
    ratio: float = 0.05  # replay k = ceil(ratio * m) of a matched prefix of m tokens ...
    min_tokens: int = 64  # ... but at least this many (replay error tracks the absolute tail length) ...
    max_tokens: int | None = None  # ... and at most this many; never more than m
    hidden_dtype: str = "bfloat16"  # dtype of the stored per-token group inputs
    mode: str = "ratio"  # ratio | full (replay the whole prefix: exact) | zero (no replay: the paper's baseline)
    hidden_tier: str | None = None  # where the hidden store lives: device | host; None: chosen for the device
    h2d: str = "ovl"  # a host-tier hit's tail load: ser (before the replay) | ovl (overlapped with it)

    def __post_init__(self):
        if not 0.0 < self.ratio <= 1.0:
            raise TailReplayConfigError(f"--tail-replay-ratio must be in (0, 1], got {self.ratio}")
        if self.min_tokens < 1:
            raise TailReplayConfigError(f"--tail-replay-min-tokens must be >= 1, got {self.min_tokens}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise TailReplayConfigError(f"--tail-replay-max-tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise TailReplayConfigError(
                f"--tail-replay-min-tokens ({self.min_tokens}) must not exceed "
                f"--tail-replay-max-tokens ({self.max_tokens})")
        if self.mode not in MODES:
            raise TailReplayConfigError(f"--tail-replay-mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise TailReplayConfigError(
                f"--tail-replay-hidden-dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        if self.hidden_tier not in (None, *HIDDEN_TIERS):
            raise TailReplayConfigError(
                f"--tail-replay-hidden-tier must be one of {', '.join(HIDDEN_TIERS)}, got {self.hidden_tier!r}")
        if self.h2d not in H2D_MODES:
            raise TailReplayConfigError(f"--tail-replay-h2d must be one of {', '.join(H2D_MODES)}, got {self.h2d!r}")

    def tail_len(self, matched: int) -> int:
        """Tokens to replay for a hit of `matched` tokens: k = clamp(ceil(r*m), min, max), never more than m."""
        if matched <= 0 or self.mode == "zero":
            return 0
        if self.mode == "full" or self.ratio >= 1.0:
            return matched
        k = max(math.ceil(self.ratio * matched), self.min_tokens)
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        return min(k, matched)

    # ---- hand-off to spawned scheduler processes ----

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "TailReplayConfig":
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()
