"""What SGLang's speculative decoding (EAGLE/NEXTN drafts, NGRAM) needs from the `torch_native` attention backend.

On a CPU SGLang 0.5.23 knows speculative decoding only through its AMX backend (`intel_amx_backend.py`); the draft
backend factory (`speculative/draft_utils.py`) has no `torch_native` entry, and `TorchNativeAttnBackend` reads the
`extend_*` fields that a verify batch does not carry. Three pieces, each what the AMX backend does in its kernels:

- **target verify** (`forward_extend` in TARGET_VERIFY): each request's `T` draft tokens attend to its whole
  committed prefix and to the draft tokens on their own path: the causal order for a chain (NEXTN, topk 1), the
  verify's tree mask otherwise (NGRAM, EAGLE topk > 1; on CPU SGLang builds it as [T, T] per request,
  `TreeMaskMode.QLEN_ONLY`, the prefix being visible to every draft token);
- **draft extend**: a plain `TorchNativeAttnBackend` for the draft model;
- **multi-step draft decode** (`speculative_num_steps > 1`): step `i` of the chain attends to the prefix and to the
  draft tokens of steps 0..i, whose KV slots the draft's `out_cache_loc` holds (`DraftDecodeSteps`).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

_STAMP = "torch_native"


# ---- target verify ----------------------------------------------------------------------------------------------


def verify_forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    """AROUND hook on TorchNativeAttnBackend.forward_extend: a TARGET_VERIFY batch attends as described above."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
    _save_kv(backend, layer, forward_batch, k, v, save_kv_cache)
    spec_info = forward_batch.spec_info
    steps = spec_info.draft_token_num
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
    keys = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    values = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    tree = spec_info.custom_mask if getattr(spec_info, "tree_topk", 1) != 1 else None
    for seq in range(forward_batch.batch_size):
        prefix = int(forward_batch.seq_lens[seq])
        slots = req_to_token[forward_batch.req_pool_indices[seq], : prefix + steps]
        rows = slice(seq * steps, (seq + 1) * steps)
        mask = _verify_mask(tree, forward_batch.batch_size, seq, prefix, steps, q.device)
        out = scaled_dot_product_attention(
            q[rows].movedim(0, 1).unsqueeze(0), keys[slots].movedim(0, 1).unsqueeze(0).to(q.dtype),
            values[slots].movedim(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
        o[rows] = out.squeeze(0).movedim(1, 0)
    return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def _save_kv(backend, layer, forward_batch, k, v, save_kv_cache: bool) -> None:
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)


def _verify_mask(tree, batch: int, seq: int, prefix: int, steps: int, device) -> torch.Tensor:
    """[T, prefix + T] bool: every draft token sees the prefix, and itself and its ancestors among the drafts."""
    mask = torch.ones(steps, prefix + steps, dtype=torch.bool, device=device)
    if tree is None:
        mask[:, prefix:] = torch.ones(steps, steps, dtype=torch.bool, device=device).tril()
    elif tree.numel() == batch * steps * steps:
        mask[:, prefix:] = tree[seq * steps * steps : (seq + 1) * steps * steps].view(steps, steps).bool()
    else:
        raise NotImplementedError(f"torch_native target verify: a tree mask of {tree.numel()} entries for {batch} x "
                                  f"{steps} drafts; only the [T, T] (QLEN_ONLY) mask SGLang builds on a CPU is "
                                  f"supported")
    return mask


# ---- draft backends ---------------------------------------------------------------------------------------------


class DraftDecodeSteps:
    """The multi-step draft decode backend: one `TorchNativeAttnBackend` per draft step, as SGLang's Triton and AMX
    containers hold one per step; `init_forward_metadata` gives step `i` the KV slots of prefix + steps 0..i."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        if topk != 1:  # the draft tokens of a topk > 1 tree each have their own branch of slots
            raise NotImplementedError(f"torch_native multi-step draft decode supports --speculative-eagle-topk 1, "
                                      f"got {topk}")
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.attn_backends = [_DraftStep(TorchNativeAttnBackend(model_runner), step)
                              for step in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch) -> None:
        from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

        bs = forward_batch.batch_size
        draft_slots = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, bs, self.topk,
                                                   self.speculative_num_steps)  # [steps, bs]
        req_to_token = self.attn_backends[0].backend.req_to_token_pool.req_to_token
        seq_lens = forward_batch.seq_lens
        longest = int(seq_lens.max()) if bs else 0
        table = torch.zeros(bs, longest + self.speculative_num_steps, dtype=req_to_token.dtype,
                            device=req_to_token.device)
        for seq in range(bs):
            n = int(seq_lens[seq])
            table[seq, :n] = req_to_token[forward_batch.req_pool_indices[seq], :n]
            table[seq, n : n + self.speculative_num_steps] = draft_slots[:, seq]
        for step in self.attn_backends:
            step.table, step.seq_lens = table, seq_lens + step.step + 1


class _DraftStep:
    """Draft decode step `step`: torch_native's decode over the step's own slot table."""

    def __init__(self, backend, step: int):
        self.backend, self.step = backend, step
        self.table = self.seq_lens = None

    def __getattr__(self, name):  # everything else is the wrapped backend's
        return getattr(self.backend, name)

    def init_forward_metadata(self, forward_batch) -> None:
        pass

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        backend = self.backend
        _save_kv(backend, layer, forward_batch, k, v, save_kv_cache)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        backend._run_sdpa_forward_decode(
            q, o, backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
            backend.token_to_kv_pool.get_value_buffer(layer.layer_id), self.table,
            torch.arange(self.table.shape[0], device=q.device), self.seq_lens, scaling=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    forward_decode = forward


def torch_native_draft_backends(original, factory, backend_name, backend_map, error_template, stamps_children=False):
    """AROUND hook on DraftBackendFactory._create_backend: `torch_native` gets the draft backends above."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    runner = factory.draft_model_runner
    if backend_name == "decode_attention_backend":
        make = lambda: (_STAMP, DraftDecodeSteps(runner, factory.topk, factory.speculative_num_steps))  # noqa: E731
    else:
        make = lambda: (_STAMP, TorchNativeAttnBackend(runner))  # noqa: E731
    return original(factory, backend_name, {**backend_map, _STAMP: make}, error_template, stamps_children)


# ---- scheduling -------------------------------------------------------------------------------------------------


def keep_overlap_schedule(server_args) -> None:
    """REPLACE of `speculative_hook._disable_overlap_schedule_for_cpu`: SGLang turns the overlap scheduler off for
    speculative decoding on a CPU ("not implemented"), which rules out its GPU default (spec v2 with overlap) and
    `extra_buffer_lazy` (which requires overlap). With the pieces above the overlap path runs here as on a GPU."""


# ---- Ling's NEXTN draft -----------------------------------------------------------------------------------------


def share_embed_and_head(model, embed, head):
    """REPLACE `BailingMoeForCausalLMNextN.set_embed_and_head` and `DeepseekV2ForCausalLM.set_embed_and_head` (GLM-5.3-
    Flash's NEXTN draft inherits it): the draft takes the target's embedding and LM head, as SGLang's does, without the
    `torch.cuda.empty_cache()` / `synchronize()` after it, which a CPU-only torch refuses."""
    stack = model.model
    embedding = stack.word_embeddings if hasattr(stack, "word_embeddings") else stack.embed_tokens  # Ling's name
    del embedding.weight
    del model.lm_head.weight
    embedding.weight = embed
    model.lm_head.weight = head
