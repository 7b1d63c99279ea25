"""Property tests of the Tail-Replay radix cache's bookkeeping, without a server or a GPU: in the paper's mode
(`--tail-replay-exact-budget 0`: no anchor kept or used) and in the anchored mode (states kept in the tree, copied on
a hit, evicted by the mamba LRU; `AnchoredCacheMachine`, whose fingerprinted states check that every kept state is
the exact state of its path and that every hit reported exact starts from the state of its anchor's tokens). Both
run SGLang's no_buffer strategy: extra_buffer's track slots are filled by the model's forward, which this harness
does not drive (it is covered on real servers: tests/test_production_path.py).

How the cache is built
    As SGLang's kv_cache_builder builds it for a hybrid GDN model, at toy sizes, on CPU, page size 1: a
    HybridReqToTokenPool (request rows plus a MambaPool of GDN state slots, shaped as Qwen3-Next's config shapes
    them), a HybridLinearKVPool for the full-attention KV behind a TokenToKVPoolAllocator, and then our factory
    `create_tail_replay_cache(ctx)` with the TreeCacheBuildContext the scheduler hands a registered
    `--radix-cache-backend` (tp_worker and model_config are None: only HiCache, LMCache and external-linker setups
    read them). The config SGLang reads while building and using the cache comes from a RuntimeContext of a dummy
    ServerArgs, active (`use_context`) only while a test runs, so the process-wide config is left alone.

How requests are driven
    Through SGLang's own scheduler-side functions: `Req.init_next_round_input` (the admission match, cow_mamba on as
    the scheduler sets it, inside the scheduler's mamba alloc group), `tree_cache.lock`, `alloc_req_slots` /
    `alloc_token_slots` (which evict under pressure), `checkpoint_kv_cache` after every prefill chunk,
    `release_kv_cache` at the finish (with or without insert) and `release_req` for a decode retraction, after which
    the same request is admitted again. Only the model is missing: the test writes the request's req_to_token row
    itself (what `write_cache_indices` does on CPU) and makes up the sampled tokens. The lower-level API is driven
    directly too: insert, match_prefix, lock/unlock of matched nodes, evict, and a flush (reset plus pool clears, as
    `Scheduler.flush_cache` does when idle).

What is checked, after every step of a hypothesis RuleBasedStateMachine
    - KV: allocator free slots, KV held by tree nodes and KV owned by live requests partition the pool exactly (no
      slot lost, held twice, or both free and in use); a live request's row starts with the path of its locked node.
    - Locks and sizes: each node's lock_ref equals the number of held locks at or below it (so it is never
      negative), evictable + protected == tokens in the tree, protected == the tokens on locked paths; SGLang's own
      `sanity_check` (leaf sets, LRUs, size ledgers) passes.
    - Mamba: no node holds a recurrent state (device or host), the mamba ledgers are zero, and the free mamba slots
      plus the slots of live requests partition the MambaPool exactly, so a finished request's slot is freed.
    - Matching, against a reference of every sequence published since the last flush: a match is exactly the
      longest common prefix with the tree (any token boundary ends a match), it never exceeds the reference and
      equals it while nothing was evicted, every tree path is a prefix of a published sequence. An admitted
      request's hit is capped at input_len - 1 and marked with `tail_replay_match`, and it gets a fresh, cleared
      mamba slot (no copy-on-write source); a live request that re-matches keeps its slot and is not marked.
    At the end of each run every request finishes, every lock drops and everything is evicted: every KV slot,
    request row and mamba slot is free again. The mutation tests at the bottom break the component's bookkeeping
    on purpose and check that these properties catch it.
"""

import dataclasses
import sys
from array import array
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE as FLA_CHUNK_SIZE
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, release_req
from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.runtime_context import create_context, use_context
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

from tailreplay_sglang.cache.anchor_copy import StagedAnchors
from tailreplay_sglang.cache.component import TailReplayMambaComponent, create_tail_replay_cache
from tailreplay_sglang.cache.host_anchors import HostAnchors
from tailreplay_sglang.cache.request import TAINT_ATTR, Match, is_exact, peek, state_of
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.runtime import TailReplayRuntime

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA


def match_of(req):
    """The hit the cache handed to the replay, or None."""
    state = peek(req)
    return None if state is None else state.match

KV_SLOTS = 40  # small, so admissions and decodes evict
REQ_ROWS = MAMBA_SLOTS = 3  # a live request holds one row and one mamba slot
MAX_CONTEXT = 32
LINEAR_LAYERS, FULL_ATTENTION_LAYERS = [0, 1, 2], [3]
VOCAB = 4  # few distinct tokens, so random sequences share prefixes and the tree branches
MAX_SEQUENCE = 10  # direct inserts, queries and prompts
MAX_OUTPUT = 6
MAX_TEST_LOCKS = 3
DEEP = 4  # a fork this deep into a published sequence is past the anchored machines' exact budget (3) from its start

SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None, derandomize=True, database=None,
                    print_blob=False, suppress_health_check=[HealthCheck.too_slow])


PAPERS_MODE = TailReplayConfig(enabled=True, exact_budget=0)
DECODE_MODE = TailReplayConfig(enabled=True, disaggregation_mode="decode")


@pytest.fixture(scope="module")
def sglang_context():
    server_args = ServerArgs(model_path="dummy", page_size=1)
    server_args._mamba_cache_chunk_size = FLA_CHUNK_SIZE  # normally derived from the model's HF config
    return server_args, create_context(server_args, role="scheduler")


def build_cache(server_args, config: TailReplayConfig = PAPERS_MODE, mamba_slots: int = MAMBA_SLOTS,
                factory=create_tail_replay_cache):
    """(tree cache, req-to-token pool, KV allocator) as the scheduler builds them, through our factory, with its
    own runtime as a scheduler process has."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8,
                                    state_size=8, conv_kernel=4, conv_shard_groups=[8, 8, 16])  # GDN: q, k, v
    req_pool = HybridReqToTokenPool(
        size=REQ_ROWS, mamba_size=mamba_slots, mamba_spec_state_size=REQ_ROWS, max_context_len=MAX_CONTEXT,
        device="cpu", enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=LINEAR_LAYERS),
        mamba_layer_ids=LINEAR_LAYERS, enable_mamba_extra_buffer=False)
    kv_pool = HybridLinearKVPool(
        size=KV_SLOTS, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
        full_attention_layer_ids=FULL_ATTENTION_LAYERS, device="cpu", enable_memory_saver=False,
        mamba_pool=req_pool.mamba_pool)
    allocator = TokenToKVPoolAllocator(size=KV_SLOTS, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool,
                                       need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
                             page_size=1)
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
        tp_size=1, tp_rank=0, tp_group=None)
    runtime = TailReplayRuntime(config)
    if config.host_anchors:  # as lifecycle.create_store makes it, once the pools exist
        runtime.host_anchors = HostAnchors(req_pool.mamba_pool, config.host_anchors)
    return factory(runtime, ctx), req_pool, allocator


# ---- reading the tree (custom components select SGLang's Python TreeCore, whose nodes are plain objects) ----

def tree_nodes(cache) -> list:
    """Every node below the root."""
    nodes, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def node_kv(node) -> list[int]:
    value = node.component_data[FULL].value
    return [] if value is None else value.tolist()


def path_tokens(node) -> tuple:
    parts = []
    while node.parent is not None:
        parts.append(tuple(node.key.raw_token_ids()))
        node = node.parent
    return tuple(token for part in reversed(parts) for token in part)


def common_prefix_len(a, b) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def tree_match_len(cache, tokens) -> int:
    """Longest common prefix of `tokens` with any root path: the match when any node with KV may end it."""
    node, matched = cache.root_node, 0
    while matched < len(tokens):
        child = next((c for c in node.children.values() if c.key.raw_token_ids()[0] == tokens[matched]), None)
        if child is None:
            break
        key = child.key.raw_token_ids()
        common = common_prefix_len(key, tokens[matched:])
        matched += common
        if common < len(key):
            break
        node = child
    return matched


def draw_tokens(data, published, min_len: int, max_len: int) -> tuple:
    """A token sequence that often continues or forks a published one, so the tree branches and hits happen."""
    base = data.draw(st.sampled_from(published)) if published and data.draw(st.booleans()) else ()
    keep = data.draw(st.integers(0, min(len(base), max_len)))
    suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=max(0, min_len - keep), max_size=max_len - keep))
    return tuple(base[:keep]) + tuple(suffix)


def new_request(rid: int, prompt) -> Req:
    return Req(rid=f"req-{rid}", origin_input_text="", origin_input_ids=array("q", prompt),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=MAX_OUTPUT))


def tokens_of(req: Req) -> tuple:
    return tuple(req.origin_input_ids) + tuple(req.output_ids)


class TailReplayCacheMachine(RuleBasedStateMachine):
    mamba_slots = MAMBA_SLOTS
    fold = 0  # how far short of the longest common prefix an admitted match may stop (`--tail-replay-fold-tokens`)

    def __init__(self, server_args):
        super().__init__()
        self.cache, self.req_pool, self.allocator = self.build(server_args)
        self.live: list[Req] = []  # admitted, not finished
        self.prefill_len: dict[str, int] = {}  # rid -> tokens its prefill covers (+ outputs once retracted)
        self.retracted: list[Req] = []  # waiting to be admitted again; they hold nothing
        self.test_locks = []  # TreeLocks taken by the test on matched nodes
        self.published: list[tuple] = []  # every sequence inserted into the tree since the last flush
        self.evicted_since_flush = False
        self.next_rid = 0
        self.written_now: list[int] = []

    # ---- what differs between the paper's mode and the anchored one (AnchoredCacheMachine) ----

    def build(self, server_args):
        return build_cache(server_args)

    def check_admitted(self, req, match) -> None:
        assert match is not None and (match.matched, match.anchor) == (req.prefix_len, None), \
            f"hit of {req.prefix_len} not marked"

    def inserted_exact(self, slots) -> None:
        """KV the test inserted itself (exact) was written into `slots`, which may be ones a request freed."""

    def check_slot_after_alloc(self, req) -> None:
        assert req.kv.holds_mamba and req.kv.mamba_needs_clear, "a hit must start from a fresh, cleared slot"
        assert req.kv.mamba_cow_src_index is None, "a hit copied a state out of the tree"

    def forward(self, req, match=None) -> None:
        """The model's part of a forward of `req` (nothing to do in the paper's mode: no state is ever kept)."""

    def overwrite_states(self, slots) -> None:
        """Other requests' forwards write these slots (nothing to model in the paper's mode)."""

    def check_evicted_states(self, result) -> None:
        assert result.mamba_num_evicted == 0, "evicted a mamba state from a tree that holds none"

    def check_tree_states(self) -> None:
        self.check_no_mamba_in_tree()

    def tree_state_slots(self) -> list[int]:
        return []

    # ---- helpers ----

    @property
    def runtime(self) -> TailReplayRuntime:
        return next(c for c in self.cache._components_tuple if isinstance(c, TailReplayMambaComponent)).runtime

    def release_staged(self, admitted) -> None:
        """Scheduler.get_new_batch_prefill returned (lifecycle.release_staged_anchors)."""
        self.runtime.staged_anchors.release(self.cache, self.runtime.host_anchors, admitted)

    def others_take_the_free_slots(self) -> None:
        """What other admissions and the interval-anchor planner may do between a match and the batch taking its
        copy sources (one scheduling step): evict every anchor they can, take the slots, and have their forwards
        write them."""
        self.check_evicted_states(self.cache.evict(EvictParams(num_tokens=0, mamba_num=self.mamba_slots)))
        free = self.req_pool.mamba_allocator.available_size()
        if free:
            slots = self.req_pool.mamba_allocator.alloc(free)
            self.overwrite_states(slots)
            self.req_pool.mamba_allocator.free(slots)

    def can_allocate(self, num_tokens: int) -> bool:
        return num_tokens <= self.allocator.available_size() + self.cache.evictable_size()

    def allocate(self, num_tokens: int):
        """SGLang's alloc_token_slots, which evicts the shortfall first."""
        if num_tokens > self.allocator.available_size():
            self.evicted_since_flush = True
        return alloc_token_slots(self.cache, num_tokens)

    def extend_row(self, req: Req, num_tokens: int) -> None:
        """Allocate KV for the next `num_tokens` positions of the request and commit them (the forward ran)."""
        start = req.kv.kv_committed_len
        slots = self.allocate(num_tokens)
        self.req_pool.write((req.kv.req_pool_idx, slice(start, start + num_tokens)), slots)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = start + num_tokens
        self.written_now = slots.tolist()  # the KV the next forward computes

    def end_extend(self, req: Req, sampled: int) -> None:
        """After a prefill chunk's forward: sample once the prefill is done, then checkpoint, as the scheduler does."""
        published = tokens_of(req)[:req.extend_end]
        if req.extend_end == self.prefill_len[req.rid]:
            req.output_ids.append(sampled)
        checkpoint_kv_cache(req, self.cache)
        self.published.append(published)

    def held_locks(self) -> list:
        return self.test_locks + [req.lock for req in self.live]

    def check_hit(self, tokens, hit_len: int, last_node, limit: int, fold: int = 0) -> None:
        """The match is the longest common prefix with the tree, or (an admission under folding) at most `fold`
        tokens short of it."""
        tree_len = min(tree_match_len(self.cache, tokens), limit)
        assert tree_len - fold <= hit_len <= tree_len, \
            f"match {hit_len} != longest common prefix with the tree {tree_len}"
        reference = min(max((common_prefix_len(tokens, s) for s in self.published), default=0), limit)
        assert hit_len <= reference, f"match {hit_len} beyond everything published ({reference})"
        if not self.evicted_since_flush:
            assert reference - fold <= hit_len, f"match {hit_len} != reference {reference} with nothing evicted"
        node = self.cache.tree_core.node_by_id(last_node)
        assert path_tokens(node) == tuple(tokens[:hit_len]), "match ends on a node whose path is not the hit"

    def match(self, tokens, **kwargs):
        result = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), **kwargs))
        self.check_hit(tokens, result.device_prefix_len, result.last_device_node, limit=len(tokens))
        assert result.mamba_branching_seqlen is None, "a node without state asked for a branching checkpoint"
        return result

    def finish(self, req: Req, insert: bool) -> None:
        """The scheduler's finish: release_kv_cache, checkpointing into the tree unless the finish is discarded."""
        self.live.remove(req)
        owned_tokens = tokens_of(req)[:req.owned_kv_len()]
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids)) if insert else FINISH_ABORT()
        release_kv_cache(req, self.cache, checkpoint=insert)
        if insert:
            self.published.append(owned_tokens)
        self.check_released(req)

    def check_released(self, req) -> None:
        assert not req.kv.holds_kv and not req.kv.holds_mamba, "a finished request still holds a row or a mamba slot"

    # ---- low-level API ----

    @rule(data=st.data())
    def insert_sequence(self, data):
        """Insert KV the test allocated, without a request (so without any mamba value)."""
        tokens = draw_tokens(data, self.published, 1, MAX_SEQUENCE)
        if not self.can_allocate(len(tokens)):
            return
        values = self.allocate(len(tokens))
        self.inserted_exact(values)
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=values))
        self.published.append(tokens)

    @rule(data=st.data())
    def match_sequence(self, data):
        self.match(draw_tokens(data, self.published, 0, MAX_SEQUENCE))

    @precondition(lambda self: len(self.test_locks) < MAX_TEST_LOCKS)
    @rule(data=st.data())
    def lock_match(self, data):
        result = self.match(draw_tokens(data, self.published, 1, MAX_SEQUENCE))
        self.test_locks.append(self.cache.lock(result.last_device_node))

    @precondition(lambda self: self.test_locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.cache.unlock(self.test_locks.pop(data.draw(st.integers(0, len(self.test_locks) - 1))))

    @rule(num_tokens=st.integers(0, KV_SLOTS), mamba_states=st.integers(0, 2))
    def evict(self, num_tokens, mamba_states):
        evictable, available = self.cache.evictable_size(), self.allocator.available_size()
        result = self.cache.evict(EvictParams(num_tokens=num_tokens, mamba_num=mamba_states))
        evicted = result.num_tokens_evicted
        assert min(num_tokens, evictable) <= evicted <= evictable, (num_tokens, evictable, evicted)
        assert self.allocator.available_size() == available + evicted, "evicted KV not back in the allocator"
        self.check_evicted_states(result)
        self.evicted_since_flush |= evicted > 0

    @precondition(lambda self: not self.live)
    @rule()
    def flush(self):
        """Scheduler.flush_cache, which only runs when idle (so first drop the test's locks; retracted requests
        hold nothing)."""
        for lock in self.test_locks:
            self.cache.unlock(lock)
        self.test_locks.clear()
        # Checked before the clears below, which would hide a leak.
        assert self.req_pool.mamba_allocator.available_size() == self.mamba_slots - len(self.tree_state_slots()), \
            "idle, yet mamba slots are held"
        assert self.cache.protected_size() == 0
        self.cache.reset()
        self.req_pool.clear()
        self.allocator.clear()
        self.req_pool.reset_aux_cache_allocator()
        self.published.clear()
        self.evicted_since_flush = False
        assert not tree_nodes(self.cache) and self.cache.evictable_size() == 0

    # ---- requests through the scheduler's functions ----

    def next_admission(self, data) -> Req:
        """A retracted request coming back, or a new one."""
        if self.retracted and data.draw(st.booleans()):
            return self.retracted.pop(data.draw(st.integers(0, len(self.retracted) - 1)))
        self.next_rid += 1
        return new_request(self.next_rid, draw_tokens(data, self.published, 2, MAX_SEQUENCE))

    @precondition(lambda self: len(self.live) < REQ_ROWS)
    @rule(data=st.data())
    def admit_request(self, data):
        self.admit(data, self.next_admission(data))

    @precondition(lambda self: len(self.live) < REQ_ROWS and any(len(s) > DEEP for s in self.published))
    @rule(data=st.data())
    def admit_deep_fork(self, data):
        """A new request forking a published sequence more than DEEP tokens in: past the exact budget of any state
        kept at its start, through whatever KV that sequence's request left (approximate hits, tainted paths)."""
        base = data.draw(st.sampled_from([s for s in self.published if len(s) > DEEP]))
        keep = data.draw(st.integers(DEEP, min(len(base), MAX_SEQUENCE - 1)))
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_SEQUENCE - keep))
        self.next_rid += 1
        self.admit(data, new_request(self.next_rid, tuple(base[:keep]) + tuple(suffix)))

    @precondition(lambda self: len(self.live) < REQ_ROWS and any(len(s) > 1 for s in self.published))
    @rule(data=st.data())
    def admit_fork_near_an_end(self, data):
        """A new request forking a published sequence at most the budget short of its end, where a finished
        request left its state: exact anchored hits, from the host pool where the device pool let the state go."""
        base = data.draw(st.sampled_from([s for s in self.published if len(s) > 1]))
        keep = data.draw(st.integers(max(1, len(base) - DEEP + 1), min(len(base), MAX_SEQUENCE - 1)))
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_SEQUENCE - keep))
        self.next_rid += 1
        self.admit(data, new_request(self.next_rid, tuple(base[:keep]) + tuple(suffix)))

    def admit(self, data, req) -> None:
        tokens = tokens_of(req)
        # Scheduler.get_new_batch_prefill: mamba slots pre-allocated for matches that copy a state (ours copies
        # none, so they all go back), the match itself (cow_mamba on, key capped at input_len - 1).
        self.req_pool.mamba_allocator.alloc_group_begin(1 + len(self.retracted))
        req.init_next_round_input(self.cache)
        self.req_pool.mamba_allocator.alloc_group_end()
        self.check_hit(tokens, req.prefix_len, req.last_node, limit=len(tokens) - 1, fold=self.fold)
        match = match_of(req)
        self.check_admitted(req, match)
        chunk = data.draw(st.integers(1, len(tokens) - req.prefix_len))
        req.lock = self.cache.lock(req.last_node)  # PrefillAdder._commit_prefill_admission
        if data.draw(st.sampled_from([False, False, False, True])):
            self.others_take_the_free_slots()
        if not self.can_allocate(chunk):
            self.cache.unlock(req.lock)  # not admitted: the scheduler leaves it waiting
            req.lock = None
            if req.kv.holds_mamba:  # Scheduler: a slot the match took for a request not added is freed
                self.req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            req.kv.mamba_cow_src_index, req.kv.mamba_needs_clear = None, False
            self.release_staged(admitted=())
            if req.is_retracted:
                self.retracted.append(req)
            return
        req.extend_end = req.prefix_len + chunk
        prefix = self.cache.prefix_device_indices(req)  # alloc_for_extend reads the prefix before allocating
        alloc_req_slots(self.req_pool, [req], self.cache)
        self.check_slot_after_alloc(req)
        self.req_pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.prefix_len
        self.extend_row(req, chunk)
        self.release_staged(admitted=[req])  # the batch (prepare_for_extend) took its copy source
        self.forward(req, match)
        self.live.append(req)
        self.prefill_len[req.rid] = len(tokens)
        self.end_extend(req, data.draw(st.integers(0, VOCAB - 1)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def run_request(self, data):
        """The next prefill chunk, or up to three decode steps."""
        req = data.draw(st.sampled_from(self.live))
        remaining_prefill = self.prefill_len[req.rid] - req.extend_end
        if remaining_prefill > 0:
            chunk = data.draw(st.integers(1, remaining_prefill))
            if not self.can_allocate(chunk):
                return
            req.init_next_round_input()  # a continuing chunk refreshes its fill ids; no re-match
            self.extend_row(req, chunk)
            self.forward(req)
            req.extend_end += chunk
            self.end_extend(req, data.draw(st.integers(0, VOCAB - 1)))
            return
        for _ in range(data.draw(st.integers(1, 3))):
            if len(req.output_ids) >= MAX_OUTPUT or not self.can_allocate(1):
                break
            self.extend_row(req, 1)  # the KV of the last sampled token
            self.forward(req)
            req.output_ids.append(data.draw(st.integers(0, VOCAB - 1)))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), insert=st.booleans())
    def finish_request(self, data, insert):
        self.finish(data.draw(st.sampled_from(self.live)), insert)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def retract_request(self, data):
        """Decode retraction (out of KV): SGLang's release_req frees everything and re-queues the request."""
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        release_req(req=req, remaing_req_count=0, req_to_token_pool=self.req_pool,
                    token_to_kv_pool_allocator=self.allocator, tree_cache=self.cache, hisparse_coordinator=None)
        assert not req.kv.holds_kv and not req.kv.holds_mamba, "a retracted request still holds a row or a slot"
        self.retracted.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def rematch_live_request(self, data):
        """A request that already holds a slot matches again (e.g. a checkpoint re-match): it keeps its live state."""
        req = data.draw(st.sampled_from(self.live))
        slot, free_slots = int(req.kv.mamba_pool_idx), self.req_pool.mamba_allocator.available_size()
        state_of(req).match = None
        self.match(tokens_of(req)[:req.kv.kv_committed_len], req=req, cow_mamba=True)
        assert match_of(req) is None, "a match set on a request that holds its state"
        assert int(req.kv.mamba_pool_idx) == slot and req.kv.mamba_cow_src_index is None, "live state replaced"
        assert self.req_pool.mamba_allocator.available_size() == free_slots, "a re-match took a mamba slot"

    # ---- invariants ----

    @invariant()
    def bookkeeping_balances(self):
        self.check_kv_partition()
        self.check_locks_and_sizes()
        self.check_tree_states()
        self.check_mamba_slots()
        self.check_tree_against_reference()
        self.check_no_holds()
        self.cache.sanity_check()  # SGLang's own: leaf sets, LRUs, size ledgers

    def check_no_holds(self):
        """Every rule is whole scheduling steps, and what a step holds ends within it (anchor_copy): between rules
        no anchor is staged and no host anchor pinned (a leak would silt up the host pool: pool_report counts them
        on servers)."""
        assert len(self.runtime.staged_anchors) == 0, "an anchor is still staged after its scheduling step"
        host = self.runtime.host_anchors
        assert host is None or host.pins == 0, f"host anchors still pinned after their scheduling step: {host._pinned}"

    def check_kv_partition(self):
        free = self.allocator.free_pages.tolist() + self.allocator.release_pages.tolist()
        in_tree = [index for node in tree_nodes(self.cache) for index in node_kv(node)]
        owned = []
        for req in self.live:
            row = self.req_pool.req_to_token[req.kv.req_pool_idx]
            protected = req.kv.cache_protected_len
            path = self.cache.path_device_indices(req.lock.node).tolist()
            assert row[:protected].tolist() == path, f"{req.rid}: row prefix is not its locked path"
            owned += row[protected:req.kv.kv_allocated_len].tolist()
        counts = Counter(free + in_tree + owned)
        held_twice = sorted(index for index, count in counts.items() if count > 1)
        lost = sorted(set(range(1, KV_SLOTS + 1)) - set(counts))
        assert not held_twice and not lost and len(counts) == KV_SLOTS, f"KV slots held twice {held_twice}, lost {lost}"

    def check_locks_and_sizes(self):
        nodes = tree_nodes(self.cache)
        assert self.cache.evictable_size() + self.cache.protected_size() == sum(len(node_kv(n)) for n in nodes)
        full_refs, mamba_refs = Counter(), Counter()
        for lock in self.held_locks():
            node = self.cache.tree_core.node_by_id(lock.node)
            if node.parent is not None and MAMBA not in lock.receipt.skipped_lock_components:
                mamba_refs[node.id] += 1  # MAMBA locks only the node itself
            while node.parent is not None:  # FULL locks the whole path
                full_refs[node.id] += 1
                node = node.parent
        for node in nodes:
            assert node.component_data[FULL].lock_ref == full_refs[node.id], f"node {node.id}: FULL lock_ref"
            assert node.component_data[MAMBA].lock_ref == mamba_refs[node.id], f"node {node.id}: MAMBA lock_ref"
        on_locked_paths = set()
        for lock in self.held_locks():
            on_locked_paths.update(self.cache.path_device_indices(lock.node).tolist())
        assert self.cache.protected_size() == len(on_locked_paths), "protected != tokens on locked paths"

    def check_no_mamba_in_tree(self):
        for node in tree_nodes(self.cache):
            state = node.component_data[MAMBA]
            assert state.value is None and state.host_value is None, f"node {node.id} holds a recurrent state"
        assert self.cache.mamba_evictable_size() == 0 and self.cache.mamba_protected_size() == 0
        assert self.cache.all_mamba_values_flatten().numel() == 0

    def check_mamba_slots(self):
        assert all(req.kv.holds_mamba for req in self.live), "a live request lost its mamba slot"
        held = [int(req.kv.mamba_pool_idx) for req in self.live]
        counts = Counter(self.req_pool.mamba_allocator.free_slots.tolist() + held + self.tree_state_slots())
        assert counts == Counter(range(1, self.mamba_slots + 1)), f"mamba slots: free + live + tree != pool: {counts}"
        assert self.req_pool.available_size() == REQ_ROWS - len(self.live), "request rows leaked"

    def check_tree_against_reference(self):
        for leaf in (node for node in tree_nodes(self.cache) if not node.children):
            path = path_tokens(leaf)
            assert any(seq[:len(path)] == path for seq in self.published), f"tree path {path} was never published"
        if not self.evicted_since_flush:
            for seq in self.published:
                assert tree_match_len(self.cache, seq) == len(seq), f"{seq} lost with nothing evicted"

    def teardown(self):
        """Drain: finish every request, drop every lock, evict everything; all slots must be free again."""
        if sys.exc_info()[0] is not None:
            return  # called from hypothesis' `finally`: a step failed or was cut short; keep its error on top
        for req in list(self.live):
            self.finish(req, insert=True)
        for lock in self.test_locks:
            self.cache.unlock(lock)
        self.test_locks.clear()
        self.bookkeeping_balances()
        self.cache.evict(EvictParams(num_tokens=KV_SLOTS))
        assert not tree_nodes(self.cache), "nodes survived evicting everything with nothing locked"
        assert self.cache.evictable_size() == self.cache.protected_size() == 0
        assert self.allocator.available_size() == KV_SLOTS, "KV slots leaked"
        assert self.req_pool.available_size() == REQ_ROWS, "request rows leaked"
        assert self.req_pool.mamba_allocator.available_size() == self.mamba_slots, "mamba slots leaked"


# ---- the anchored default mode: states kept in the tree, copied on a hit, evicted by the mamba LRU ----

# Scaled to these sequences (up to 16 tokens): exact within 3 tokens of an anchor, else a 2-token zero-init tail.
# Every span is replayed (fold_tokens=0), so that a match is the longest common prefix with the tree; folding is
# checked on its own below.
ANCHORED_MODE = TailReplayConfig(enabled=True, exact_budget=3, anchor_interval=0, min_tokens=2, max_tokens=2,
                                 fold_tokens=0)
# The same figures written out for the checks, which must not ask the code under test (TailReplayConfig) for them.
BUDGET, TAIL = 3, 2
TAINT = -1.0  # the fingerprint of an approximate state (a zero-init tail)
STALE = -2.0  # no sequence's fingerprint: what another request's forward left in a slot


class AnchoredCacheMachine(TailReplayCacheMachine):
    """The same operations in the anchored mode, with the test standing in for the model: every mamba slot's SSM
    state carries a fingerprint, the id of the token sequence it is the exact state of (TAINT for the zero-init
    tail's approximate state). A forward of a request first does what SGLang and the replay do (a slot marked for
    clearing is zeroed: the state of no tokens), then checks the replay's start: a hit reported exact must start
    from the exact state of its anchor's tokens. It leaves the state of everything the request has KV for, or
    TAINT. The KV is tracked too: the slots an approximate request's forwards wrote are approximate until freed, and
    a request labelled exact must never read one (a hit through them, or its own row re-pointed at them when SGLang
    de-duplicates its insert). Invariants: every state in the tree is the exact state of its node's path (never
    TAINT, never another path's), and free, live and tree-held slots partition the mamba pool."""

    mamba_slots = 8  # 3 live requests and their anchors
    reached: Counter = Counter()  # what the run's examples reached (hits, approximate ones, ...): its test reads it

    def __init__(self, server_args):
        super().__init__(server_args)
        self.sequence_ids: dict[tuple, float] = {}
        self.approximate_kv: set[int] = set()  # KV slots an approximate request computed, until freed

    def build(self, server_args):
        return build_cache(server_args, ANCHORED_MODE, self.mamba_slots)

    def fingerprint_of(self, tokens) -> float:
        return self.sequence_ids.setdefault(tuple(tokens), float(len(self.sequence_ids)))

    def state(self, slot) -> float:
        return float(self.req_pool.mamba_pool.mamba_cache.temporal[0, int(slot)].view(-1)[0])

    def set_state(self, slot, value: float) -> None:
        self.req_pool.mamba_pool.mamba_cache.temporal[:, int(slot)] = value

    def check_admitted(self, req, match) -> None:
        m = req.prefix_len
        assert match is not None and match.matched == m, f"hit of {m} not marked"
        # Whatever the state it starts from, a hit whose KV an approximate request computed (the taint) is approximate
        tainted = bool(set(self.cache.prefix_device_indices(req).tolist()) & self.approximate_kv)
        if match.anchor is not None:  # an anchor (or the root's zero state) within the budget
            assert m - match.anchor <= BUDGET, "anchored hit past the budget"
            assert match.exact != tainted, f"anchored hit labelled exact={match.exact}, its KV tainted={tainted}"
        else:  # the zero-init tail: exact only where it covers the whole prefix
            assert match.exact == (m <= TAIL and not tainted), "zero-init tail labelled wrongly"

    def inserted_exact(self, slots) -> None:
        self.approximate_kv.difference_update(slots.tolist())  # reused slots: an approximate request's KV is gone

    def check_slot_after_alloc(self, req) -> None:
        assert req.kv.holds_mamba, "a hit has no slot of its own"

    def overwrite_states(self, slots) -> None:
        for slot in slots.tolist():
            self.set_state(slot, STALE)

    def forward(self, req, match=None) -> None:
        slot = req.kv.mamba_pool_idx
        if req.kv.mamba_cow_src_index is not None:  # SGLang's deferred copy-on-write, in the forward
            self.set_state(slot, self.state(req.kv.mamba_cow_src_index[0]))
            req.kv.mamba_cow_src_index = None
        elif req.kv.mamba_needs_clear:  # SGLang zeroes the slot on the forward stream
            self.set_state(slot, self.fingerprint_of(()))
        req.kv.mamba_needs_clear = False
        self.runtime.staged_anchors.restore_host(self.runtime.host_anchors, self.req_pool)  # replay_after_clear
        if match is not None and match.exact:  # the replay starts from the anchor's state, or from zero
            start = tokens_of(req)[:match.anchor or 0]
            assert self.state(slot) == self.fingerprint_of(start), \
                f"{req.rid}: reported exact, but its slot is not the state of its first {len(start)} tokens"
        exact = is_exact(req)
        self.approximate_kv.difference_update(self.written_now)  # freshly allocated: written now
        if match is not None and req.prefix_len:
            prefix = set(self.req_pool.req_to_token[req.kv.req_pool_idx, :req.prefix_len].tolist())
            type(self).reached.update(["hits"] + ["approximate hits"] * (not exact)
                                      + ["hits through tainted KV"] * bool(prefix & self.approximate_kv))
        if exact:
            read = set(self.req_pool.req_to_token[req.kv.req_pool_idx, :req.kv.kv_committed_len].tolist())
            assert not read & self.approximate_kv, \
                f"{req.rid}: labelled exact, but reads KV an approximate request computed"
        else:
            self.approximate_kv.update(self.written_now)
        self.set_state(slot, self.fingerprint_of(tokens_of(req)[:req.kv.kv_committed_len]) if exact else TAINT)

    def check_evicted_states(self, result) -> None:
        pass  # anchors go to the mamba LRU; their KV stays (checked by the partitions)

    def check_released(self, req) -> None:
        # A finished request donates its slot to the tree node at its end; SGLang leaves the index on the request.
        assert not req.kv.holds_kv, "a finished request still holds a row"
        assert not req.kv.holds_mamba or int(req.kv.mamba_pool_idx) in self.tree_state_slots(), \
            "a finished request still holds a mamba slot the tree does not own"

    def tree_state_slots(self) -> list[int]:
        return [int(node.component_data[MAMBA].value[0]) for node in tree_nodes(self.cache)
                if node.component_data[MAMBA].value is not None]

    def check_tree_states(self) -> None:
        for node in tree_nodes(self.cache):
            value = node.component_data[MAMBA].value
            if value is not None:
                state = self.state(value[0])
                assert state != TAINT, f"node {node.id} keeps an approximate state"
                assert state == self.fingerprint_of(path_tokens(node)), \
                    f"node {node.id} keeps a state that is not the exact state of its path"


HOST_ANCHORED_MODE = dataclasses.replace(ANCHORED_MODE, host_anchors=2)


class HostAnchoredCacheMachine(AnchoredCacheMachine):
    """The anchored mode with host anchors: anchors the 8-slot device pool evicts move to a 2-state host pool (so it
    drops states too) and hits copy them back. Also checked: every host state
    is the exact state of its node's path and its node is still in the tree, and host slots are free or held, never
    both. `restored` counts host hits over every run, so the test knows the path ran."""

    restored = 0

    def build(self, server_args):
        return build_cache(server_args, HOST_ANCHORED_MODE, self.mamba_slots)

    @property
    def host(self) -> HostAnchors:
        return self.runtime.host_anchors

    def check_tree_states(self) -> None:
        super().check_tree_states()
        host = self.host
        host.follow_tree(self.cache.root_node)
        live = set(tree_nodes(self.cache))
        held = list(host._slots.values())
        assert sorted(held + host._free) == list(range(host.capacity)), "host slots lost or held twice"
        for node, slot in host._slots.items():
            assert node in live, f"the host pool keeps the state of deleted node {node.id}"
            assert float(host.temporal[slot, 0].view(-1)[0]) == self.fingerprint_of(path_tokens(node)), \
                f"node {node.id}: its host state is not the exact state of its path"

    def teardown(self):
        if sys.exc_info()[0] is None:
            HostAnchoredCacheMachine.restored += self.host.restored
        super().teardown()
        if sys.exc_info()[0] is None:
            assert len(self.host) == 0, "host states outlived their nodes"


def run_machine(sglang_context, machine_settings, machine=TailReplayCacheMachine) -> None:
    server_args, context = sglang_context
    with use_context(context):
        run_state_machine_as_test(lambda: machine(server_args), settings=machine_settings)


def test_cache_bookkeeping_holds_under_random_operations(sglang_context):
    run_machine(sglang_context, SETTINGS)


class KeepEndsCacheMachine(AnchoredCacheMachine):
    """The anchored mode evicting mid-path anchors before branch points and ends (`--tail-replay-anchor-keep ends`).
    Also checked, at every victim the mamba LRU picks: where an unlocked anchor with exactly one child exists, the
    victim is one such (never a branch point or a path's end)."""

    def build(self, server_args):
        built = build_cache(server_args, dataclasses.replace(ANCHORED_MODE, anchor_keep="ends"), self.mamba_slots)
        cache = built[0]
        component = next(c for c in cache._components_tuple if isinstance(c, TailReplayMambaComponent))
        pick = component._next_victim
        component._next_victim = lambda lru: self.check_victim(cache, pick(lru))
        return built

    def check_victim(self, cache, victim):
        unlocked = [node for node in tree_nodes(cache) if node.component_data[MAMBA].value is not None
                    and node.component_data[MAMBA].lock_ref == 0]
        if victim is not None and any(len(node.children) == 1 for node in unlocked):
            assert len(victim.children) == 1, \
                f"evicted the anchor of node {victim.id} ({len(victim.children)} children) before a mid-path one"
        return victim


class FoldingCacheMachine(AnchoredCacheMachine):
    """The anchored mode with folding: an exact hit at most `fold` tokens past its anchor stops at the anchor, whose
    state its slot holds (the forward's check), and the extend computes the rest. 2 is the default's scale here (64
    against 512-token interval anchors); `DefaultFoldCacheMachine` runs the default itself, which folds every
    anchored hit at this scale."""

    fold = 2

    def build(self, server_args):
        return build_cache(server_args, dataclasses.replace(ANCHORED_MODE, fold_tokens=self.fold), self.mamba_slots)

    def check_admitted(self, req, match) -> None:
        super().check_admitted(req, match)
        if match.anchor is not None and match.matched - match.anchor <= self.fold:
            assert match.matched == match.anchor, "an anchored hit within the fold was not cut back to its anchor"
        if match.anchor is not None and match.matched == match.anchor and match.matched:
            type(self).reached["hits at their anchor"] += 1  # folded, or the match ended on an anchor


class DefaultFoldCacheMachine(FoldingCacheMachine):
    fold = TailReplayConfig.fold_tokens


@pytest.mark.parametrize("machine", [AnchoredCacheMachine, KeepEndsCacheMachine, FoldingCacheMachine,
                                     DefaultFoldCacheMachine], ids=["lru", "keep ends", "fold 2", "default fold"])
def test_anchored_states_are_exact_for_their_path_and_exact_claims_start_from_them(sglang_context, machine):
    """The machine must reach what its invariants judge: approximate hits (past the budget) and hits through KV an
    approximate request computed (the taint), each several times at CI's settings; printed with `-s`."""
    machine.reached = Counter()
    run_machine(sglang_context, SETTINGS, machine)
    print(machine.__name__, dict(machine.reached))
    for what, at_least in REACHED.items():
        assert machine.reached[what] >= at_least, (what, dict(machine.reached))


def test_host_anchors_are_exact_for_their_path_and_hits_restore_them(sglang_context):
    HostAnchoredCacheMachine.restored = 0
    run_machine(sglang_context, SETTINGS, HostAnchoredCacheMachine)
    assert HostAnchoredCacheMachine.restored > 0, "no hit started from a host anchor: the path was not exercised"


# at SETTINGS, derandomized (measured per machine: docs in tests/README.md); a strategy change that stops reaching
# them fails the test rather than silently judging nothing
REACHED = {"hits": 20, "approximate hits": 5, "hits through tainted KV": 2}


# ---- KV an approximate request computed (spelled out as well: the exact trees, whatever the strategies reach) ----

def test_a_hit_through_kv_an_approximate_request_inserted_is_not_exact(sglang_context):
    """The race of a client retry with its original: an approximate request inserts the tokens it computed, an exact
    one computing the same tokens is de-duplicated onto them and leaves its (exact) state below. A hit within the
    budget of that state reads the approximate KV and hiddens: it must not be reported exact. Without the taint the
    same hit is exact (the control)."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        for approximate in (False, True):
            cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
            params = InsertParams(key=RadixKey(array("q", prompt[:6])), value=allocator.alloc(6))
            setattr(params, TAINT_ATTR, approximate)  # what prepare_for_caching_req sets for such a request
            cache.insert(params)

            def path_kv(length):
                end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:length])))).last_device_node
                return cache.path_device_indices(end)

            cache.insert(InsertParams(key=RadixKey(array("q", prompt)), prev_prefix_len=6,
                                      value=torch.cat([path_kv(6), allocator.alloc(4)])))
            state = req_pool.mamba_allocator.alloc(1)  # the exact request's state at depth 8, on the same KV
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:8])), value=path_kv(8), mamba_value=state,
                                      prev_prefix_len=8, inserted_len=8))
            req = new_request(1, prompt + (2,))
            req.init_next_round_input(cache)
            match = match_of(req)
            assert (match.matched, match.anchor) == (10, 8)  # within the budget of the state at depth 8
            assert match.exact is not approximate, "a hit reading an approximate request's KV reported exact"
            req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))


def test_both_halves_of_a_split_tainted_node_stay_tainted(sglang_context):
    """An approximate request's KV [0, 10) is one tainted node; an exact state kept at depth 8 splits it there. A hit
    of 8 tokens then ends on the upper half, starts from that state and still reads approximate KV: not exact."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
        params = InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(10))
        setattr(params, TAINT_ATTR, True)
        cache.insert(params)
        end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:8])))).last_device_node
        cache.insert(InsertParams(key=RadixKey(array("q", prompt[:8])), value=cache.path_device_indices(end),
                                  mamba_value=req_pool.mamba_allocator.alloc(1), prev_prefix_len=8, inserted_len=8))
        req = new_request(1, prompt[:8] + (3, 3))
        req.init_next_round_input(cache)
        match = match_of(req)
        assert (match.matched, match.anchor) == (8, 8)
        assert not match.exact, "a hit reading an approximate request's KV reported exact"


def test_a_hit_past_the_exact_budget_takes_the_zero_init_tail(sglang_context):
    """Budget 3: a hit 2 tokens past its anchor starts from it (exact); 4 tokens past it, from the 2-token zero-init
    tail (approximate)."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        for anchor_depth, expected in ((8, Match(10, 8, exact=True)), (6, Match(10, None, exact=False))):
            cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
            cache.insert(InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(10)))
            end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:anchor_depth]))))
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:anchor_depth])),
                                      value=cache.path_device_indices(end.last_device_node),
                                      mamba_value=req_pool.mamba_allocator.alloc(1), prev_prefix_len=anchor_depth,
                                      inserted_len=anchor_depth))
            req = new_request(1, prompt + (2,))
            req.init_next_round_input(cache)
            assert match_of(req) == expected, f"anchor {anchor_depth}: {match_of(req)} is not within the budget rule"


def test_a_request_that_emitted_output_from_an_approximate_state_stays_approximate_when_readmitted(sglang_context):
    """Review F2 and F6: SGLang re-admits a retracted request by matching its prompt and the output it emitted, after
    its decoded tokens' KV was dropped and the tree evicted. Here the path is gone, so the re-admission is a miss
    (exact); the output already sent came from the zero-init tail's approximate state, so the request stays
    approximate, and the first admission's replay figures do not survive a re-admission that replays nothing."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
        cache.insert(InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(10)))
        req = new_request(1, prompt + (2,))
        req.init_next_round_input(cache)
        assert match_of(req) == Match(10, None, exact=False) and not peek(req).exact  # no anchor: zero-init tail
        state = peek(req)
        state.anchor, state.tokens, state.ms, state.state_survival = None, 4, 1.5, 0.9  # what its replay reported
        req.output_ids.extend([3, 3])  # decoded from that state, then retracted (SGLang keeps output_ids)
        cache.evict(EvictParams(num_tokens=10))
        assert cache.evictable_size() == 0
        req.init_next_round_input(cache)
        assert match_of(req) == Match(0, 0, exact=True)  # the re-admission's own match: a miss, exact
        assert not peek(req).exact, "output decoded from an approximate state relabelled exact"
        assert (state.tokens, state.ms, state.anchor, state.state_survival) == (0, 0.0, None, None)
        fresh = new_request(2, prompt + (3,))  # a new request with no output takes its match's label
        fresh.init_next_round_input(cache)
        assert peek(fresh).exact


def test_a_load_back_that_brings_fewer_tokens_replans_the_hit_from_an_anchor_within_them(sglang_context):
    """Issue 65 class 6 (`replan_after_load`): the match planned a hit of 10 from the anchor at 8; the HiCache load-back
    brought only the tokens up to 4 (SGLang loads all or none, and skips loads under its threshold), so the request
    is planned again for those 4, in the slot it already holds: from the anchor at 4 (exact, its state the request's
    copy source), and the anchor at 8, no longer needed, is let go."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
        cache.insert(InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(10)))
        anchors = {}
        for depth in (4, 8):
            end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:depth]))))
            anchors[depth] = req_pool.mamba_allocator.alloc(1)
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:depth])),
                                      value=cache.path_device_indices(end.last_device_node),
                                      mamba_value=anchors[depth], prev_prefix_len=depth, inserted_len=depth))
        req = new_request(1, prompt + (2,))
        req.init_next_round_input(cache)
        assert match_of(req) == Match(10, 8, exact=True)
        assert int(req.kv.mamba_cow_src_index) == int(anchors[8])
        node_at_4 = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:4])))).last_device_node
        held = cache.protected_size()
        cache.components[MAMBA].replan_after_load(req, node_at_4, 4)
        assert match_of(req) == Match(4, 4, exact=True) and peek(req).exact
        assert int(req.kv.mamba_cow_src_index) == int(anchors[4])
        assert cache.protected_size() < held  # the anchor at 8's lock went with the old plan
        cache.components[MAMBA].replan_after_load(req, node_at_4, 4)  # the plan already matches: unchanged
        assert match_of(req) == Match(4, 4, exact=True)


def test_a_decode_server_match_stops_above_a_tainted_ancestor_of_an_exact_path(sglang_context):
    """Issue 65 class 1 (PD decode side, `cache/decode_component.py`): an approximate request left tainted KV (A); an
    exact request then extended that path, its own KV inserted below A untainted (B). A later match through A into B
    must stop above A: B is exact KV, but only as a continuation of A's approximate KV, and D would otherwise reuse
    it under P's exact label."""
    from tailreplay_sglang.cache.decode_component import create_decode_cache

    server_args, context = sglang_context
    tainted, extended = (0, 1, 2, 3, 0, 1), (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        cache, req_pool, allocator = build_cache(server_args, DECODE_MODE, factory=create_decode_cache)
        approximate = InsertParams(key=RadixKey(array("q", tainted)), value=allocator.alloc(len(tainted)))
        setattr(approximate, TAINT_ATTR, True)
        cache.insert(approximate)
        end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tainted))))
        assert end.device_prefix_len == 0  # the tainted node itself is no match end
        rest = allocator.alloc(len(extended) - len(tainted))  # the exact request's KV past A (A's de-duplicated)
        cache.insert(InsertParams(key=RadixKey(array("q", extended)), value=torch.cat([approximate.value, rest])))
        taints = sorted((len(path_tokens(n)), bool(getattr(n, TAINT_ATTR, False))) for n in tree_nodes(cache))
        assert taints == [(len(tainted), True), (len(extended), False)]  # A tainted, B below it exact
        hit = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", extended + (2,)))))
        assert hit.device_prefix_len == 0, "a match reused KV below a tainted ancestor"


def test_a_hit_within_the_fold_of_its_anchor_matches_up_to_the_anchor_with_its_state(sglang_context):
    """--tail-replay-fold-tokens: a hit 2 tokens past its anchor (fold 3) is cut back to the anchor, whose state
    the request's own slot holds, and nothing is left to replay; 5 tokens past it (budget 5), it is replayed."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    config = dataclasses.replace(ANCHORED_MODE, exact_budget=5, fold_tokens=3)
    with use_context(context):
        for anchor_depth, expected in ((8, Match(8, 8, exact=True)), (5, Match(10, 5, exact=True))):
            cache, req_pool, allocator = build_cache(server_args, config, 8)
            cache.insert(InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(10)))
            end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:anchor_depth]))))
            state = req_pool.mamba_allocator.alloc(1)
            req_pool.mamba_pool.mamba_cache.temporal[:, int(state)] = 42.0
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:anchor_depth])), mamba_value=state,
                                      value=cache.path_device_indices(end.last_device_node),
                                      prev_prefix_len=anchor_depth, inserted_len=anchor_depth))
            req = new_request(1, prompt + (2,))
            req.init_next_round_input(cache)
            assert match_of(req) == expected and req.prefix_len == expected.matched
            assert path_tokens(cache.tree_core.node_by_id(req.last_node)) == prompt[:expected.matched]
            run_sglangs_copy_on_write(req_pool, [req])
            assert float(req_pool.mamba_pool.mamba_cache.temporal[0, int(req.kv.mamba_pool_idx)].view(-1)[0]) == 42.0


def run_sglangs_copy_on_write(req_pool, reqs) -> None:
    """What SGLang does with the requests' copy-on-write sources and clears: `ScheduleBatch.prepare_for_extend`
    gathers them into the batch, `ModelRunner._maybe_execute_deferred_mamba_cow_and_clear` copies in the forward."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

    batch = SimpleNamespace()
    ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, reqs)
    forward_batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, **vars(batch))
    ModelRunner._maybe_execute_deferred_mamba_cow_and_clear(
        SimpleNamespace(req_to_token_pool=req_pool, is_draft_worker=False), forward_batch)


PATH = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)


def cache_with_path(server_args, prompt, depth: int):
    """A cache (anchored mode, 8 mamba slots) holding `prompt`'s KV, and the match of its first `depth` tokens."""
    cache, req_pool, allocator = build_cache(server_args, ANCHORED_MODE, 8)
    cache.insert(InsertParams(key=RadixKey(array("q", prompt)), value=allocator.alloc(len(prompt))))
    return cache, req_pool, allocator, cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:depth]))))


def test_an_anchor_is_copied_by_the_forward_and_held_until_the_batch_takes_it(sglang_context):
    """The anchor's state reaches the hit's slot in the forward, through SGLang's own deferred copy-on-write, not at
    the match (issue 38 F1). From the match until the scheduler has formed the batch the anchor is locked: evicting
    every state then leaves it, and no slot handed out is its slot; afterwards it is evictable again. A hit the
    scheduler did not admit releases it as well."""
    server_args, context = sglang_context
    prompt = PATH
    with use_context(context):
        cache, req_pool, allocator, end = cache_with_path(server_args, prompt, 8)
        temporal = req_pool.mamba_pool.mamba_cache.temporal

        def keep_anchor():
            state = req_pool.mamba_allocator.alloc(1)
            temporal[:, int(state)] = 42.0
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:8])), mamba_value=state, prev_prefix_len=8,
                                      value=cache.path_device_indices(end.last_device_node), inserted_len=8))
            return state

        staged = next(c for c in cache._components_tuple if isinstance(c, TailReplayMambaComponent)) \
            .runtime.staged_anchors

        def anchor_kept() -> bool:
            node = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:8])))).last_device_node
            return cache.tree_core.node_by_id(node).component_data[MAMBA].value is not None

        for admitted in (True, False):
            state = keep_anchor()
            req = new_request(1, prompt + (2,))
            req.init_next_round_input(cache)
            assert match_of(req) == Match(10, 8, exact=True)
            slot = int(req.kv.mamba_pool_idx)
            assert float(temporal[0, slot].view(-1)[0]) != 42.0, "copied at the match"
            assert req.kv.mamba_cow_src_index.tolist() == state.tolist() and not req.kv.mamba_needs_clear
            cache.evict(EvictParams(num_tokens=0, mamba_num=8))
            free = req_pool.mamba_allocator.alloc(req_pool.mamba_allocator.available_size())
            assert anchor_kept() and int(state) not in free.tolist(), "the anchor was evicted before its copy"
            req_pool.mamba_allocator.free(free)
            if admitted:
                run_sglangs_copy_on_write(req_pool, [req])  # the batch takes the source and the forward copies
                staged.release(cache, None, [req])
                assert float(temporal[0, slot].view(-1)[0]) == 42.0
                req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
            else:  # the scheduler's rejection frees the slot and clears the source; the hook releases
                req_pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(1))
                req.kv.mamba_cow_src_index = None
                staged.release(cache, None, ())
            assert len(staged) == 0
            cache.evict(EvictParams(num_tokens=0, mamba_num=8))
            assert not anchor_kept(), "the anchor stayed locked after the batch was formed"


def test_a_folded_hit_is_judged_by_the_kv_it_still_reuses(sglang_context):
    """Approximate KV below an anchor: a hit 2 tokens past the anchor (fold 3) is cut back to it and reuses only the
    clean KV above it and its state, so it is exact; unfolded (fold 0) it reads the tainted KV and is not."""
    server_args, context = sglang_context
    prompt = (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)
    with use_context(context):
        for fold, expected in ((3, Match(8, 8, exact=True)), (0, Match(10, 8, exact=False))):
            config = dataclasses.replace(ANCHORED_MODE, exact_budget=5, fold_tokens=fold)
            cache, req_pool, allocator = build_cache(server_args, config, 8)
            cache.insert(InsertParams(key=RadixKey(array("q", prompt[:8])), value=allocator.alloc(8),
                                      mamba_value=req_pool.mamba_allocator.alloc(1)))
            end = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:8]))))
            params = InsertParams(key=RadixKey(array("q", prompt)), prev_prefix_len=8,
                                  value=torch.cat([cache.path_device_indices(end.last_device_node),
                                                   allocator.alloc(2)]))
            setattr(params, TAINT_ATTR, True)  # an approximate request computed tokens 8 and 9
            cache.insert(params)
            req = new_request(1, prompt + (2,))
            req.init_next_round_input(cache)
            assert match_of(req) == expected, f"fold {fold}: {match_of(req)}"


@pytest.mark.parametrize("keep,evicted_depth", [("lru", 2), ("ends", 4)])
def test_anchor_keep_policy_picks_the_victim(sglang_context, keep, evicted_depth):
    """States at a branch point (depth 2), a path's end (6) and mid-path (4), least recently used first: one
    eviction takes the least recently used under lru, the mid-path one under ends."""
    server_args, context = sglang_context
    path, fork = (0, 1, 2, 3, 0, 1), (0, 1, 3)
    with use_context(context):
        cache, req_pool, allocator = build_cache(server_args, dataclasses.replace(ANCHORED_MODE, anchor_keep=keep), 8)
        cache.insert(InsertParams(key=RadixKey(array("q", path)), value=allocator.alloc(6)))
        for depth in (2, 4, 6):
            key = RadixKey(array("q", path[:depth]))
            cache.insert(InsertParams(key=key, mamba_value=req_pool.mamba_allocator.alloc(1), prev_prefix_len=depth,
                                      inserted_len=depth, value=cache.path_device_indices(
                                          cache.match_prefix(MatchPrefixParams(key=key)).last_device_node)))
        cache.insert(InsertParams(key=RadixKey(array("q", fork)), prev_prefix_len=2,
                                  value=torch.cat([cache.path_device_indices(cache.match_prefix(MatchPrefixParams(
                                      key=RadixKey(array("q", fork[:2])))).last_device_node), allocator.alloc(1)])))
        states = {len(path_tokens(n)): n for n in tree_nodes(cache) if n.component_data[MAMBA].value is not None}
        for depth in (2, 6, 4):  # the LRU order, least recent first
            cache.tree_core.lru_lists[MAMBA].reset_node_mru(states[depth])
        cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        kept = sorted(len(path_tokens(n)) for n in tree_nodes(cache) if n.component_data[MAMBA].value is not None)
        assert kept == sorted({2, 4, 6} - {evicted_depth})


# ---- the properties catch broken bookkeeping in the component ----

def keep_the_slot(self, req, is_finished, insert_result=None, insert_params=None):
    return None


def donate_finished_state(self, req, insert_params, token_ids_len, is_finished):
    insert_params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(-1).clone() if is_finished else None
    return token_ids_len


def store_donated_state(self, node, is_new_leaf, params, result, cache_actions):
    if params.mamba_value is not None:
        MambaComponent.commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions)


def mark_nothing(self, params, result):
    return result


def mark_every_request(self, params, result):
    if params.cow_mamba and params.req is not None:
        state_of(params.req).match = Match(result.device_prefix_len, None)
    return result


BROKEN_COMPONENTS = {
    "finished request keeps its mamba slot": ({"cleanup_after_caching_req": keep_the_slot}, "mamba slot"),
    "nodes hold the finished request's state": (
        {"prepare_for_caching_req": donate_finished_state, "commit_insert_component_data": store_donated_state},
        "holds a recurrent state"),
    "a match must end on a state (SGLang's validator)": (
        {"create_match_validator": MambaComponent.create_match_validator}, "longest common prefix"),
    "a hit is not marked for replay": ({"finalize_match_result_in_cache": mark_nothing}, "not marked"),
    "a live request is marked again": ({"finalize_match_result_in_cache": mark_every_request}, "holds its state"),
}


ORIGINAL_DEEPEST_ANCHOR = TailReplayMambaComponent.deepest_anchor


def anchor_one_token_too_deep(self, node, depth: int, on_host: bool = True):
    anchor, found = ORIGINAL_DEEPEST_ANCHOR(self, node, depth, on_host)
    return anchor, found + 1 if anchor is not None else found


def store_every_state(self, req, insert_params, token_ids_len, is_finished):
    return MambaComponent.prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished)


def store_nothing_clean_up_like_stock(self, req, is_finished, insert_result=None, insert_params=None):
    return MambaComponent.cleanup_after_caching_req(self, req, is_finished, insert_result, insert_params)


def restore_nothing(self, node, mamba_pool, device_slot):
    self._slots.move_to_end(node)


def keep_deleted_nodes(self, node):
    MambaComponent.discard_deleted_session_leaf(self, node)


ORIGINAL_STAGE = TailReplayMambaComponent._stage_anchor_state


def copy_nothing(self, req, anchor):
    ORIGINAL_STAGE(self, req, anchor)
    req.kv.mamba_cow_src_index = None  # the forward copies nothing into the slot
    self.cache.req_to_token_pool.mamba_pool.mamba_cache.temporal[:, int(req.kv.mamba_pool_idx)] = STALE


def hold_nothing(self, cache, req, anchor):
    """Lock the anchor only for the slot's allocation, as the copy at the match did."""
    lock = cache.inc_lock_ref(anchor.id)
    cache.dec_lock_ref(anchor.id, lock.to_dec_params())


def forget_the_taint(self, node, is_new_leaf, params, result, cache_actions):
    if params.mamba_value is not None:
        MambaComponent.commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions)


def split_without_the_taint(self, new_parent, child):
    MambaComponent.redistribute_on_node_split(self, new_parent, child)


def budget_one_token_more(self, matched: int) -> int:
    return BUDGET + 1


def every_fallback_exact(self, matched: int) -> bool:
    return True


def fold_without_cutting_the_match(self, result, anchor, depth: int):
    return result


def unpin_nothing(self, node):
    pass


def plain_lru_victim(self, lru):
    return lru.get_lru_no_lock()


BROKEN_ANCHORED = {
    "a hit replays from the wrong depth": ({"deepest_anchor": anchor_one_token_too_deep},
                                           "reported exact|longest common prefix|not marked"),  # or folded past its end
    "approximate states become anchors": (
        {"prepare_for_caching_req": store_every_state, "cleanup_after_caching_req": store_nothing_clean_up_like_stock},
        "approximate state"),
    "the anchor's state is not copied into the hit's slot": ({"_stage_anchor_state": copy_nothing},
                                                             "reported exact"),
    "a zero-init tail is labelled exact": ({(TailReplayConfig, "is_exact_fallback"): every_fallback_exact},
                                           "labelled wrongly"),
}
BROKEN_FOLD = {
    "a fold does not cut the match back": ({"_match_up_to": fold_without_cutting_the_match}, "not marked"),
}
# Reached deterministically: the machines rarely build these trees within a few hundred examples.
BROKEN_SPELLED_OUT = {
    "an approximate insert is not tainted": ({"commit_insert_component_data": forget_the_taint},
                                             "approximate request's KV reported exact",
                                             test_a_hit_through_kv_an_approximate_request_inserted_is_not_exact),
    "a split loses the taint": ({"redistribute_on_node_split": split_without_the_taint},
                                "approximate request's KV reported exact",
                                test_both_halves_of_a_split_tainted_node_stay_tainted),
    "the exact budget is exceeded": ({(TailReplayConfig, "budget"): budget_one_token_more},
                                     "not within the budget rule",
                                     test_a_hit_past_the_exact_budget_takes_the_zero_init_tail),
}
BROKEN_SPELLED_OUT["the anchor is released before the batch takes its copy source"] = (
    {(StagedAnchors, "hold_device"): hold_nothing}, "evicted before its copy",
    test_an_anchor_is_copied_by_the_forward_and_held_until_the_batch_takes_it)
BROKEN_KEEP_ENDS = {
    "keep-ends evicts like plain LRU": ({"_next_victim": plain_lru_victim}, "before a mid-path one"),
}
BROKEN_HOST = {
    "a host anchor is not copied back": ({(HostAnchors, "restore"): restore_nothing}, "reported exact"),
    "host states outlive their nodes": ({"discard_deleted_session_leaf": keep_deleted_nodes},
                                        "deleted node|outlived their nodes"),
    "a host anchor's pin is never dropped": ({(HostAnchors, "unpin"): unpin_nothing}, "still pinned"),
}


BROKEN = {**{name: (*case, TailReplayCacheMachine, 20) for name, case in BROKEN_COMPONENTS.items()},
          **{name: (*case, AnchoredCacheMachine, 200) for name, case in BROKEN_ANCHORED.items()},
          **{name: (*case, HostAnchoredCacheMachine, 200) for name, case in BROKEN_HOST.items()},
          **{name: (*case, DefaultFoldCacheMachine, 200) for name, case in BROKEN_FOLD.items()},
          **{name: (*case, KeepEndsCacheMachine, 200) for name, case in BROKEN_KEEP_ENDS.items()},
          **{name: (*case, 0) for name, case in BROKEN_SPELLED_OUT.items()}}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_properties_catch_broken_component_bookkeeping(sglang_context, monkeypatch, broken):
    overrides, expected_failure, machine, examples = BROKEN[broken]
    for name, method in overrides.items():
        owner, name = name if isinstance(name, tuple) else (TailReplayMambaComponent, name)
        monkeypatch.setattr(owner, name, method)
    with pytest.raises(AssertionError, match=expected_failure):
        if isinstance(machine, type):
            quick = settings(SETTINGS, max_examples=examples, phases=[Phase.generate], report_multiple_bugs=False)
            run_machine(sglang_context, quick, machine)
        else:  # a test that spells the case out
            machine(sglang_context)


def test_an_anchor_costs_one_slot_of_every_recurrent_layer(sglang_context):
    """`lifecycle.anchor_bytes` (what the start-up log reports per anchor) against the pool's per-layer caches."""
    from tailreplay_sglang.lifecycle import anchor_bytes

    server_args, context = sglang_context
    with use_context(context):
        _, req_pool, _ = build_cache(server_args, ANCHORED_MODE, 8)
    per_layer = [req_pool.mamba2_layer_cache(i) for i in LINEAR_LAYERS]
    expected = sum(sum(c[0].numel() * c.element_size() for c in cache.conv)
                   + cache.temporal[0].numel() * cache.temporal.element_size() for cache in per_layer)
    assert anchor_bytes(req_pool) == expected > 0



# ---- HiCache residency (cache/hierarchy.py): a state only on the host tier ----

def test_a_state_only_on_the_host_tier_is_an_anchor_held_until_the_batch_and_a_skipped_request_gives_back_its_slot(
        sglang_context):
    """A node whose state HiCache moved to its host mamba pool (`host_value`, no device value) is an anchor: a hit
    2 tokens past it starts from it, exact, holding the node's host lock for the forward's restore. A request the
    scheduler matched but did not admit (HiCache's prefetch retry skips one after its match) lets go of the lock
    and gives its slot back, so its next match plans afresh (`anchor_copy.unstage`)."""
    server_args, context = sglang_context
    prompt = PATH
    with use_context(context):
        cache, req_pool, allocator, end = cache_with_path(server_args, prompt, 8)
        cache.insert(InsertParams(key=RadixKey(array("q", prompt[:8])), mamba_value=req_pool.mamba_allocator.alloc(1),
                                  value=cache.path_device_indices(end.last_device_node), prev_prefix_len=8,
                                  inserted_len=8))
        anchor = cache.tree_core.node_by_id(cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", prompt[:8])))).last_device_node)
        data = anchor.component_data[ComponentType.MAMBA]
        req_pool.mamba_allocator.free(data.value)  # as a device eviction after its host backup leaves it
        data.value, data.host_value = None, torch.tensor([3])
        free_slots = req_pool.mamba_allocator.available_size()
        req = new_request(1, prompt + (2,))
        req.init_next_round_input(cache)
        assert match_of(req) == Match(10, 8, exact=True)
        staged = cache.runtime.staged_anchors
        assert len(staged) == 1 and data.host_lock_ref == 1 and req.kv.holds_mamba
        staged.release(cache, None, admitted=[])
        assert len(staged) == 0 and data.host_lock_ref == 0
        assert not req.kv.holds_mamba and req_pool.mamba_allocator.available_size() == free_slots


# ---- HiCache-only paths, as units (their server tests cannot choose when they run) ----

def test_kv_an_approximate_insert_brings_back_from_the_host_is_tainted(monkeypatch):
    """An insert over KV that HiCache evicted to the host re-materialises it on the device with the inserter's KV
    (`_unevict_node_on_insert` -> `recover_after_unevict`): an approximate inserter taints the node."""
    from types import SimpleNamespace

    monkeypatch.setattr(MambaComponent, "recover_after_unevict", lambda *args, **kwargs: None)  # SGLang's own part
    component = object.__new__(TailReplayMambaComponent)
    for approximate in (False, True):
        node = SimpleNamespace()
        component.recover_after_unevict(node, 0, 4, SimpleNamespace(**{TAINT_ATTR: approximate}), None, None)
        assert getattr(node, TAINT_ATTR, False) is approximate


def test_a_replanned_request_lets_go_of_what_its_plan_held():
    """`StagedAnchors.drop` (a HiCache load-back changed the request's plan before its batch formed): the request's
    device lock and host pin go; another request's holds stay until the batch."""
    from types import SimpleNamespace

    pins, locks = Counter(), Counter()
    host = SimpleNamespace(pin=lambda node: pins.update([node]), unpin=lambda node: pins.subtract([node]))
    lock = SimpleNamespace(to_dec_params=lambda: None)
    cache = SimpleNamespace(inc_lock_ref=lambda node_id: locks.update([node_id]) or lock,
                            dec_lock_ref=lambda node_id, params: locks.subtract([node_id]))
    staged, req, other = StagedAnchors(), object(), object()
    staged.hold_host(host, req, "host anchor")
    staged.hold_device(cache, req, SimpleNamespace(id="device anchor"))
    staged.hold_host(host, other, "other's anchor")
    staged.drop(cache, host, req)
    assert +pins == Counter({"other's anchor": 1}) and +locks == Counter() and len(staged) == 1
