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
"""

import torch

from tailreplay_sglang.store.hidden_store import TOKEN_ID_BYTES, HiddenStore


class HiddenHostPool:
    can_use_write_back_jit = False  # SGLang's JIT write-back kernels know KV layouts only
    shared_allocation_domain = None
    layer_num = 1  # one transfer per load-back, before the forward's first layer

    def __init__(self, store: HiddenStore, size: int, page_size: int, pin_memory: bool = False):
        self.store, self.size, self.page_size = store, size, page_size
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
        return host_indices.long().cpu(), device_indices.long().to(self.store.hiddens.device)

    # ---- L2: device <-> host, with the KV ----

    def backup_from_device_all_layer_physical(self, device_pool, host_indices, device_indices, io_backend) -> None:
        device_pool.drain()  # on the host tier the last forwards' rows may still be on their way into the store
        host, dev = self.prepare_transfer_indices(host_indices, device_indices, io_backend)
        self.hiddens[:, host] = device_pool.hiddens[:, dev].to(self.hiddens.device)
        self.token_ids[host] = device_pool.token_ids[dev].to(self.token_ids.device)

    def load_to_device_per_layer_physical(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                                          *, is_draft: bool = False) -> None:
        device_pool.drain()  # an older write-back applied after the load would overwrite the loaded rows
        host, dev = self.prepare_transfer_indices(host_indices, device_indices, io_backend)
        device_pool.hiddens[:, dev] = self.hiddens[:, host].to(device_pool.hiddens.device)
        device_pool.token_ids[dev] = self.token_ids[host].to(device_pool.token_ids.device)

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
