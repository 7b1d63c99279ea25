"""The mutant table of the exactness bookkeeping: each mutant applied to a copy of the plugin, the tests that must
catch it run against the copy; every mutant must be killed (a test fails).

    .venv/bin/python tests/mutants.py [--only M2 M6 ...] [--out runs/mutants.json]

Not part of `make test` (minutes of pytest runs). The mutants are single-line changes to decisions that make a hit
exact or keep the pools whole: the 13 of ../shared/notes/tests-audit-2026-12-04.md (M1-M10) and one per further
decision (taint, relay, hold; the HiCache anchor backup and the storage anchors, whose tests start servers; the GPU
path review's N1-N6, whose contract tests stand in for a GPU). Mutants of the cache component
that its property tests already apply by monkeypatch (`tests/test_cache_properties.py`, BROKEN: taint on insert and
split, budget, fold, copy, hold, keep-ends, host restore) run there, in `make test`. Each copy is the repository's
`tailreplay_sglang/` and `tests/`, imported first through PYTHONPATH, so the installed editable package is not touched.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
PROPERTIES = "tests/test_cache_properties.py"
COPY = "tailreplay_sglang/cache/anchor_copy.py"
STORE = "tailreplay_sglang/store/hidden_store.py"
HICACHE_HOST_HITS = "tests/test_hicache_tail_replay.py::test_host_hits_are_exact_at_any_token_boundary"
# Storage hits past the exact budget, replayed from a state another server stored (file, then Mooncake)
STORED_ANCHOR_HITS = ("tests/test_hicache_tail_replay.py::test_second_server_hits_the_file_tier_off_grid",
                      "tests/test_mooncake_store.py::test_tail_replay_servers_hit_the_store_off_grid")
# Issue 64 E's decision, against SGLang's own MLP-sync rows
E_TEST = "tests/test_dp_collectives.py::test_steps_without_a_replay_anywhere_skip_the_row_exchange"
# The server tests that cut a prefix after its match (the test plugin's fault): a retarget in the real scheduler
# A Ling-2.5 fork hit (tiny-ling-2.5; "fork-anchor"): replayed from an interval anchor, then HF's greedy on a later hit
LING25_FORK = ("tests/test_hybrid_families.py::test_fork_replays_from_the_nearest_interval_anchor_and_equals_no_cache"
               "[tiny-ling-2.5-{}]")
# A Jet-Nemotron fork hit (tiny-jet-nemotron; "fork-anchor"): replayed from an interval anchor
JET_FORK = ("tests/test_hybrid_families.py::test_fork_replays_from_the_nearest_interval_anchor_and_equals_no_cache"
            "[tiny-jet-nemotron-{}]")
# A Kimi K3 fork hit (tiny-kimi-k3; "fork-anchor"): replayed from an interval anchor through all three groups
K3_FORK = ("tests/test_hybrid_families.py::test_fork_replays_from_the_nearest_interval_anchor_and_equals_no_cache"
           "[tiny-kimi-k3-{}]")
RETARGET_SERVER = ("tests/test_anchored_replay.py::test_a_prefix_cut_after_the_match_retargets_the_hit",
                   "tests/test_anchored_replay.py::test_a_retargeted_hit_on_tainted_kv_is_approximate")


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str  # relative to the repository
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]
    server: bool = False  # its tests start servers (which import the copy too: PYTHONPATH reaches them)


MUTANTS = (
    Mutant("M1", "the hidden store moves rows one at a time (a source overwritten before it is read)",
           STORE,
           "            rows = self._read(table, source_slots)\n",
           "            for t, s in zip(target_slots.tolist(), source_slots.tolist()):\n"
           "                table[t] = self._read(table, source_slots.new_tensor([s]))[0]\n"
           "            rows = self._read(table, source_slots)\n",
           ("tests/test_hidden_tier.py",)),
    Mutant("M1b", "a move carries only the first stored group's rows", STORE,
           "        for table in (self.token_ids, *self.hiddens):\n            rows = self._read(",
           "        for table in (self.token_ids, *self.hiddens[:1]):\n            rows = self._read(",
           ("tests/test_hidden_tier.py",)),
    Mutant("M2", "a retarget from the root labels tainted KV exact", "tailreplay_sglang/cache/request.py",
           "return Match(prefix, 0, exact=clean, reset=reset)", "return Match(prefix, 0, exact=True, reset=reset)",
           ("tests/test_pending_replays.py",)),
    Mutant("M2b", "a retarget to its anchor's own depth goes to the root branch", "tailreplay_sglang/cache/request.py",
           "match.anchor <= prefix:", "match.anchor < prefix:", ("tests/test_pending_replays.py",)),
    Mutant("M2c", "a retargeted zero-init tail ignores the taint", "tailreplay_sglang/cache/request.py",
           "exact=clean and config.is_exact_fallback(prefix)", "exact=config.is_exact_fallback(prefix)",
           ("tests/test_pending_replays.py",)),
    Mutant("M3", "a plugin host anchor is never unpinned", COPY,
           "            host_anchors.unpin(self.node)", "            pass", (PROPERTIES,)),
    Mutant("M4", "a node split loses the taint", "tailreplay_sglang/cache/component.py",
           "        setattr(new_parent, TAINT_ATTR, getattr(child, TAINT_ATTR, False))", "        pass",
           (PROPERTIES,)),
    Mutant("M5", "KV an approximate insert re-materialises from the host is not tainted",
           "tailreplay_sglang/cache/component.py",
           "            setattr(node, TAINT_ATTR, True)  # the node's KV on the device is now", "            pass  #",
           (PROPERTIES,)),
    Mutant("M6", "mark_pending keeps the label of the plan it retargeted", "tailreplay_sglang/lifecycle.py",
           "                state.exact = match.exact", "                pass", ("tests/test_pending_replays.py",)),
    Mutant("M7", "unstage keeps the slot of a request matched but not admitted", COPY,
           "    cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))", "    pass",
           (PROPERTIES,)),
    Mutant("M8", "release leaks the device anchor's lock of a request not admitted",
           COPY,
           "            if held.lock is not None and held.hicache is None:\n"
           "                cache.dec_lock_ref(held.node.id, held.lock.to_dec_params())\n            elif is_admitted:",
           "            if held.lock is not None and held.hicache is None:\n"
           "                if is_admitted:\n"
           "                    cache.dec_lock_ref(held.node.id, held.lock.to_dec_params())\n"
           "            elif is_admitted:",
           (PROPERTIES,)),
    Mutant("M9", "the forward's host restore keeps the pin", COPY,
           "                host_anchors.restore(held.node, req_to_token_pool.mamba_pool, slot)\n"
           "                held.unhold_host(host_anchors)",
           "                host_anchors.restore(held.node, req_to_token_pool.mamba_pool, slot)\n"
           "                pass",
           (PROPERTIES,)),
    Mutant("M10", "a re-planned request's host hold is kept (StagedAnchors.drop)", COPY,
           "            else:\n                held.unhold_host(host_anchors)\n        self._held = keep",
           "            else:\n                pass\n        self._held = keep", (PROPERTIES,)),
    Mutant("taint", "an approximate request's new leaf is not tainted", "tailreplay_sglang/cache/component.py",
           "            setattr(node, TAINT_ATTR, True)  # the new leaf", "            pass  #", (PROPERTIES,)),
    Mutant("relay", "the decode server labels every request exact, whatever P relayed",
           "tailreplay_sglang/disaggregation.py",
           "    setattr(req, REQ_ATTR, relayed)", "    setattr(req, REQ_ATTR, TailReplayReq(exact=True))",
           ("tests/test_disaggregation.py",)),
    Mutant("M2bs", "M2b, caught in the server: a retarget to its anchor's own depth goes to the root branch",
           "tailreplay_sglang/cache/request.py", "match.anchor <= prefix:", "match.anchor < prefix:", RETARGET_SERVER,
           server=True),
    Mutant("M6s", "M6, caught in the server: mark_pending keeps the label of the plan it retargeted",
           "tailreplay_sglang/lifecycle.py", "                state.exact = match.exact", "                pass",
           RETARGET_SERVER, server=True),
    Mutant("reset", "a retargeted replay starts from the state its slot holds for another prefix",
           "tailreplay_sglang/replay.py", "        if match.reset:\n            resets.append(pool_idx)",
           "        if False:\n            resets.append(pool_idx)", RETARGET_SERVER, server=True),
    Mutant("N1", "an anchor's host index is copied to the device off the forwards' stream (GPU path review N1)",
           "tailreplay_sglang/cache/component.py",
           "        with on_forward_stream(self.runtime.forward_stream):\n"
           "            keep_for_forward_stream(data.value, self.runtime.forward_stream)\n"
           "            host_indices, device_indices = controller.move_indices(host_value, data.value.view(-1))\n",
           "        host_indices, device_indices = controller.move_indices(host_value, data.value.view(-1))\n"
           "        with on_forward_stream(self.runtime.forward_stream):\n"
           "            keep_for_forward_stream(data.value, self.runtime.forward_stream)\n",
           ("tests/test_stream_order.py",)),
    Mutant("N2", "HiCache's host twin copies the host-tier store without draining its write-back (N2)",
           "tailreplay_sglang/store/hicache_pool.py",
           "        device_pool.drain()  # on the host tier the last forwards' rows",
           "        pass  # on the host tier the last forwards' rows", ("tests/test_hidden_tier.py",)),
    Mutant("N3", "a host-tier move hands host rows to the write-back (N3: record_stream on a host tensor)",
           STORE, "                table.index_copy_(0, target_slots.to(table.device, torch.int64), rows)",
           "                self._write(table, target_slots, rows)", ("tests/test_hidden_tier.py",)),
    Mutant("N5", "the anchors' copy-on-write waits for the batch's whole load-back (GPU path review N5)",
           COPY, "    if src_index.numel() == 0 or pool.layer_transfer_counter is None:",
           "    if True:", ("tests/test_stream_order.py",)),
    Mutant("N6", "the hidden rows' host twin reads its indices on the host on the kernel io backend (N6)",
           "tailreplay_sglang/store/hicache_pool.py",
           "        if io_backend == \"kernel\" and self.kernel_copy is not None:",
           "        if False:", ("tests/test_hidden_tier.py",)),
    Mutant("A", "an evicted anchor's device index is freed with a copy on the forwards' stream still to read it",
           "tailreplay_sglang/cache/component.py", "        index.record_stream(stream)", "        pass",
           ("tests/test_stream_order.py",)),
    Mutant("B", "a HiCache anchor's host lock is given back as soon as its restore is queued",
           COPY, "                self._restoring.append((held, copy_done_event()))",
           "                self._restoring.append((held, None))", ("tests/test_stream_order.py",)),
    Mutant("F2", "a re-admitted request takes its new match's label, although it emitted output from an approximate "
           "state", "tailreplay_sglang/cache/request.py", "    state.exact = exact and not state.emitted_approximate",
           "    state.exact = exact", (PROPERTIES,)),
    Mutant("F2-server", "F2 in the real scheduler: SGLang retracts an approximate request, which comes back to a miss",
           "tailreplay_sglang/cache/request.py", "    state.exact = exact and not state.emitted_approximate",
           "    state.exact = exact", ("tests/test_retraction.py",), server=True),
    Mutant("F6", "a re-admission keeps the replay figures of the request's first admission",
           "tailreplay_sglang/cache/request.py",
           "    state.anchor, state.tokens, state.ms, state.state_survival = None, 0, 0.0, None", "    pass",
           (PROPERTIES,)),
    Mutant("F5", "a PD rebootstrap takes the new prefill's label over output D streamed from an approximate state",
           "tailreplay_sglang/disaggregation.py", "        relayed.emitted_approximate, relayed.exact = True, False",
           "        pass", ("tests/test_disaggregation.py",)),
    Mutant("F1", "TP ranks plan a storage hit from their own stores, without agreeing on the plan's inputs",
           "tailreplay_sglang/cache/storage_anchors.py",
           "        storage_hit_count = agree_on_plan(controller, operation, transfer, storage_hit_count)",
           "        pass", ("tests/test_storage_anchors.py",)),
    Mutant("F1-server", "F1 in a TP 2 server sharing a `file` L3, one rank's stored states removed",
           "tailreplay_sglang/cache/storage_anchors.py",
           "        storage_hit_count = agree_on_plan(controller, operation, transfer, storage_hit_count)",
           "        pass",
           ("tests/test_scale_out.py::test_tp2_ranks_whose_stored_states_differ_plan_one_storage_hit_and_stay_honest",),
           server=True),
    Mutant("F7", "a `file` folder is not claimed: servers of another layout read each other's pages",
           "tailreplay_sglang/cache/hierarchy.py",
           "            claim_file_folder(file_folder(extra), json.loads(with_storage_tag(extra, tag))"
           "[\"extra_backend_tag\"])", "            pass", ("tests/test_supported.py",)),
    Mutant("D", "a state's storage write blocks the scheduler on its copy's event",
           "tailreplay_sglang/cache/hierarchy.py",
           "            if copied is not None and not copied.query():",
           "            if copied is not None and copied.synchronize():",
           ("tests/test_stream_order.py",)),
    Mutant("tag-kv", "the storage tag ignores --kv-cache-dtype (same-size KV dtypes read as each other's)",
           "tailreplay_sglang/cache/storage_key.py",
           "            \"kv_cache_dtype\": getattr(args, \"kv_cache_dtype\", None),",
           "            \"kv_cache_dtype\": None,", ("tests/test_supported.py",)),
    Mutant("tag-revision", "the storage tag ignores --revision", "tailreplay_sglang/cache/storage_key.py",
           "            \"revision\": getattr(args, \"revision\", None),", "            \"revision\": None,",
           ("tests/test_supported.py",)),
    Mutant("tag-page", "the storage tag ignores --page-size", "tailreplay_sglang/cache/storage_key.py",
           "            \"page_size\": getattr(args, \"page_size\", None)}", "            \"page_size\": None}",
           ("tests/test_supported.py",)),
    Mutant("page-depth", "a stored state's depth counts pages as tokens (page size > 1)",
           "tailreplay_sglang/cache/storage_anchors.py", "        return self.start + page * self.page_size",
           "        return self.start + page", ("tests/test_storage_anchors.py",)),
    Mutant("page-hit", "the agreed storage hit's tokens are taken for pages (page size > 1)",
           "tailreplay_sglang/cache/storage_anchors.py", "    pages = hit // controller.page_size", "    pages = hit",
           ("tests/test_storage_anchors.py",)),
    Mutant("dp-peers-count", "attention-TP peers each count their group's rows in the exchange (attention TP > 1)",
           "tailreplay_sglang/dp_attention.py", "    mine = local_rows if parallel.attn_tp_rank == 0 else 0",
           "    mine = local_rows", ("tests/test_dp_collectives.py",)),
    Mutant("dp-leader", "a rank takes its own TP rank's rows, not its attention-TP leader's",
           "tailreplay_sglang/dp_attention.py", "    leader = group.rank_in_group - parallel.attn_tp_rank",
           "    leader = group.rank_in_group", ("tests/test_dp_collectives.py",)),
    Mutant("dp-peers-rows", "attention-TP peers each add their group's rows into the gathered buffer",
           "tailreplay_sglang/dp_attention.py", "        if h is not None and parallel.attn_tp_rank == 0:",
           "        if h is not None:", ("tests/test_dp_collectives.py",)),
    Mutant("dp-participate-order", "a rank taking part in another's replay walks the feed-forward blocks in reverse "
           "order (its collectives pair with the wrong blocks' partial sums)", "tailreplay_sglang/families/base.py",
           "        for mlp in self.feed_forwards(model, layout):",
           "        for mlp in reversed(self.feed_forwards(model, layout)):",
           ("tests/test_dp_attention.py::test_rebuilt_states_equal_hfs",), server=True),
    Mutant("H", "fla's chunk kernel is not given the planner's host cu_seqlens (a device read-back per pass)",
           "tailreplay_sglang/kernels/replay.py",
           "                                      cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=cu_seqlens_cpu)",
           "                                      cu_seqlens=cu_seqlens.long())",
           ("tests/test_stream_order.py::test_the_fla_chunk_path_gets_the_planners_host_cu_seqlens",)),
    Mutant("K", "the overlapped copy stream is drawn anew for every pass (it can alias the forwards' stream)",
           "tailreplay_sglang/store/transfer.py", "    stream = _COPY_STREAMS.get(device)", "    stream = None",
           ("tests/test_hidden_tier.py::test_the_overlapped_copy_stream_is_drawn_once_and_is_never_the_forward_"
            "stream",)),
    Mutant("lfm2-window-short", "LFM2's replay window one token short of (K - 1) x the largest group's conv layers",
           "tailreplay_sglang/families/short_conv.py",
           "        return (layout.conv_kernel - 1) * max(len(group.recurrent_layers) for group in layout.groups)",
           "        return (layout.conv_kernel - 1) * max(len(group.recurrent_layers) for group in layout.groups) - 1",
           ("tests/test_lfm2.py::test_a_hit_at_any_token_replays_the_window_from_zero_and_equals_no_cache",),
           server=True),
    Mutant("lfm2-stored-input", "LFM2's stored group input read from `residual` (SGLang's split-residual convention, "
           "which LFM2's layers do not follow: there it is the previous layer's input)", "tailreplay_sglang/capture.py",
           '                   widened(kwargs["hidden_states"], store.layout.streams, store.layout.hidden_size))',
           '                   widened(kwargs["residual"], store.layout.streams, store.layout.hidden_size))',
           ("tests/test_lfm2.py::test_a_hit_at_any_token_replays_the_window_from_zero_and_equals_no_cache",),
           server=True),
    Mutant("zaya-window-short", "ZAYA1's replay window one token short of W x the CCA layers",
           "tailreplay_sglang/families/cca.py",
           "        return (layout.conv_kernel - 1) * sum(len(group.recurrent_layers) for group in layout.groups)",
           "        return (layout.conv_kernel - 1) * sum(len(group.recurrent_layers) for group in layout.groups) - 1",
           ("tests/test_zaya.py::test_a_hit_at_any_token_replays_the_window_and_equals_no_cache",), server=True),
    Mutant("zaya-unrotated-query", "ZAYA1's replayed queries attend to the cached (rotated) keys without their own "
           "rotary embedding", "tailreplay_sglang/families/cca.py",
           "    out = cached_kv_attention(q.view(t, cca.num_q_heads, d), batch, context, attn.attn.layer_id, "
           "attn.scale)",
           "    out = cached_kv_attention(query.to(h.dtype), batch, context, attn.attn.layer_id, attn.scale)",
           ("tests/test_zaya.py::test_a_hit_at_any_token_replays_the_window_and_equals_no_cache",), server=True),
    Mutant("zaya-tail-only-attention", "ZAYA1's replayed queries attend only to the replayed tail's cached KV, not "
           "the whole matched prefix", "tailreplay_sglang/families/cca.py",
           "            self.kv_rows.append(pool.req_to_token[row, :end].long())",
           "            self.kv_rows.append(pool.req_to_token[row, :end].long()); self.masks.append(None); "
           "self.masks.pop(); self.kv_rows[-1][:start] = self.kv_rows[-1][start]",
           ("tests/test_zaya.py::test_a_hit_at_any_token_replays_the_window_and_equals_no_cache",), server=True),
    Mutant("wrapper-reembed", "a vision wrapper's replay (MiniCPM-V 4.6, LFM2-VL, Kimi K3) re-embeds the ids of an "
           "image's rows instead of reading the stored group-0 input (the vision tower's features)",
           "tailreplay_sglang/layout.py",
           "        return cls(layer_kinds(text), text.hidden_size, stores_embeddings=vision is not None, mixer=mixer,",
           "        return cls(layer_kinds(text), text.hidden_size, stores_embeddings=False, mixer=mixer,",
           ("tests/test_vision_wrappers.py::test_a_hit_through_a_split_image_equals_no_cache",
            "tests/test_kimi_k3_vl.py::test_a_hit_through_an_image_replays_its_stored_rows_and_equals_no_cache"),
           server=True),
    Mutant("ple-state-stale", "a hit's PLE conv states are left as the anchor's slot holds them (GDN states only) or "
           "a cleared slot does, not rebuilt at the match end", "tailreplay_sglang/families/hyper_gdn.py",
           "                ple_ops.write_states(ple, pool, slot, state)", "                pass",
           ("tests/test_qwen38_ple.py::test_a_fork_rebuilds_the_ple_states_and_equals_no_cache",), server=True),
    Mutant("ple-tail-skipped", "a PLE group's replay leaves out the layer's contribution over the tail",
           "tailreplay_sglang/families/hyper_gdn.py",
           "            x = x + self._ple_over_tails(model, pool, group, ple, x, batch)", "            pass",
           ("tests/test_qwen38_ple.py::test_a_fork_rebuilds_the_ple_states_and_equals_no_cache",), server=True),
    Mutant("ple-history-shifted", "the n-gram history written at a hit's match end is one token early",
           "tailreplay_sglang/families/hyper_gdn.py",
           "            histories.append(ple_ops.span_ids(store, pool.req_to_token[row], end, end, "
           "embedding.ngram_size - 1,",
           "            histories.append(ple_ops.span_ids(store, pool.req_to_token[row], end - 1, end - 1, "
           "embedding.ngram_size - 1,",
           ("tests/test_qwen38_ple.py::test_a_fork_rebuilds_the_ple_states_and_equals_no_cache",), server=True),
    Mutant("replan-skip", "a load-back that brings fewer tokens than planned keeps the old plan (replan_after_load)",
           "tailreplay_sglang/cache/component.py",
           "        if state is None or state.match is None or state.match.matched == m:",
           "        if state is None or state.match is None or state.match.matched != m:", (PROPERTIES,)),
    Mutant("replan-drop", "a re-planned hit keeps holding the anchor of its old plan",
           "tailreplay_sglang/cache/component.py",
           "        self.runtime.staged_anchors.drop(self.cache, self.runtime.host_anchors, req)\n"
           "        req.kv.mamba_cow_src_index = None", "        req.kv.mamba_cow_src_index = None", (PROPERTIES,)),
    Mutant("pin-drop", "the host pool drops its least recently used state whether or not a hit has pinned it",
           "tailreplay_sglang/cache/host_anchors.py",
           "        victim = next((node for node in self._slots if node not in self._pinned), None)",
           "        victim = next(iter(self._slots), None)", ("tests/test_host_anchor_copies.py",)),
    Mutant("pin-count", "one unpin releases every pin of an anchor",
           "tailreplay_sglang/cache/host_anchors.py", "        if left:", "        if False:",
           ("tests/test_host_anchor_copies.py",)),
    Mutant("evicted-write", "an anchor evicted before its deferred storage backup never reaches storage",
           "tailreplay_sglang/cache/component.py", "        self.cache.write_state_to_storage(node, stored)",
           "        pass", ("tests/test_stream_order.py",)),
    Mutant("evicted-backup", "the deferred backup of an anchor the eviction already copied runs again",
           "tailreplay_sglang/cache/hierarchy.py",
           "            if not self._in_tree(node) or state.value is None or state.host_value is not None or not "
           "node.backuped:", "            if not self._in_tree(node) or not node.backuped:",
           ("tests/test_stream_order.py",)),
    Mutant("decode-ancestor", "the PD decode server's match checks the matched node's own taint, not its ancestors'",
           "tailreplay_sglang/cache/decode_component.py",
           "        return lambda node: not is_tainted(node)",
           "        return lambda node: not getattr(node, TAINT_ATTR, False)", (PROPERTIES,)),
    Mutant("E-mark", "a rank with a replay pending does not mark SGLang's MLP-sync row (steps with a replay skip the "
           "exchange)", "tailreplay_sglang/dp_attention.py", "        row[EXTEND_COLUMN] += REPLAY_MARK",
           "        pass", (E_TEST,)),
    Mutant("E-read", "every extend step exchanges rows, replay or not (review E)", "tailreplay_sglang/dp_attention.py",
           "    runtime.replay_in_step = gathered is None or int(gathered[:, EXTEND_COLUMN].max()) >= REPLAY_MARK",
           "    runtime.replay_in_step = True", (E_TEST,)),
    Mutant("commit", "a state read from storage is committed at the hit's last node, not at its own depth",
           "tailreplay_sglang/cache/component.py",
           "        pointed = dataclasses.replace(inserted, inserted_host_node=at_depth.id)",
           "        pointed = inserted", STORED_ANCHOR_HITS, server=True),
    Mutant("state-key", "a planned state is read under the hit's last page's key (SGLang's), not its own",
           "tailreplay_sglang/cache/storage_anchors.py",
           "            transfer.keys = [plan.hash_values[plan.state - 1]]", "            pass",
           STORED_ANCHOR_HITS, server=True),
    Mutant("taint-store", "tainted (approximate) KV is written to storage, where its taint cannot follow",
           "tailreplay_sglang/cache/hierarchy.py", "        if is_tainted(self.tree_core.node_by_id(node_id)):",
           "        if False:", ("tests/test_hicache_tail_replay.py::test_never_writes_approximate_kv_to_storage",),
           server=True),
    Mutant("state-tag", "Mooncake pages carry no state-layout tag (another layout's states read as this one's)",
           "tailreplay_sglang/cache/hierarchy.py",
           "        if memory.hicache_storage_backend not in (\"mooncake\", \"file\") or self.runtime.store is None:",
           "        if True:",
           ("tests/test_mooncake_store.py::test_never_writes_approximate_kv_to_the_store",), server=True),
    Mutant("backup", "an anchor leaving the device under HiCache is never copied to its host pool by the plugin",
           "tailreplay_sglang/cache/component.py", "                self._backup_state_to_hicache(node)",
           "                pass", (HICACHE_HOST_HITS,),
           server=True),
    # Ling-3.0 (issue 67): where its layers are, and what a KDA group's stored input is
    Mutant("ling-layout", "Bailing's layer_group_size read 0-indexed (MLA at layers 0, 4 instead of 3, 7)",
           "tailreplay_sglang/layout.py",
           "        return tuple(FULL if (i + 1) % period == 0 else LINEAR for i in range(n))",
           "        return tuple(FULL if i % period == 0 else LINEAR for i in range(n))",
           ("tests/test_layout.py::test_ling_groups_from_its_layer_group_size",)),
    Mutant("ling-stored-input", "a stage-boundary model's stored group input is its neighbour token's row (an "
           "off-by-one in the rows captured at the group's first layer)", "tailreplay_sglang/capture.py",
           "    return forward_batch.residual_stream.residual\n",
           "    return forward_batch.residual_stream.residual.roll(1, 0)\n",
           ("tests/test_hybrid_families.py::test_fork_replays_from_the_nearest_interval_anchor_and_equals_no_cache"
            "[tiny-ling-3.0-560-512]",), server=True),
    # Ling-2.5 (issue 67): what a lightning replay and its anchors need
    Mutant("ling25-anchor-in-decode", "lightning interval anchors written in every forward while the prefill's plan "
           "is set, the decode forwards after it included", "tailreplay_sglang/families/lightning.py",
           "    if not anchors.by_slot or metadata.num_prefills == 0 or kwargs.get(\"temp_cache\") is not None:",
           "    if not anchors.by_slot or kwargs.get(\"temp_cache\") is not None:",
           (LING25_FORK.format("100-0"),), server=True),
    Mutant("ling25-positions", "the replay rotates a tail's q and k at positions from 0, not from the tail's start",
           "tailreplay_sglang/families/base.py",
           "        host = torch.cat([torch.arange(start, start + n) for start, n in zip(self.tail_starts, "
           "self.tail_lens)])",
           "        host = torch.cat([torch.arange(n) for start, n in zip(self.tail_starts, self.tail_lens)])",
           (LING25_FORK.format("560-512"),), server=True),
    Mutant("ling25-anchor-offset", "a lightning interval anchor's closed form stops one token short of its offset",
           "tailreplay_sglang/families/lightning.py",
           "                                      ends=[offset for offset, _ in cuts], state_only=True)",
           "                                      ends=[max(offset - 1, 0) for offset, _ in cuts], state_only=True)",
           (LING25_FORK.format("560-512"),), server=True),
    Mutant("ling25-layer-slopes", "the replay decays each lightning layer at the previous layer's rates",
           "tailreplay_sglang/families/lightning.py",
           "            layer, rate = model.layers[layer_id], pin(rates[layer_id]).to(x.device, non_blocking=True)",
           "            layer, rate = model.layers[layer_id], pin(rates[layer_id - 1]).to(x.device, non_blocking=True)",
           (LING25_FORK.format("560-512"),), server=True),
    # Kimi K3 (issue 67): the rows a group's first layer reads beside its stored prefix, and that prefix
    Mutant("k3-bank-dropped", "a Kimi K3 group's replay reads zeros for the rows banked below it (the earlier "
           "groups' rows are dropped from its bank)", "tailreplay_sglang/families/attn_res_kda.py",
           "                            block_residual=torch.stack(banked, dim=1) if banked else None)",
           "                            block_residual=torch.zeros_like(torch.stack(banked, dim=1)) if banked "
           "else None)",
           (K3_FORK.format("560-512"),), server=True),
    Mutant("k3-stored-row", "a Kimi K3 group that starts on a banking layer stores the row banked a block earlier "
           "(an off-by-one in the bank) instead of the one its read banked",
           "tailreplay_sglang/families/attn_res_kda.py",
           "    return bank.block_residual[:, bank.num_valid_blocks - 1]\n",
           "    return bank.block_residual[:, bank.num_valid_blocks - 2]\n",
           (K3_FORK.format("560-512"),), server=True),
    Mutant("jet-anchor-unwritten", "Jet-Nemotron's interval anchors keep their slot's cleared state: the state "
           "where the anchor's round ends is not copied into it", "tailreplay_sglang/families/jet.py",
           "            states[dst] = states[slot]\n", "            pass\n",
           (JET_FORK.format("300-256"),), server=True),
    Mutant("jet-window-cleared", "Jet-Nemotron's replay convolves a tail's first values with a cleared window instead "
           "of the anchor's", "tailreplay_sglang/families/jet.py",
           "    inputs, window = block_inputs(block, h, conv[slots], seq_lens)",
           "    inputs, window = block_inputs(block, h, torch.zeros_like(conv[slots]), seq_lens)",
           (JET_FORK.format("300-256"),), server=True),
    # Issue 63 item 2: the host tier's staging area under CUDA graphs (contract tests under the graph stand-in)
    Mutant("staging-no-reset", "a flushed staging area keeps its slot ids, so a later replay that staged nothing "
           "applies its rows again", "tailreplay_sglang/store/staging.py",
           "            slots.fill_(EMPTY)\n", "", ("tests/test_graph_staging.py",)),
    Mutant("staging-no-flush", "nothing moves the staged rows to the host after a replay",
           STORE, "            self.staging.flush(n, self._tables(), self.write_back)\n", "            pass\n",
           ("tests/test_graph_staging.py",)),
    Mutant("staging-eager-in-capture", "a captured forward's rows go through the eager write-back",
           STORE, "        elif self.staging is not None and self._capturing():\n",
           "        elif self.staging is not None and False:\n", ("tests/test_graph_staging.py",)),
    # Issue 67: Qwen3.8-Flash-Next's replay reads every hyper-connection stream of the stored group input
    Mutant("hyper-one-stream", "the replay zeroes the last of the 4 hyper-connection streams of a group's input",
           "tailreplay_sglang/families/hyper_gdn.py",
           "        return capture.widened(x, hyper.hc_count, hyper.hidden_size)\n",
           "        x = capture.widened(x, hyper.hc_count, hyper.hidden_size)\n"
           "        return torch.cat([x[:, :-x.shape[-1] // 4], torch.zeros_like(x[:, -x.shape[-1] // 4:])], dim=-1)\n",
           ("tests/test_qwen38.py::test_a_fork_replays_every_stream_and_equals_no_cache[paper-300]",), server=True),
    Mutant("hyper-one-stream-spec", "the same mutation, caught with the MTP draft on (NEXTN, anchored replay)",
           "tailreplay_sglang/families/hyper_gdn.py",
           "        return capture.widened(x, hyper.hc_count, hyper.hidden_size)\n",
           "        x = capture.widened(x, hyper.hc_count, hyper.hidden_size)\n"
           "        return torch.cat([x[:, :-x.shape[-1] // 4], torch.zeros_like(x[:, -x.shape[-1] // 4:])], dim=-1)\n",
           ("tests/test_qwen38.py::test_a_fork_under_speculative_decoding_replays_and_equals_no_cache[200]",),
           server=True),
    # Issue 67: GLM-5.3-Flash's replay reads every mHC stream of the stored group input
    Mutant("mhc-one-stream", "the replay zeroes the last of GLM-5.3-Flash's 4 mHC streams of a group's input",
           "tailreplay_sglang/families/mhc_kda.py",
           "        return capture.widened(x, model.config.hc_mult, model.config.hidden_size)\n",
           "        x = capture.widened(x, model.config.hc_mult, model.config.hidden_size)\n"
           "        return torch.cat([x[:, :-x.shape[-1] // 4], torch.zeros_like(x[:, -x.shape[-1] // 4:])], dim=-1)\n",
           ("tests/test_glm5.py::test_a_fork_replays_every_stream_and_equals_no_cache[paper-450]",), server=True),
    Mutant("mhc-one-stream-spec", "the same mutation, caught with GLM-5.3-Flash's MTP draft on (NEXTN, anchored "
           "replay)",
           "tailreplay_sglang/families/mhc_kda.py",
           "        return capture.widened(x, model.config.hc_mult, model.config.hidden_size)\n",
           "        x = capture.widened(x, model.config.hc_mult, model.config.hidden_size)\n"
           "        return torch.cat([x[:, :-x.shape[-1] // 4], torch.zeros_like(x[:, -x.shape[-1] // 4:])], dim=-1)\n",
           ("tests/test_glm5.py::test_a_fork_under_speculative_decoding_replays_and_equals_no_cache[450]",),
           server=True),
    Mutant("glm-moe-scaled-twice", "the CPU port's MoE row scales DeepseekV2MoE's routed output again, which the block "
           "already scaled (GLM-5.3-Flash's routed_scaling_factor 2.5)", "cpu_compat/sglang_cpu_compat/moe.py",
           "            and not glm5.routed_scale_in_block(layer)):  # DeepseekV2MoE scales off CUDA itself\n",
           "            and True):\n",
           ("tests/test_glm5.py::test_stock_serves_hfs_greedy_tokens_and_prompt_logprobs",), server=True),
    Mutant("kda-verify-head-decay", "the CPU port's token-by-token KDA step (decode and verify) decays each head's "
           "state by one mean gate (GDN's form) instead of per key channel", "cpu_compat/sglang_cpu_compat/ops/kda.py",
           "    g = kda_gate(a.reshape(T, HV, K), A_log, dt_bias, lower_bound)\n",
           "    g = kda_gate(a.reshape(T, HV, K), A_log, dt_bias, lower_bound).mean(-1, keepdim=True)\n",
           ("tests/test_speculative.py::test_ling_speculative_tokens_are_the_references",), server=True),
)


def copy_of_the_plugin(into: Path) -> None:
    for part in ("tailreplay_sglang", "tests", "cpu_compat"):
        shutil.copytree(ROOT / part, into / part, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for name in ("pyproject.toml", "conftest.py"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, into / name)


def run(mutant: Mutant) -> dict:
    """Apply `mutant` to a fresh copy and run its tests there: killed when they fail."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = Path(tmp)
        copy_of_the_plugin(copy)
        target = copy / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"{mutant.name}: its line occurs {text.count(mutant.old)} times in {mutant.path}")
        target.write_text(text.replace(mutant.old, mutant.new))
        # the CPU port too: its .pth puts the repository's cpu_compat/ on sys.path after PYTHONPATH
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(copy), str(copy / "cpu_compat")))}
        for package in ("tailreplay_sglang", "sglang_cpu_compat"):
            where = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"],
                                   cwd=copy, env=env, capture_output=True, text=True).stdout.strip()
            if not where.startswith(str(copy)):
                raise SystemExit(f"the copy is not what imports: {package} from {where}")
        start = time.perf_counter()
        # the property module's own mutant table (BROKEN) monkeypatches the same code: not a test of this mutant
        marks = "server" if mutant.server else "not server"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marks,
                               "-k", "not catch_broken", *mutant.tests], cwd=copy, env=env, capture_output=True,
                              text=True)
        # 1: a test failed (killed); 0: all passed (survived); anything else (a collection error) is not a verdict
        if done.returncode not in (0, 1):
            raise SystemExit(f"{mutant.name}: pytest exited {done.returncode}\n{done.stdout[-3000:]}")
        return {"name": mutant.name, "what": mutant.what, "tests": list(mutant.tests), "killed": done.returncode == 1,
                "seconds": round(time.perf_counter() - start, 1), "failing": _failing(done.stdout)}


def _failing(stdout: str) -> str:
    return next((line for line in stdout.splitlines() if line.startswith("FAILED")), "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--out", default="runs/mutants.json")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    console, rows = Console(), []
    for mutant in chosen:
        rows.append(run(mutant))
        console.print(f"{mutant.name}: {'killed' if rows[-1]['killed'] else 'SURVIVED'} ({rows[-1]['seconds']} s)")
    table = Table(title="Mutants of the exactness bookkeeping")
    for col in ("mutant", "what", "tests", "result", "s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["what"], ", ".join(Path(t).name for t in r["tests"]),
                      "killed" if r["killed"] else "[red]SURVIVED[/red]", str(r["seconds"]))
    console.print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "mutants": rows}, indent=1))
    survived = [r["name"] for r in rows if not r["killed"]]
    console.print(f"{len(rows) - len(survived)} of {len(rows)} killed" + (f"; survived {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
