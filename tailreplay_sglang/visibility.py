"""What a user sees of Tail-Replay: per-request meta_info fields, a log line per replay pass, and Prometheus
counters when SGLang runs with `--enable-metrics`.

`cached_tokens` in meta_info is SGLang's own and already reports the token-level hit; we add, through SGLang's
`SchedulerOutputStreamer` customized-info extension point, once per request:
- `tail_replay_tokens`: tokens replayed for the request (0 without a hit, or with an anchor at the match end);
- `tail_replay_ms`: wall time of the replay pass that served it (shared by all requests of that prefill batch);
- `tail_replay_exact`: whether the request's recurrent states are exact: no hit, an anchored replay, or the whole prefix
  replayed; false only for the paper's zero-init tail;
- `tail_replay_anchor`: depth c of the anchor state the replay started from, or null;
- `tail_replay_state_survival`: zero-init tails only (else null): the largest, over recurrent layers and heads, share of
  the dropped prefix state that can still count at the match end, exp(sum of the log-gates over the tail). 1 means
  some head forgets nothing over the tail, so the approximation may be far off; near 0, the dropped state is gone
  anyway (`replay.py` has the bound).
"""

from tailreplay_sglang.cache.request import peek, state_of

DEFAULTS = {"tail_replay_tokens": 0, "tail_replay_ms": 0.0, "tail_replay_exact": True, "tail_replay_anchor": None,
            "tail_replay_state_survival": None}
KEYS = tuple(DEFAULTS)


def record_hit(req, anchor: int | None, survival: float | None) -> None:
    # `exact` is already set: the cache sets it at the match
    state = state_of(req)
    state.anchor, state.state_survival = anchor, survival


def record_replay(req, tokens: int, ms: float, survival: float) -> None:
    state = state_of(req)
    state.tokens, state.ms = tokens, round(ms, 3)
    if not state.exact:
        state.state_survival = round(survival, 6)


def fields_of(req) -> dict:
    """The request's values of KEYS: a request Tail-Replay never matched reports the defaults (no hit: exact)."""
    state = peek(req)
    if state is None:
        return DEFAULTS
    return {"tail_replay_tokens": state.tokens, "tail_replay_ms": state.ms, "tail_replay_exact": state.exact,
            "tail_replay_anchor": state.anchor, "tail_replay_state_survival": state.state_survival}


def build_customized_info(streamer, reqs) -> dict[str, list]:
    # one value per request, each a list as SGLang's tokenizer manager accumulates them
    fields = [fields_of(req) for req in reqs]
    return {key: [[f[key]] for f in fields] for key in KEYS}


def scalar_meta_info(original, meta_info, state, key, values):
    """Tokenizer-manager side: report our per-request values as scalars, not one-element lists."""
    if key not in KEYS:
        return original(meta_info, state, key, values)
    meta_info[key] = values[-1] if values else DEFAULTS[key]


def is_request_level_key(streamer, key: str) -> bool:
    return key in KEYS


class ReplayMetrics:
    """Counters exported on SGLang's /metrics (prometheus multiprocess mode) when metrics are enabled."""

    def __init__(self):
        from prometheus_client import Counter

        self.requests = Counter("sglang:tail_replay_requests_total", "Requests whose recurrent states were replayed.")
        self.tokens = Counter("sglang:tail_replay_tokens_total", "Tokens replayed through recurrent layers.")
        self.seconds = Counter("sglang:tail_replay_seconds_total", "Wall time spent in replay passes.")
        self.exact_hits = Counter("sglang:tail_replay_exact_hits_total",
                                  "Hits whose recurrent states were rebuilt exactly (from an anchor, or the whole "
                                  "prefix).")
        self.approximate_hits = Counter("sglang:tail_replay_approximate_hits_total",
                                        "Hits served by the zero-init tail (no anchor within the exact budget).")
        self.evicted_anchors = Counter("sglang:tail_replay_evicted_anchors_total",
                                       "Recurrent states (anchors) dropped by the tree's mamba LRU.")
        self.host_anchor_hits = Counter("sglang:tail_replay_host_anchor_hits_total",
                                        "Hits that started from an anchor copied back from host memory.")

    def observe_hit(self, exact: bool) -> None:
        (self.exact_hits if exact else self.approximate_hits).inc()

    def observe(self, requests: int, tokens: int, seconds: float) -> None:
        self.requests.inc(requests)
        self.tokens.inc(tokens)
        self.seconds.inc(seconds)
