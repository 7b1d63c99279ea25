"""Tail-Replay configuration: one frozen, validated dataclass built from the server flags, and every environment
variable the package reads.

The launcher parses the flags (see `plugin.py`) and hands the config to SGLang's scheduler processes through the
environment (`TAILREPLAY_CONFIG`), since they are spawned, not forked, and never see our argv. No other module
reads the environment.
"""

import json
import math
import os
from dataclasses import asdict, dataclass

ENV_VAR = "TAILREPLAY_CONFIG"
REPLAY_MODES = ("ratio", "full", "zero")
# How stored rows are encoded (store/codec.py): float8 with a scale per token, int4 with a scale per 32 values
HIDDEN_DTYPES = ("auto", "bfloat16", "float32", "float8_e4m3fn", "int4")
GDN_CHUNK = 64  # the chunk of fla's delta-rule prefill kernels and ops/gdn: interval anchors lie on its grid
HIDDEN_TIERS = ("device", "host")
H2D_MODES = ("ser", "ovl")
STORE_TP = ("shard", "replicate")  # the hidden store over attention-TP ranks: 1/N of each row per rank, or whole rows
ANCHOR_KEEP = ("lru", "ends")  # which device anchor goes first under pressure (cache/component.py)
# SGLang's --disaggregation-mode: a colocated server (null), or the prefill or decode server of a PD pair
DISAGGREGATION_MODES = ("null", "prefill", "decode")


class TailReplayConfigError(ValueError):
    """A flag value or combination the server must refuse at start-up; the message names the flag."""


@dataclass(frozen=True)
class TailReplayConfig:
    enabled: bool = False
    ratio: float = 0.05  # replay k = ceil(ratio * m) of a matched prefix of m tokens ...
    min_tokens: int = 64  # ... but at least this many (replay error tracks the absolute tail length) ...
    max_tokens: int | None = None  # ... and at most this many; never more than m
    hidden_dtype: str = "auto"  # dtype of the stored per-token group inputs; auto: the model's activation dtype
    mode: str = "ratio"  # ratio | full (replay the whole prefix: exact) | zero (no replay: the paper's baseline)
    hidden_tier: str | None = None  # where the hidden store lives: device | host; None: chosen for the device
    h2d: str = "ovl"  # a host-tier hit's tail load: ser (before the replay) | ovl (overlapped with it)
    # Under attention TP: each rank keeps 1/N of every stored row (shard; joined by one all-gather per group at a
    # replay), or whole rows (replicate: no collective, N times the memory; the layout before the sharded store, kept
    # for comparison, bench/pressure.py --tp 2)
    store_tp: str = "shard"
    # Anchored replay: recurrent states kept in the tree (anchors) where a request ends, where a prefill chunk ends,
    # and every `anchor_interval` tokens of a prefill (0: no interval anchors). A hit of m tokens whose deepest
    # anchor c has m - c <= budget starts from a copy of that state and replays [c, m): exact. Past the budget, or
    # with no anchor, the paper's zero-init tail. exact_budget None: max(tail_len(m), anchor_interval);
    # 0: anchored replay off (no anchor kept or used: the paper's pure mode).
    # The default interval is chosen by measurement (docs/results.md, section 1).
    anchor_interval: int = 512
    exact_budget: int | None = None
    # Host-memory anchors: a state the device mamba pool evicts moves to a host pool of this many states (0: off)
    # and a hit can start from it (cache/host_anchors.py).
    host_anchors: int = 0
    # An exact hit at most this many tokens past its anchor is not replayed: its match stops at the anchor and the
    # extend computes those tokens in the same pass as the rest of the prompt, as after a stock hit. 64 covers a chat
    # turn under extra_buffer (states every 64 tokens) at less than a replay pass's cost (docs/results.md, 2e).
    fold_tokens: int = 64
    # Which anchor the device pool evicts first: the least recently used (lru), or the least recently used one that
    # is neither a branch point nor a path's end, if any (ends: branch points and request ends kept first; measured
    # in docs/results.md, 2e).
    anchor_keep: str = "ends"
    # The server's role in PD disaggregation (SGLang's --disaggregation-mode, read by the launcher): the prefill
    # server runs Tail-Replay as a colocated one does; a decode server never replays and runs only the decode side
    # (`disaggregation.py`).
    disaggregation_mode: str = "null"
    # Not a flag: set by the launcher from the model (`plugin._for_mixer`, `Family.state_window`). Where a family's
    # state is a window of its last few inputs (LFM2's short conv), a zero-init replay of this many tokens rebuilds
    # it exactly: every hit replays min(window, m) tokens from a cleared slot and is exact, and no anchor is kept
    # (exact_budget 0). 0: the state depends on the whole prefix.
    state_window: int = 0

    def __post_init__(self):
        self._check_types()
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
        if self.mode not in REPLAY_MODES:
            raise TailReplayConfigError(f"--tail-replay-mode must be one of {', '.join(REPLAY_MODES)}, "
                                        f"got {self.mode!r}")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise TailReplayConfigError(
                f"--tail-replay-hidden-dtype must be one of {', '.join(HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        if self.hidden_tier not in (None, *HIDDEN_TIERS):
            raise TailReplayConfigError(
                f"--tail-replay-hidden-tier must be one of {', '.join(HIDDEN_TIERS)}, got {self.hidden_tier!r}")
        if self.anchor_interval < 0 or self.anchor_interval % GDN_CHUNK:
            raise TailReplayConfigError(f"--tail-replay-anchor-interval must be 0 (off) or a positive multiple of "
                                        f"{GDN_CHUNK} (the GDN chunk), got {self.anchor_interval}")
        if self.exact_budget is not None and self.exact_budget < 0:
            raise TailReplayConfigError(f"--tail-replay-exact-budget must be >= 0, got {self.exact_budget}")
        if self.anchor_keep not in ANCHOR_KEEP:
            raise TailReplayConfigError(f"--tail-replay-anchor-keep must be one of {', '.join(ANCHOR_KEEP)}, "
                                        f"got {self.anchor_keep!r}")
        if self.fold_tokens < 0:
            raise TailReplayConfigError(f"--tail-replay-fold-tokens must be >= 0, got {self.fold_tokens}")
        if self.host_anchors < 0:
            raise TailReplayConfigError(f"--tail-replay-host-anchors must be >= 0, got {self.host_anchors}")
        if self.host_anchors and not self.anchored:
            raise TailReplayConfigError("--tail-replay-host-anchors needs anchored replay: drop "
                                        "--tail-replay-exact-budget 0, or set --tail-replay-host-anchors 0")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise TailReplayConfigError(f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)} "
                                        f"with --enable-tail-replay, got {self.disaggregation_mode!r}")
        if self.state_window < 0 or (self.state_window and self.anchored):
            raise TailReplayConfigError(f"state_window {self.state_window} needs exact_budget 0 (set together by the "
                                        f"launcher)")
        if self.h2d not in H2D_MODES:
            raise TailReplayConfigError(f"--tail-replay-h2d must be one of {', '.join(H2D_MODES)}, got {self.h2d!r}")
        if self.store_tp not in STORE_TP:
            raise TailReplayConfigError(f"--tail-replay-store-tp must be one of {', '.join(STORE_TP)}, "
                                        f"got {self.store_tp!r}")

    def _check_types(self) -> None:
        """argparse converts the command line's strings; the Python keywords (python_api.py) arrive as given."""
        number, integer, text, none = (int, float), (int,), (str,), (type(None),)
        expected = {"ratio": number, "min_tokens": integer, "max_tokens": integer + none, "hidden_dtype": text,
                    "mode": text, "hidden_tier": text + none, "h2d": text, "anchor_interval": integer,
                    "exact_budget": integer + none, "host_anchors": integer,
                    "fold_tokens": integer, "anchor_keep": text, "store_tp": text}
        for name, kinds in expected.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                kind = "a number" if float in kinds else "a string" if str in kinds else "an integer"
                raise TailReplayConfigError(f"--tail-replay-{name.replace('_', '-')} must be {kind}, got {value!r}")

    def tail_len(self, matched: int) -> int:
        """Tokens to replay for a hit of `matched` tokens: k = clamp(ceil(r*m), min, max), never more than m."""
        if matched <= 0:
            return 0
        if self.state_window:  # exact from this many tokens on, whatever the mode
            return min(self.state_window, matched)
        if self.mode == "zero":
            return 0
        if self.mode == "full" or self.ratio >= 1.0:
            return matched
        k = max(math.ceil(self.ratio * matched), self.min_tokens)
        if self.max_tokens is not None:
            k = min(k, self.max_tokens)
        return min(k, matched)

    def hidden_torch_dtype(self, model_dtype):
        """The stored hiddens' torch dtype: the model's activation dtype under auto, so that replaying them
        reproduces the forward that wrote them (exact where anchored)."""
        import torch

        return model_dtype if self.hidden_dtype == "auto" else getattr(torch, self.hidden_dtype)

    @property
    def decode_only(self) -> bool:
        """A PD decode server: no hidden store, no replay, no anchors; the decode side of `disaggregation.py`."""
        return self.disaggregation_mode == "decode"

    @property
    def anchored(self) -> bool:
        """Whether anchors are kept and used at all (exact budget not 0)."""
        return self.exact_budget != 0

    @property
    def interval_anchors(self) -> bool:
        """Whether prefills keep anchors every `anchor_interval` tokens (read from SGLang's prefill kernels)."""
        return self.anchored and self.anchor_interval > 0

    def budget(self, matched: int) -> int:
        """Most tokens an anchored (exact) replay of a `matched`-token hit may take."""
        if self.exact_budget is not None:
            return self.exact_budget
        return max(self.tail_len(matched), self.anchor_interval)

    def is_exact_fallback(self, matched: int) -> bool:
        """Whether the zero-init path is exact for this hit anyway: nothing matched, the whole prefix replayed, or
        the model's state is a window the tail covers (`state_window`)."""
        return matched == 0 or self.tail_len(matched) == matched or self.state_window > 0

    # ---- hand-off to spawned scheduler processes ----

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "TailReplayConfig":
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()
