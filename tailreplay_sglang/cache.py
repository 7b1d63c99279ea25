"""Radix-cache backend `tail_replay`: SGLang's UnifiedRadixCache with FA KV in the tree and no recurrent states.

The MAMBA component is replaced by one whose nodes never hold a state: every node with KV is a valid match end,
so a hit is usable at any token boundary (SGLang's own cap of input_len - 1 stays). A hit request gets a fresh,
cleared mamba slot from SGLang's allocator (as if nothing matched) and is marked for replay; finished requests free
their slot instead of donating it to the tree. Eviction, locking and flush stay SGLang's: only the FULL component
decides whether a node lives.
"""

from sglang.srt.mem_cache.registry import create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

from tailreplay_sglang.layout import SUPPORTED

RADIX_CACHE_BACKEND = "tail_replay"  # the name this backend is registered under (--radix-cache-backend)
REPLAY_ATTR = "tail_replay_match"  # set on a Req whose match needs its GDN states rebuilt


class TailReplayMambaComponent(MambaComponent):
    def create_match_validator(self, match_device_only: bool = False):
        return lambda node: True  # states are rebuilt, so any node with KV (FULL's validator) ends a match

    def finalize_match_result_in_tree_core(self, result, params, value_chunks, best_value_len):
        return result._replace(mamba_branching_seqlen=None)

    def finalize_match_result_in_cache(self, params, result):
        req = params.req
        # A request that already holds a slot (chunked prefill, checkpoint re-match) keeps its live state.
        if params.cow_mamba and req is not None and not req.kv.holds_mamba:
            setattr(req, REPLAY_ATTR, result.device_prefix_len)
        return result

    def commit_insert_component_data(self, node, is_new_leaf, params, result, cache_actions):
        return  # nodes never hold a recurrent state

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        insert_params.mamba_value = None
        return token_ids_len

    def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
        if is_finished and req.kv.holds_mamba:
            self.cache.req_to_token_pool.free_mamba_cache(req)


def create_tail_replay_cache(ctx):
    if not ctx.is_hybrid_ssm:
        raise ValueError(f"--enable-tail-replay needs a hybrid model with linear-attention layers. "
                         f"Supported: {SUPPORTED}")
    ctx.params.component_registry_override = {
        **(ctx.params.component_registry_override or {}), ComponentType.MAMBA: TailReplayMambaComponent}
    return create_unified_radix_cache(ctx)
