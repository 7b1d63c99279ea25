"""PD disaggregation without a server (issue 50): the relay's encoding of a request's Tail-Replay values into the
aux metadata row, the launcher's config for each role, and the bootstrap-room check. The servers are in
test_pd.py."""

import argparse
import math

import pytest
import torch

from tailreplay_sglang import disaggregation, visibility
from tailreplay_sglang.cache.request import TailReplayReq
from tailreplay_sglang.plugin import add_cli_args, config_from_args, hand_off
from tailreplay_sglang.validation import InvalidBootstrapRoomError, check_bootstrap_room


@pytest.mark.parametrize("state", [
    TailReplayReq(exact=True),
    TailReplayReq(exact=True, anchor=512, tokens=88, ms=42.984),
    TailReplayReq(exact=True, anchor=0, tokens=333, ms=0.125),
    TailReplayReq(exact=False, anchor=None, tokens=64, ms=3.5, state_survival=0.123457),
    TailReplayReq(exact=False, anchor=None, tokens=64, ms=3.5, state_survival=1.0),
], ids=["no-hit", "anchored", "from-the-root", "zero-init", "zero-init-survival-1"])
def test_relayed_values_are_what_the_prefill_server_reports(state):
    """Through an int32 row as SGLang's metadata buffers hold it, the values come back as `fields_of` gives
    them on the prefill server (ms to the microsecond it reports)."""
    row = torch.zeros(16, dtype=torch.int32)
    row[disaggregation.FIRST_SLOT:disaggregation.FIRST_SLOT + 6] = torch.tensor(disaggregation.encode(state),
                                                                              dtype=torch.int32)

    class Req:
        def __init__(self, state):
            self.tail_replay = state

    relayed = visibility.fields_of(Req(disaggregation.decode(row[disaggregation.FIRST_SLOT:].tolist())))
    expected = visibility.fields_of(Req(state))
    assert relayed.keys() == expected.keys() == set(visibility.KEYS)
    assert relayed["tail_replay_ms"] == pytest.approx(expected["tail_replay_ms"], abs=1e-3)
    assert {k: v for k, v in relayed.items() if k != "tail_replay_ms"} == \
           {k: v for k, v in expected.items() if k != "tail_replay_ms"}


def test_a_row_a_stock_prefill_server_wrote_carries_no_values():
    assert disaggregation.decode([0] * 9) is None
    assert disaggregation.decode([disaggregation.MARKER + 1, 0, 1, -1, 0, 0]) is None


def test_the_relay_writes_only_sglangs_spare_slots():
    """Slots 0-6 of `cached_tokens` are SGLang's (cached, device, host, storage, image, audio, video counts)."""

    class Buffers:
        cached_tokens = torch.arange(32, dtype=torch.int32).reshape(2, 16)

    class Req:
        metadata_buffer_index = 1
        tail_replay = TailReplayReq(exact=False, tokens=7, ms=1.5, state_survival=math.exp(-3))

    disaggregation.relay_to_decode(None, None, Buffers, Req)
    assert Buffers.cached_tokens[1, :7].tolist() == list(range(16, 23))
    assert Buffers.cached_tokens[0].tolist() == list(range(16))
    assert disaggregation.decode(Buffers.cached_tokens[1, 7:].tolist()).exact is False


@pytest.mark.parametrize("relayed, expected", [
    (TailReplayReq(exact=False, anchor=None, tokens=64, ms=3.5, state_survival=0.5), False),  # P approximated
    (TailReplayReq(exact=True, anchor=512, tokens=88, ms=1.0), True),
    (None, True),  # a stock prefill server's row: no marker, nothing replayed, exact
])
def test_the_decode_server_takes_the_label_the_prefill_server_relayed(relayed, expected):
    """`take_relayed` (after `_commit_transfer_to_req`): the request's state on D is what P wrote into its row, which
    D streams and its radix cache taints by; a row for another bootstrap room (an aborted transfer) is left alone."""
    from types import SimpleNamespace

    buffers = SimpleNamespace(cached_tokens=torch.zeros(2, 16, dtype=torch.int32),
                              bootstrap_room=torch.tensor([[0], [77]]))
    if relayed is not None:
        buffers.cached_tokens[1, disaggregation.FIRST_SLOT:disaggregation.FIRST_SLOT + 6] = torch.tensor(
            disaggregation.encode(relayed), dtype=torch.int32)
    queue = SimpleNamespace(metadata_buffers=buffers)
    req = SimpleNamespace(bootstrap_room=77)
    assert disaggregation.take_relayed(None, "result", queue, SimpleNamespace(req=req, metadata_buffer_index=1)) \
        == "result"
    assert req.tail_replay.exact is expected and req.tail_replay.tokens == (relayed.tokens if relayed else 0)
    stale = SimpleNamespace(bootstrap_room=78)
    disaggregation.take_relayed(None, None, queue, SimpleNamespace(req=stale, metadata_buffer_index=1))
    assert not hasattr(stale, "tail_replay")


def test_a_rebootstrap_after_approximate_output_keeps_the_request_approximate():
    """Review F5: D sends a request that emitted output back to P (a retraction with rebootstrap); P's recompute may
    be exact, but what D already streamed came from the first, approximate state."""
    from types import SimpleNamespace

    buffers = SimpleNamespace(cached_tokens=torch.zeros(1, 16, dtype=torch.int32), bootstrap_room=torch.tensor([[5]]))
    buffers.cached_tokens[0, disaggregation.FIRST_SLOT:disaggregation.FIRST_SLOT + 6] = torch.tensor(
        disaggregation.encode(TailReplayReq(exact=True)), dtype=torch.int32)
    queue, decode_req = SimpleNamespace(metadata_buffers=buffers), SimpleNamespace(metadata_buffer_index=0)
    for emitted, first_exact, expected in (([4, 4], False, False), ([4, 4], True, True), ([], False, True)):
        req = SimpleNamespace(bootstrap_room=5, output_ids=emitted, tail_replay=TailReplayReq(exact=first_exact))
        decode_req.req = req
        disaggregation.take_relayed(None, None, queue, decode_req)
        assert req.tail_replay.exact is expected, (emitted, first_exact)


def _config(tiny_qwen35, *flags):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    parser.add_argument("--disaggregation-mode", default="null")
    parser.add_argument("--linear-attn-prefill-backend")
    add_cli_args(parser)
    args = parser.parse_args(["--model-path", str(tiny_qwen35), "--enable-tail-replay", *flags])
    return config_from_args(args), args


def test_the_launcher_hands_each_role_its_config(tiny_qwen35):
    prefill, args = _config(tiny_qwen35, "--disaggregation-mode", "prefill")
    assert prefill.disaggregation_mode == "prefill" and not prefill.decode_only and prefill.interval_anchors
    assert hand_off(prefill, args)["linear_attn_prefill_backend"] == "triton"
    decode, args = _config(tiny_qwen35, "--disaggregation-mode", "decode")
    assert decode.decode_only
    assert hand_off(decode, args) == {"radix_cache_backend": "tail_replay"}  # nothing for a prefill it never runs


def test_a_decode_runtime_registers_the_decode_side_only(tiny_qwen35):
    from tailreplay_sglang import hooks
    from tailreplay_sglang.runtime import TailReplayRuntime

    decode, _ = _config(tiny_qwen35, "--disaggregation-mode", "decode")
    runtime = TailReplayRuntime.for_scheduler(decode)
    tables = hooks.runtime_tables(runtime)
    assert runtime.interval_anchors is None and tables == hooks.DECODE
    replay_side = {"lifecycle:create_store", "lifecycle:add_store_to_cell_size", "lifecycle:mark_pending",
                   "lifecycle:replay_after_clear"}  # no hidden store, no replay on D
    assert not {h.fn.rpartition(".")[2] for h in tables} & replay_side
    prefill, _ = _config(tiny_qwen35, "--disaggregation-mode", "prefill")
    assert set(hooks.PREFILL) <= set(hooks.runtime_tables(TailReplayRuntime.for_scheduler(prefill)))


@pytest.mark.parametrize("room", [None, 0, 2**63 - 1, [0, 5, None]])
def test_bootstrap_rooms_sglang_draws_pass(room):
    check_bootstrap_room(room)


@pytest.mark.parametrize("room", [-1, 2**63, "7", 1.0, True, [1, -2]])
def test_other_bootstrap_rooms_are_refused(room):
    with pytest.raises(InvalidBootstrapRoomError, match="bootstrap_room"):
        check_bootstrap_room(room)


def _source(obj) -> str:
    import inspect

    return inspect.getsource(obj)


def test_the_slot_the_prefill_server_sends_is_the_replayed_one_and_complete_before_the_send():
    """The ordering the PD path rests on, pinned on SGLang 0.5.23's source (GPU by construction; docs/design.md,
    "PD disaggregation"): (1) the replay runs in the forward, on its stream, before the extend dispatch; (2) the
    prefill server waits for the forward's `copy_done` event before it sends; (3) what it sends is the request's
    live slot, `req_index_to_mamba_index_mapping[row]`, the slot the replay writes (`get_mamba_indices(row)`)."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

    forward = _source(ModelRunner._forward_raw)
    replay_point = forward.index("self._maybe_execute_deferred_mamba_cow_and_clear(forward_batch)")
    assert replay_point < forward.index("self.prefill_cuda_graph_runner.can_run_graph")
    assert replay_point < forward.index("forward_split_prefill(")
    result = _source(SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill)
    assert result.index("copy_done.synchronize()") < result.index("self.send_kv_chunk(")
    send = " ".join(_source(SchedulerDisaggregationPrefillMixin._send_kv_chunk).split())
    assert "req_index_to_mamba_index_mapping[ req.kv.req_pool_idx ]" in send
    assert "return self.req_index_to_mamba_index_mapping[req_indices]" in _source(
        HybridReqToTokenPool.get_mamba_indices)
    import tailreplay_sglang.replay as replay

    assert "pool.get_mamba_indices(" in _source(replay)
