"""What a user sees of Tail-Replay: per-request meta_info fields, a log line per replay pass, and Prometheus
counters when SGLang runs with `--enable-metrics`.

`cached_tokens` in meta_info is SGLang's own and already reports the token-level hit; we add
`tail_replay_tokens` (tokens replayed for the request) and `tail_replay_ms` (wall time of the replay pass that
served it, shared by all requests of that prefill batch) through SGLang's `SchedulerOutputStreamer`
customized-info extension point, emitted once per request.
"""

KEYS = ("tail_replay_tokens", "tail_replay_ms")


def record(req, tokens: int, ms: float) -> None:
    req.tail_replay_tokens, req.tail_replay_ms = tokens, round(ms, 3)


def build_customized_info(streamer, reqs) -> dict[str, list]:
    # one value per request, each a list as SGLang's tokenizer manager accumulates them
    return {key: [[getattr(req, key, 0)] for req in reqs] for key in KEYS}


def scalar_meta_info(original, meta_info, state, key, values):
    """Tokenizer-manager side: report our per-request values as scalars, not one-element lists."""
    if key not in KEYS:
        return original(meta_info, state, key, values)
    meta_info[key] = values[-1] if values else 0


def is_request_level_key(streamer, key: str) -> bool:
    return key in KEYS


class ReplayMetrics:
    """Counters exported on SGLang's /metrics (prometheus multiprocess mode) when metrics are enabled."""

    def __init__(self):
        from prometheus_client import Counter

        self.requests = Counter("sglang:tail_replay_requests_total", "Requests whose GDN states were replayed.")
        self.tokens = Counter("sglang:tail_replay_tokens_total", "Tokens replayed through GDN layers.")
        self.seconds = Counter("sglang:tail_replay_seconds_total", "Wall time spent in replay passes.")

    def observe(self, requests: int, tokens: int, seconds: float) -> None:
        self.requests.inc(requests)
        self.tokens.inc(tokens)
        self.seconds.inc(seconds)
