"""The suffix-only extend attention (sglang_cpu_compat/extend_attention.py) against SGLang's own
TorchNativeAttnBackend._run_sdpa_forward_extend, in float64 over random batches of prefixes and suffixes."""

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_cpu_compat.extend_attention import sdpa_forward_extend, suffix_causal_mask

ORIGINAL = TorchNativeAttnBackend._run_sdpa_forward_extend


def test_mask_is_bottom_right_causal():
    assert suffix_causal_mask(2, 3, "cpu").tolist() == [[True, True, True, False, False],
                                                        [True, True, True, True, False],
                                                        [True, True, True, True, True]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gqa", [False, True])
def test_matches_sglang_extend_attention(seed, gqa):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 4, (1,), generator=g))
    prefix = torch.randint(0, 80, (n,), generator=g)
    prefix[0] = 0  # one fresh prompt in every batch
    extend = torch.randint(1, 40, (n,), generator=g)
    seq = prefix + extend
    heads, kv_heads, dim = 4, (2 if gqa else 4), 16
    pool_size = int(seq.sum()) + 1
    k_cache = torch.randn(pool_size, kv_heads, dim, dtype=torch.float64, generator=g)
    v_cache = torch.randn(pool_size, kv_heads, dim, dtype=torch.float64, generator=g)
    req_to_token = torch.zeros(n, int(seq.max()), dtype=torch.int64)
    perm = torch.randperm(pool_size - 1, generator=g) + 1  # scattered KV slots, as a real pool has them
    at = 0
    for i in range(n):
        req_to_token[i, :seq[i]] = perm[at:at + seq[i]]
        at += int(seq[i])
    query = torch.randn(int(extend.sum()), heads, dim, dtype=torch.float64, generator=g)
    args = (k_cache, v_cache, req_to_token, torch.arange(n), seq, prefix, extend)
    kwargs = dict(scaling=dim ** -0.5, enable_gqa=gqa, causal=True)
    expected = ORIGINAL(None, query.clone(), torch.zeros_like(query), *args, **kwargs)
    got = sdpa_forward_extend(ORIGINAL, None, query.clone(), torch.zeros_like(query), *args, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
