"""HiCache's `direct` copies in torch (`sglang_cpu_compat/kvcacheio.py`) against sgl-kernel's own loop, written out
per page (`transfer_kv_page_first_direct_impl`: one `copy_` of page_size rows per page and layer, from the first
index of each page), for KV (K and V buffers) and single-buffer (mamba state, MLA) pools, page sizes 1 and 4."""

import pytest
import torch

from sglang_cpu_compat import kvcacheio


def reference_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    one = len(dst_ptrs) == 1
    layers = len(src_ptrs) if one else len(src_ptrs) // 2
    for i in range(len(src_indices) // page_size):
        s, d = int(src_indices[i * page_size]), int(dst_indices[i * page_size]) // page_size
        for j in range(layers):
            dst_ptrs[0][d, j].copy_(src_ptrs[j][s:s + page_size])
            if not one:
                dst_ptrs[1][d, j].copy_(src_ptrs[j + layers][s:s + page_size])


def reference_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    one = len(src_ptrs) == 1
    layers = len(dst_ptrs) if one else len(dst_ptrs) // 2
    for i in range(len(src_indices) // page_size):
        s, d = int(src_indices[i * page_size]) // page_size, int(dst_indices[i * page_size])
        for j in range(layers):
            dst_ptrs[j][d:d + page_size].copy_(src_ptrs[0][s, layer_id + j])
            if not one:
                dst_ptrs[j + layers][d:d + page_size].copy_(src_ptrs[1][s, layer_id + j])


def page_indices(gen, pages: int, chosen: int, page_size: int) -> torch.Tensor:
    """Token indices of `chosen` random whole pages out of `pages`, in a random order."""
    picked = torch.randperm(pages, generator=gen)[:chosen]
    return (picked[:, None] * page_size + torch.arange(page_size)).flatten()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("buffers", [1, 2])  # one state / latent buffer, or K and V
def test_direct_copies_match_sgl_kernels_page_loop(page_size, buffers):
    gen = torch.Generator().manual_seed(page_size * 10 + buffers)
    layers, row, device_pages, host_pages, moved = 3, (2, 5), 12, 9, 5
    device = [torch.randn(device_pages * page_size, *row, generator=gen) for _ in range(buffers * layers)]
    host_shape = (host_pages, layers, page_size, *row)
    dev_idx = page_indices(gen, device_pages, moved, page_size)
    host_idx = page_indices(gen, host_pages, moved, page_size)

    ours, ref = [torch.zeros(host_shape) for _ in range(buffers)], [torch.zeros(host_shape) for _ in range(buffers)]
    kvcacheio.transfer_kv_all_layer_direct_lf_pf(device, ours, dev_idx, host_idx, page_size)
    reference_lf_pf(device, ref, dev_idx, host_idx, page_size)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref)) and any(a.abs().sum() > 0 for a in ours)

    for layer in range(layers):  # back, one layer at a time, to other device rows
        back_idx = page_indices(gen, device_pages, moved, page_size)
        back_ours = [torch.zeros_like(device[0]) for _ in range(buffers)]
        back_ref = [torch.zeros_like(device[0]) for _ in range(buffers)]
        kvcacheio.transfer_kv_per_layer_direct_pf_lf(ours, back_ours, host_idx, back_idx, layer, page_size)
        reference_pf_lf(ref, back_ref, host_idx, back_idx, layer, page_size)
        assert all(torch.equal(a, b) for a, b in zip(back_ours, back_ref))
        for b in range(buffers):  # the round trip lands the device rows where they were asked to go
            assert torch.equal(back_ours[b][back_idx], device[b * layers + layer][dev_idx])


def test_layer_first_direct_copy_is_an_indexed_copy_per_layer():
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(10, 3, generator=gen) for _ in range(2)]
    dst = [torch.zeros(8, 3) for _ in range(2)]
    si, di = torch.tensor([7, 2, 3]), torch.tensor([0, 5, 6])
    kvcacheio.transfer_kv_direct(src, dst, si, di, page_size=1)
    for s, d in zip(src, dst):
        assert torch.equal(d[di], s[si]) and d.abs().sum(1).nonzero().flatten().tolist() == [0, 5, 6]


def test_host_pools_are_built_unpinned():
    def init(self, info, ratio, size, page_size, layout, pin_memory=True, device="cpu"):
        return pin_memory

    assert kvcacheio.unpinned(init, object(), 1, 2.0, 3, 1, "page_first_direct") is False
    assert kvcacheio.unpinned(init, object(), 1, 2.0, 3, 1, "page_first_direct", True) is False
    assert kvcacheio.unpinned(init, object(), 1, 2.0, 3, 1, "page_first_direct", pin_memory=True) is False


@pytest.mark.parametrize("asked, backend", [("kernel", "direct"), ("direct", "direct")])
def test_the_cpu_engine_resolves_hicache_to_the_direct_backend(asked, backend):
    """SGLang's default io backend (`kernel`) is CUDA-only: before SGLang matches the host layout to the backend, the
    port's row makes it `direct`, and SGLang's own step then picks the layout the direct copies use."""
    from sglang.srt.arg_groups.hicache_hook import resolve_layout_io_compatibility
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", enable_hierarchical_cache=True, hicache_io_backend=asked)
    kvcacheio.direct_io_backend(server_args)
    resolve_layout_io_compatibility(server_args)
    resolved = resolved_view(server_args)
    assert (resolved.hicache_io_backend, resolved.hicache_mem_layout) == (backend, "page_first_direct")
