"""Tail gather: the stored hiddens of many tails, packed into one varlen replay input, plus its reference.

The hidden store is addressed by KV slot (the same index as the FA KV), so a tail is a list of slots, not a range:
one program copies one token's row block. The store may live on the device or in pinned host memory; a pinned store
is read over PCIe through unified addressing (the kernel takes its pointer), so only the tail rows cross the bus.
"""

import torch
import triton
import triton.language as tl

BLOCK_D = 1024


@triton.jit
def gather_tail_hiddens_kernel(store, slots, out, stride_store, stride_out, D, BD: tl.constexpr):
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    i_slot = tl.load(slots + i_t).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(store + i_slot * stride_store + o_d, mask=m_d)
    tl.store(out + i_t.to(tl.int64) * stride_out + o_d, b_x.to(out.dtype.element_ty), mask=m_d)


def gather_tail_hiddens(store, slots, out=None):
    """Rows `store[slots]` packed in order: the replay input of all tails of a batch.

    store: [num_slots, hidden] on the device or in pinned host memory (rows contiguous);
    slots: [T] int KV-slot index of each tail token, tails concatenated, on the device that runs the kernel;
    out: optional [T, hidden] destination (its dtype may differ from the store's: the copy casts).
    Returns out: [T, hidden], on slots' device, in store's dtype unless `out` is given.
    """
    T, D = slots.shape[0], store.shape[1]
    assert store.stride(1) == 1
    if out is None:
        out = torch.empty(T, D, dtype=store.dtype, device=slots.device)
    assert out.shape == (T, D) and out.stride(1) == 1
    BD = min(BLOCK_D, triton.next_power_of_2(D))
    gather_tail_hiddens_kernel[(T, triton.cdiv(D, BD))](
        store=store, slots=slots, out=out, stride_store=store.stride(0), stride_out=out.stride(0), D=D, BD=BD,
    )
    return out


def naive_gather_tail_hiddens(store, slots):
    """Reference: index_select on the store's device, moved to slots' device."""
    return store.index_select(0, slots.to(store.device)).to(slots.device)
