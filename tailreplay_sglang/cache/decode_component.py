"""Radix-cache backend `tail_replay` on a PD decode server (`--disaggregation-mode decode
--disaggregation-decode-enable-radix-cache`): KV reuse only, at any page boundary, with honest labels.

A decode server never computes a prompt: the prefill server sends the request's final recurrent state into its slot
with the last chunk, and a hit in D's own tree only shortens the KV P sends (`decode_prefix_len`). So a state in
D's tree is never what a request decodes from, and stock's MAMBA component, which accepts a match end only where a
state is kept and copies it on write, restricts D's hits for nothing (upstream sglang#32732 proposes the same skip).
This component:
- accepts any node as a match end and copies nothing (the transfer overwrites the slot);
- keeps no state in the tree (a finished request's slot is freed, not donated);
- taints the KV a request leaves in the tree (its prompt pages as received, its answer as decoded) when its label,
  relayed from P (`disaggregation.take_relayed`), is approximate: such KV was computed from, or after, an
  approximate state;
- stops a match at the first tainted node, so a request's reused KV is exact and its label stays P's.
"""

import functools

from sglang.srt.mem_cache.registry import create_unified_radix_cache

from tailreplay_sglang.cache.component import TaintedKVComponent, with_mamba_component
from tailreplay_sglang.cache.request import TAINT_ATTR, is_exact, is_tainted


class DecodeMambaComponent(TaintedKVComponent):
    def create_match_validator(self, match_device_only: bool = False):
        return lambda node: not is_tainted(node)  # ends a match at any node above the first tainted one

    def finalize_match_result_in_cache(self, params, result):
        if params.req is not None:  # no copy-on-write: P's transfer writes the request's slot
            self.runtime.count_decode_reuse(result.device_prefix_len)
        return result

    def refresh_lru(self, phase, node, root_node):
        pass  # no state in the tree to keep warm

    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        insert_params.mamba_value = None  # D keeps no states
        setattr(insert_params, TAINT_ATTR, not is_exact(req))
        return token_ids_len

    def cleanup_after_caching_req(self, req, is_finished, insert_result=None, insert_params=None):
        if is_finished and req.kv.holds_mamba:
            self.cache.req_to_token_pool.free_mamba_cache(req)


def create_decode_cache(runtime, ctx):
    """SGLang's unified radix cache with the decode MAMBA component (`lifecycle.build_tree_cache` on D)."""
    with_mamba_component(ctx, functools.partial(DecodeMambaComponent, runtime=runtime))
    return create_unified_radix_cache(ctx)
