"""HiCache on the CPU engine: the `direct` io backend's three copies in torch, and host pools that do not pin.

SGLang's host pools (`mem_cache/pool_host/{mha,mla,mamba}.py`) import sgl-kernel's `kvcacheio` copies only on
CUDA/ROCm (XPU through its own wheel), so on the CPU engine the names are unbound and the first backup raises
NameError. The `direct` backend's copies are plain page copies in sgl-kernel too (`transfer_page_direct`: a
`copy_` of `page_size` rows per page and layer); here each is one gather/scatter per layer over every token index,
which is the same copy when a page's indices are consecutive (they are: pages are allocated whole) and no Python loop
per page. `--hicache-io-backend direct` selects them, and with it the `page_first_direct` host layout
(`[page, layer, page_size, ...]` per K, V or state buffer). The host pools also pin their buffers through
`cudaHostRegister` / `pin_memory=True` by default, which a CPU-only torch refuses: they are built unpinned.
SGLang's default io backend, `kernel`, is sgl-kernel's CUDA transfer kernels, which the CPU engine lacks (the server
starts, then its scheduler dies at the first backup: a NameError, then "'Stream' object has no attribute
'synchronize'"): a CPU server takes `direct` instead, with a warning, as SGLang itself switches the backend where a
layout needs it.
"""

import inspect
import logging

logger = logging.getLogger(__name__)

HOST_POOL_MODULES = ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla",
                     "sglang.srt.mem_cache.pool_host.mamba")


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """Layer-first to layer-first: `dst_layers[j][dst_indices] = src_layers[j][src_indices]` for every layer."""
    src_indices, dst_indices = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def _page_first(indices, page_size: int, device):
    """Token indices of a page-first buffer -> (page, row within the page), on the buffer's device."""
    indices = indices.long().to(device)
    return indices // page_size, indices % page_size


def _layers(per_layer: list, page_first: list):
    """(page-first buffer, layer within it, per-layer tensor) for every per-layer tensor: with one page-first buffer
    the per-layer tensors are its consecutive layers; with two (K, V) the first half are K's and the second V's
    (sgl-kernel's `transfer_kv_page_first_direct_impl`)."""
    per_buffer = len(per_layer) // len(page_first)
    for b, buffer in enumerate(page_first):
        for j in range(per_buffer):
            yield buffer, j, per_layer[b * per_buffer + j]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id: int,
                                       page_size: int) -> None:
    """Host (page-first) to device (one tensor per layer), the layers from `layer_id`."""
    page, row = _page_first(src_indices, page_size, src_ptrs[0].device)
    dst_indices = dst_indices.long().to(dst_ptrs[0].device)
    for host, j, dst in _layers(dst_ptrs, src_ptrs):
        dst[dst_indices] = host[page, layer_id + j, row].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size: int) -> None:
    """Device (one tensor per layer) to host (page-first), every layer."""
    page, row = _page_first(dst_indices, page_size, dst_ptrs[0].device)
    src_indices = src_indices.long().to(src_ptrs[0].device)
    for host, j, src in _layers(src_ptrs, dst_ptrs):
        host[page, j, row] = src[src_indices].to(host.device)


def install() -> None:
    """`call` row: bind the three copies in each host-pool module (unbound there off CUDA, ROCm and XPU)."""
    import importlib

    for name in HOST_POOL_MODULES:
        module = importlib.import_module(name)
        for fn in (transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf):
            setattr(module, fn.__name__, fn)


def unpinned(original, *args, **kwargs):
    """AROUND a host pool's `__init__`: built with `pin_memory=False` (its buffers and its dummy L3 page)."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.arguments["pin_memory"] = False
    return original(*bound.args, **bound.kwargs)


def direct_io_backend(server_args) -> None:
    """BEFORE `hicache_hook.resolve_layout_io_compatibility` (it runs only when HiCache is on): `kernel` becomes
    `direct` on the CPU engine, before SGLang matches the host layout to the backend (page_first -> page_first_direct
    follows from it there)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    if resolving_view(server_args).hicache_io_backend == "kernel":
        declare_resolution(server_args, "sglang_cpu_compat.direct_io_backend", hicache_io_backend="direct")
        logger.warning("--hicache-io-backend kernel is sgl-kernel's CUDA transfer kernels; the CPU engine uses the "
                       "direct backend (torch copies)")
