"""Attention data parallelism (`--tp N --dp M --enable-dp-attention`) on the CPU engine.

Under DP attention every rank pads its batch to the step's common token count (`prepare_mlp_sync_batch`), and the
padded rows' sequence lengths take the attention backend's fill value, which a CPU run asks of the backend as
`get_cpu_graph_seq_len_fill_value` (the hybrid backend forwards the question to its full-attention backend).
torch_native has no such method: the scheduler died at the first padded step ("'TorchNativeAttnBackend' object has
no attribute 'get_cpu_graph_seq_len_fill_value'").

With expert parallelism as well, a layer's output goes back to the DP groups by `GroupCoordinator.reduce_scatterv`,
which is pynccl only ("'PyNcclCommunicator' object has no attribute 'device'"); on a CPU it takes SGLang's own
all-reduce-and-slice form (`_deterministic_reduce_scatterv`, what SGLang runs for deterministic inference).
"""


def seq_len_fill_value(self) -> int:
    """A padded row attends one token, as on the AMX backend (`IntelAMXAttnBackend`)."""
    return 1


def install() -> None:
    """`call` row: give torch_native the fill value the padding asks for."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = seq_len_fill_value


def reduce_scatterv_on_cpu(original, self, input_, output=None, sizes=None):
    """AROUND `GroupCoordinator.reduce_scatterv`: host tensors take the all-reduce-and-slice form."""
    if input_.device.type == "cpu":
        return self._deterministic_reduce_scatterv(input_, output, sizes)
    return original(self, input_, output=output, sizes=sizes)
