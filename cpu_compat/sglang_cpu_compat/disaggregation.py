"""PD disaggregation on SGLang's CPU engine (Mooncake's transfer engine over TCP, `mooncake_tcp`).

Nothing in SGLang's PD path asks which device it runs on; the one CUDA call on its default send path is the page
index staging of `SchedulerDisaggregationPrefillMixin.send_kv_chunk`: for a sender that `supports_host_tensor_indices`
(Mooncake's), the indices are copied into pinned memory and a `torch.cuda.Event` is recorded so the transfer worker
waits for the copy off the scheduling thread. A CPU-only torch has no pinned memory and no events; the indices are
host tensors already, so the sender takes the other branch (`kv_to_page_indices`, a numpy view) here.
"""


def host_page_indices(result, sender, *args, **kwargs):
    """After `MooncakeKVSender.__init__`: this sender takes plain host page indices (no pinned staging, no event)."""
    sender.supports_host_tensor_indices = False
    return result
