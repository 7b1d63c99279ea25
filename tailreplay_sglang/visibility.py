"""What a user sees of Tail-Replay: per-request meta_info fields, a log line per replay pass, and Prometheus
counters when SGLang runs with `--enable-metrics`.

`cached_tokens` in meta_info is SGLang's own and already reports the token-level hit; we add, through SGLang's
`SchedulerOutputStreamer` customized-info extension point, once per request:
- `tail_replay_tokens`: tokens replayed for the request (0 without a hit, or with an anchor at the match end);
- `tail_replay_ms`: wall time of the replay pass that served it (shared by all requests of that prefill batch);
- `tail_replay_exact`: whether the request's GDN states are exact: no hit, an anchored replay, or the whole prefix
  replayed; false only for the paper's zero-init tail;
- `tail_replay_anchor`: depth c of the anchor state the replay started from, or null;
- `tail_replay_state_survival`: zero-init tails only (else null): the largest, over GDN layers and heads, share of
  the dropped prefix state that can still count at the match end, exp(sum of the log-gates over the tail). 1 means
  some head forgets nothing over the tail, so the approximation may be far off; near 0, the dropped state is gone
  anyway (`replay.py` has the bound).
"""

DEFAULTS = {"tail_replay_tokens": 0, "tail_replay_ms": 0.0, "tail_replay_exact": True, "tail_replay_anchor": None,
            "tail_replay_state_survival": None}
KEYS = tuple(DEFAULTS)


def record_hit(req, anchor: int | None, survival: float | None) -> None:
    # `tail_replay_exact` is already on the request: the cache sets it at the match (cache.EXACT_ATTR)
    req.tail_replay_anchor, req.tail_replay_state_survival = anchor, survival


def record_replay(req, tokens: int, ms: float, survival: float) -> None:
    req.tail_replay_tokens, req.tail_replay_ms = tokens, round(ms, 3)
    if not req.tail_replay_exact:
        req.tail_replay_state_survival = round(survival, 6)


def build_customized_info(streamer, reqs) -> dict[str, list]:
    # one value per request, each a list as SGLang's tokenizer manager accumulates them
    return {key: [[getattr(req, key, default)] for req in reqs] for key, default in DEFAULTS.items()}


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

        self.requests = Counter("sglang:tail_replay_requests_total", "Requests whose GDN states were replayed.")
        self.tokens = Counter("sglang:tail_replay_tokens_total", "Tokens replayed through GDN layers.")
        self.seconds = Counter("sglang:tail_replay_seconds_total", "Wall time spent in replay passes.")
        self.exact_hits = Counter("sglang:tail_replay_exact_hits_total",
                                  "Hits whose GDN states were rebuilt exactly (from an anchor, or the whole prefix).")
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
