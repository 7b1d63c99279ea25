"""Data-parallel servers (`--dp-size`, `--enable-dp-attention`) at idle: no busy loop, no second-long stall.

SGLang's data-parallel controller's event loop polls the tokenizer's socket with NOBLOCK and never sleeps, so the
controller keeps a whole core busy even while no request comes (`--sleep-on-idle` quiets the schedulers only). On
a two-core machine serving two ranks that core is one of theirs: every request ran about twofold slower beside it.
Here the loop blocks in zmq's poll until a request arrives (a new one wakes it at once), then dispatches as SGLang
does.

Under attention DP, `--sleep-on-idle` stalls every request that arrives after a pause by up to a second: an idle
scheduler sleeps in a one-second zmq poll on its own sockets, and the request goes to one DP group only, so the
other groups sleep on while the woken one waits for them in the step's all-gather (measured on tiny-qwen35-moe,
200-token prompts: 1.6 s per request where TP 2 takes 0.55 s). Under attention DP the sleep is a 50 ms poll
instead: 0.7 s per request, 8-9 % of a core per idle scheduler.
"""

import zmq

POLL_MS = 1000  # wake at least this often to feed the soft watchdog
DP_ATTENTION_SLEEP_MS = 50  # an idle scheduler's sleep under attention DP: a peer's step waits at most this long


def event_loop(self):
    """REPLACE of `DataParallelController.event_loop`: SGLang's body with a blocking poll in front."""
    from sglang.srt.managers.io_struct import sock_recv

    while True:
        self.soft_watchdog.feed()
        self.recv_from_tokenizer.poll(POLL_MS, zmq.POLLIN)
        while True:
            try:
                recv_req = sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            self._request_dispatcher(recv_req)


def sleep_briefly_under_dp_attention(original, self):
    """AROUND `IdleSleeper.maybe_sleep`: under attention DP, a short poll of the same sockets."""
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().attn_dp_size > 1:
        self.poller.poll(DP_ATTENTION_SLEEP_MS)
        return None
    return original(self)
