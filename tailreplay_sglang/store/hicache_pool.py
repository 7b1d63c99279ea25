"""The hidden store's host pool for SGLang's HiCache: its rows go to host memory and back, and to L3, with the KV
pages they belong to (registered by `cache/hierarchy.py`).

HiCache moves a node's KV between the device pool and its host pool; a pool registered as a KV-derived sidecar
(`UnifiedRadixCache.register_sidecar_pool`, `indices_from_pool=KV`) is moved in the same operation, addressed by the
same device and host indices (docs/design.md, "The store in SGLang's memory hierarchy"). The store is addressed by
KV slot, so its host twin is addressed by KV host slot: one row per host slot, laid out `[groups, host slots, row]`
like the store, with the token ids beside it. The methods are the ones SGLang's controller calls on a host pool
(`HostKVCache`'s names and arguments); `device_pool` is the `HiddenStore`. L3 pages (`get_data_page` /
`set_from_flat_data_page`) are the bytes of `page_size` consecutive host slots: every group's rows, then the token
ids.

Device <-> host copies run on the transfer stream SGLang's controller puts them on. With its default io backend
(`kernel`, CUDA) they are SGLang's own indexed copy (`transfer_kv_per_layer_mla`, what its mamba host pool uses for a
single pool): a kernel that reads and writes the pinned host rows in place, indices on the device, so nothing waits
on the host for the forward the transfer stream is fenced behind (GPU path review N6). Elsewhere (`direct`, the CPU
route, the host tier) they are torch indexing, synchronous where host is the device.
"""

import torch

from tailreplay_sglang.store.hidden_store import TOKEN_ID_BYTES, HiddenStore

KERNEL_WORD = 8  # bytes sgl-kernel's transfer kernels move at a time (int64 words)


class HiddenHostPool:
    can_use_write_back_jit = False  # SGLang's JIT write-back kernels know KV layouts only
    shared_allocation_domain = None
    layer_num = 1  # one transfer per load-back, before the forward's first layer

    def __init__(self, store: HiddenStore, size: int, page_size: int, pin_memory: bool = False, kernel_copy=None):
        self.store, self.size, self.page_size = store, size, page_size
        # the kernel addresses host rows through their device mapping: only pinned rows of a device-tier store
        if kernel_copy is None and pin_memory and store.hiddens.is_cuda:
            kernel_copy = sglang_indexed_copy()
        # it moves a row as 8-byte words: a row of another size (float8 rows of a hidden size that is not a multiple
        # of 8) would lose its tail and misalign the next, so such rows go through torch
        self.kernel_copy = kernel_copy if _row_bytes(store.hiddens[0]) % KERNEL_WORD == 0 else None
        groups, row = store.hiddens.shape[0], store.hiddens.shape[-1]
        self.hiddens = torch.zeros(groups, size, row, dtype=store.hiddens.dtype, pin_memory=pin_memory)
        self.token_ids = torch.zeros(size, dtype=torch.int64, pin_memory=pin_memory)
        self.size_per_token = self.bytes_per_slot(store)

    @staticmethod
    def bytes_per_slot(store: HiddenStore) -> int:
        """Host bytes of one slot: every stored group's row and the token id."""
        return store.hiddens.shape[0] * store.hiddens.shape[-1] * store.hiddens.element_size() + TOKEN_ID_BYTES

    @property
    def nbytes(self) -> int:
        return self.hiddens.numel() * self.hiddens.element_size() + self.token_ids.numel() * TOKEN_ID_BYTES

    @property
    def logical_size(self) -> int:
        return self.size

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        """The indices where the controller put them for its io backend (`kernel`: both on the device): moving one
        to the host here would wait for the forward the transfer stream is fenced behind."""
        return host_indices.long(), device_indices.long()

    # ---- L2: device <-> host, with the KV ----

    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend) -> None:
        device_pool.drain()  # on the host tier the last forwards' rows may still be on their way into the store
        host, dev = self.prepare_transfer_indices(host_indices, device_indices, io_backend)
        self._copy_rows(device_pool, self, dev, host, io_backend)

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                          *, is_draft: bool = False) -> None:
        device_pool.drain()  # an older write-back applied after the load would overwrite the loaded rows
        host, dev = self.prepare_transfer_indices(host_indices, device_indices, io_backend)
        self._copy_rows(self, device_pool, host, dev, io_backend)

    def _copy_rows(self, src, dst, src_indices, dst_indices, io_backend) -> None:
        """`dst`'s rows and token ids at `dst_indices` = `src`'s at `src_indices` (the store or this pool each)."""
        tables = [*zip(src.hiddens, dst.hiddens), (src.token_ids, dst.token_ids)]  # one [slots, row] table a group
        if src_indices.numel() == 0:  # sgl-kernel's launcher would divide by zero items (review I)
            return
        if io_backend == "kernel" and self.kernel_copy is not None:
            for s, d in tables:
                self.kernel_copy(src=s, dst=d, src_indices=src_indices, dst_indices=dst_indices,
                                 item_size=_row_bytes(s))
            return
        for s, d in tables:
            d[dst_indices.to(d.device)] = s[src_indices.to(s.device)].to(d.device)

    # ---- L3: a page of host slots as bytes ----

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        pages = slice(index, index + self.page_size)
        parts = [self.hiddens[:, pages].contiguous().view(torch.uint8).flatten(),
                 self.token_ids[pages].contiguous().view(torch.uint8).flatten()]
        return torch.cat(parts)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        pages = slice(index, index + self.page_size)
        split = self.hiddens[:, pages].numel() * self.hiddens.element_size()
        rows = data_page[:split].view(self.hiddens.dtype).view(self.hiddens.shape[0], self.page_size, -1)
        self.hiddens[:, pages] = rows
        self.token_ids[pages] = data_page[split:].view(torch.int64)

    # ---- L3 without a copy (Mooncake): the same page bytes, read and written in place ----

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        """The tensors a zero-copy backend registers with its transfer engine (it moves only registered memory)."""
        return [self.hiddens, self.token_ids]

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """(addresses, byte sizes) of each page's parts, page after page: every group's `page_size` rows (contiguous
        in `[groups, slots, row]`), then its token ids; the backend packs one page's parts into one object, in the
        order `get_data_page` writes them."""
        starts = indices.reshape(-1, self.page_size)[:, 0].tolist()
        groups, elem = self.hiddens.shape[0], self.hiddens.element_size()
        group_stride, slot_bytes = self.hiddens.stride(0) * elem, self.hiddens.stride(1) * elem
        rows, ids = self.hiddens.data_ptr(), self.token_ids.data_ptr()
        ptrs, sizes = [], []
        for start in starts:  # addresses by arithmetic: no tensor view per part on the storage thread
            ptrs += [rows + g * group_stride + start * slot_bytes for g in range(groups)]
            ptrs.append(ids + start * TOKEN_ID_BYTES)
            sizes += [self.page_size * slot_bytes] * groups + [self.page_size * TOKEN_ID_BYTES]
        return ptrs, sizes

    def clear(self) -> None:
        """Host slots are reused as the KV host pool reuses them: nothing to reset."""

    def destroy(self) -> None:
        pass


def _row_bytes(table: torch.Tensor) -> int:
    return table[0].numel() * table.element_size()


def sglang_indexed_copy():
    """SGLang's single-pool indexed copy between device and pinned host memory, as its mamba host pool binds it
    (sgl-kernel's, on CUDA and ROCm); None where SGLang has none (the CPU engine, whose io backend is `direct`)."""
    from sglang.srt.mem_cache.pool_host import mamba

    return getattr(mamba, "transfer_kv_per_layer_mla", None)
