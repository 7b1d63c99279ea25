"""PendingReplays (tailreplay_sglang/cache/request.py): a hit waits here from prepare_for_extend to its batch's
forward."""

import torch

import pytest

from tailreplay_sglang.cache.request import Match, PendingReplays, retarget
from tailreplay_sglang.config import TailReplayConfig


def test_take_returns_rows_whose_prefix_is_the_match():
    pending = PendingReplays()
    a, b = Match(100, None), Match(40, 0)
    pending.add(req_pool_idx=5, match=a, req="a")
    pending.add(req_pool_idx=7, match=b, req="b")
    assert pending.take([7, 3, 5], [40, 0, 100]) == [(0, b, "b"), (2, a, "a")]
    assert len(pending) == 0


def test_a_leftover_entry_is_dropped_not_replayed_into_the_next_request_on_its_row():
    # Row 5's request was aborted after prepare_for_extend; a later chunked-prefill request on row 5 whose prefix
    # happens to have the same length must not get its live state overwritten by a replay.
    pending = PendingReplays()
    pending.add(req_pool_idx=5, match=Match(128, 64), req="aborted")
    assert pending.take([2], [0]) == []
    assert pending.take([5], [128]) == []


def test_a_match_that_is_not_the_extend_prefix_is_not_replayed():
    pending = PendingReplays()
    pending.add(req_pool_idx=1, match=Match(64, None), req="r")
    assert pending.take([1], [32]) == []


class _DeviceRows:
    """A batch's device-side row tensor that fails the test if the replay reads it."""

    def tolist(self):
        raise AssertionError("the replay read the batch's rows from the device")


def test_an_extend_with_no_hit_pending_reads_nothing_from_the_device():
    from types import SimpleNamespace

    from tailreplay_sglang.config import TailReplayConfig
    from tailreplay_sglang.replay import run_pending

    batch = SimpleNamespace(req_pool_indices=_DeviceRows(), req_pool_indices_cpu=None, extend_prefix_lens_cpu=[0])
    assert run_pending(None, batch, None, None, PendingReplays(), TailReplayConfig(enabled=True)) is None


def test_the_replay_takes_the_batch_rows_from_sglangs_host_copy():
    import torch

    from tailreplay_sglang.replay import pool_rows_of
    from types import SimpleNamespace

    batch = SimpleNamespace(req_pool_indices=_DeviceRows(), req_pool_indices_cpu=torch.tensor([4, 1]))
    assert pool_rows_of(batch) == [4, 1]


def test_the_replays_moe_routes_every_row_whatever_the_outer_batch_bound(monkeypatch):
    """Inside a forward whose context binds the outer batch's count of real tokens (SGLang does under expert
    parallelism or DP attention), TopK masks the rows past it; the replay's packed tails are longer than the extend
    they run in, so inside the replay the count is unbound and every row keeps its experts (issue 38 F2)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.topk import _mask_topk_ids_padded_region, resolve_routing_inputs
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from tailreplay_sglang import replay
    from tailreplay_sglang.replay import own_token_counts

    def routed(rows: int) -> torch.Tensor:
        count, _ = resolve_routing_inputs(layer_id=0, is_draft=True)  # what TopK asks the context
        topk_ids = torch.arange(rows * 2).view(rows, 2)
        _mask_topk_ids_padded_region(topk_ids, count)
        return topk_ids

    outer = ForwardContext(attn_backend=SimpleNamespace(), moe_num_token_non_padded=lambda: torch.tensor(20))
    with forward_context(outer):
        assert (routed(300)[20:] == -1).all()  # the outer batch's 20 tokens: the rest get no expert
        with own_token_counts():
            assert (routed(300) >= 0).all()
        assert (routed(300)[20:] == -1).all()  # the outer forward's own bound is back
        seen = []  # and the replay pass runs its groups inside it
        monkeypatch.setattr(replay, "_run_groups", lambda *args: seen.append(routed(300)))
        replay.run(None, None, None, None)
        assert (seen[0] >= 0).all()
    with own_token_counts():  # no forward context (unit use): nothing to unbind
        assert (routed(4) >= 0).all()


# ---- a hit whose prefix changed between its match and its extend (`request.retarget`) ----

RETARGET = TailReplayConfig(enabled=True, exact_budget=100, min_tokens=8, max_tokens=8, anchor_interval=0)


@pytest.mark.parametrize("planned, prefix, clean, expected", [
    (Match(300, 250, exact=True), 300, True, Match(300, 250, exact=True)),  # as planned: unchanged
    # the same anchor within the new prefix, shorter or longer (past the budget too: exact, just longer)
    (Match(300, 250, exact=True), 260, True, Match(260, 250, exact=True)),
    (Match(300, 250, exact=True), 400, True, Match(400, 250, exact=True)),
    (Match(300, 250, exact=True), 400, False, Match(400, 250, exact=False)),  # tainted KV past the plan
    # the staged anchor lies past the prefix: a zeroed slot, from the root within the budget, else the zero-init tail
    (Match(300, 250, exact=True), 90, True, Match(90, 0, exact=True, reset=True)),
    (Match(300, 250, exact=True), 200, True, Match(200, None, exact=False, reset=True)),
    # a zero-init tail's slot is cleared already: no reset
    (Match(300, None, exact=False), 200, True, Match(200, None, exact=False)),
    # the anchor exactly at the new prefix: a fold to it (exact), not the root branch
    (Match(300, 250, exact=True), 250, True, Match(250, 250, exact=True)),
    # from the root within the budget, but over KV an approximate request computed
    (Match(300, 250, exact=True), 90, False, Match(90, 0, exact=False, reset=True)),
])
def test_a_replay_is_retargeted_to_the_prefix_the_request_extends_from(planned, prefix, clean, expected):
    assert retarget(planned, prefix, clean, RETARGET) == expected


PAPER = TailReplayConfig(enabled=True, exact_budget=0, min_tokens=8, max_tokens=8)  # no anchors: the zero-init tail


@pytest.mark.parametrize("clean", [True, False])
def test_a_retargeted_zero_init_tail_covering_its_prefix_is_exact_only_over_clean_kv(clean):
    """The paper's mode: a tail that covers the whole new prefix rebuilds it exactly, unless the prefix's KV is
    tainted."""
    assert retarget(Match(300, None), 6, clean, PAPER) == Match(6, None, exact=clean)


@pytest.mark.parametrize("prefix, tainted, expected", [
    (260, False, Match(260, 250, exact=True)),
    (260, True, Match(260, 250, exact=False)),
    (200, False, Match(200, None, exact=False, reset=True)),
])
def test_mark_pending_retargets_a_hit_and_relabels_its_request(prefix, tainted, expected):
    """`lifecycle.mark_pending` (AFTER `ScheduleBatch.prepare_for_extend`) on a request whose final prefix is not the
    one its match planned: the pending replay is the retargeted one and the request's label (`tail_replay_exact`)
    follows it, judged by the taint of the node it extends from."""
    from types import SimpleNamespace

    from tailreplay_sglang.cache.request import REQ_ATTR, TAINT_ATTR, TailReplayReq
    from tailreplay_sglang.lifecycle import mark_pending

    root = SimpleNamespace(parent=None)
    node = SimpleNamespace(parent=root, **{TAINT_ATTR: tainted})
    req = SimpleNamespace(rid="retargeted", prefix_len=prefix, kv=SimpleNamespace(req_pool_idx=3), last_node=7,
                          **{REQ_ATTR: TailReplayReq(match=Match(300, 250, exact=True), exact=True)})
    batch = SimpleNamespace(reqs=[req], tree_cache=SimpleNamespace(
        tree_core=SimpleNamespace(node_by_id=lambda node_id: node if node_id == 7 else None)))
    runtime = SimpleNamespace(pending=PendingReplays(), config=RETARGET, interval_anchors=None, family=None)
    assert mark_pending(runtime, "result", batch) == "result"
    state = getattr(req, REQ_ATTR)
    assert state.match is None and state.exact is expected.exact
    assert runtime.pending.take([3], [prefix]) == [(0, expected, req)]


def test_a_retargeted_replay_whose_slot_holds_another_prefixs_state_zeroes_it_first():
    """`reset`: the slot holds the state staged for a longer prefix, so the replay from the root must not start from
    it; the pass zeroes exactly those slots (SGLang's own clear_slots) before it runs."""
    from types import SimpleNamespace

    from tailreplay_sglang.replay import plan

    cleared = []
    pool = SimpleNamespace(req_to_token=torch.arange(40).view(2, 20), get_mamba_indices=lambda rows: rows + 10,
                           translate_mamba_indices=lambda slots: slots,
                           mamba_pool=SimpleNamespace(clear_slots=lambda slots: cleared.extend(slots.tolist())))
    rows = [(0, Match(6, 0, exact=True, reset=True), "reset"), (1, Match(6, 4, exact=True), "kept")]
    batch = plan(SimpleNamespace(req_to_token_pool=pool), [0, 1], rows, RETARGET)
    assert cleared == [10] and batch.tail_lens == [6, 2] and batch.reqs == ["reset", "kept"]
