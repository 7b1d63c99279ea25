"""What the Tail-Replay hooks of one scheduler process share: the config, the hidden store, the pending replays and
the metrics. One place, imported by every hook module (`integration`, `pool_report`), so none imports another."""

from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.hidden_store import HiddenStore
from tailreplay_sglang.replay import PendingReplays
from tailreplay_sglang.visibility import ReplayMetrics


class RuntimeState:
    config = TailReplayConfig()  # set by integration.register
    store: HiddenStore | None = None  # created with the KV pool (integration.create_store)
    pending = PendingReplays()
    metrics: ReplayMetrics | None = None  # only with --enable-metrics
    fault_replay_delay_s = 0.0  # reliability tests only (integration.FAULT_REPLAY_DELAY_ENV)
