"""The KV pool's budget on SGLang's CPU engine is charged with what the load allocated (the port's row on
`KVCacheConfigurator._profile_available_bytes`, `memory_profile.py`), not with what other processes took from the
machine's available RAM during the load. SGLang's own reading, sizing and hook wrapper run on a tiny torch module as
the model; only the available RAM (SGLang's psutil reading) is made up."""

import pkgutil
from types import SimpleNamespace

import pytest
import torch

from sglang_cpu_compat import hooks, memory_profile

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
GiB = 1 << 30
AVAILABLE = 8 * GiB  # the machine's available RAM before the load
MEM_FRACTION_STATIC = 0.1  # the CPU flags' (docs/cpu.md)


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.BatchNorm1d(64))  # parameters and buffers


@pytest.fixture(scope="module")
def context():
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", mem_fraction_static=MEM_FRACTION_STATIC)
    return create_context(server_args, role="scheduler")


def _profile(context, monkeypatch, taken_by_others: int, hooked: bool) -> int:
    """SGLang's reading before the load, the model loaded, available RAM down by its weights plus `taken_by_others`,
    then the KV budget in bytes from SGLang's `_profile_available_bytes`, stock or wrapped by the port's row as
    SGLang's HookRegistry wraps it."""
    from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.runtime_context import get_exec, get_parallel, use_context
    from sglang.srt.utils import common

    def available_ram(nbytes):
        monkeypatch.setattr(common.psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))

    monkeypatch.setattr(common, "get_instance_memory_status", lambda path: None)  # no cgroup limit
    monkeypatch.setattr(common, "get_cpu_ids_by_node", lambda: ["0,1"])  # one NUMA node
    profile = pkgutil.resolve_name(TARGET)
    if hooked:
        (row,) = (hook for hook in hooks.CPU_ENGINE if hook.target == TARGET)
        profile = _wrap_fn(profile, pkgutil.resolve_name(row.fn), HookType[row.kind.upper()])
    available_ram(AVAILABLE)
    with (use_context(context), get_parallel().override(world_group=SimpleNamespace(cpu_group=None)),
          get_exec().graph.override(cuda_graph_config=default_cuda_graph_config())):  # resolved at launch
        pre_model_load_memory = common.get_available_gpu_memory("cpu", 0)
        model = _tiny_model()
        available_ram(AVAILABLE - memory_profile.weight_bytes(model) - taken_by_others)
        configurator = SimpleNamespace(device="cpu", gpu_id=0, model=model, mambaish_config=None,
                                       post_capture_kv_active=False, model_config=SimpleNamespace(is_multimodal=False))
        return profile(configurator, pre_model_load_memory)


def test_weight_bytes_counts_parameters_and_buffers_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied: one storage
    # two biases and BatchNorm's weight, bias, running mean and var (float32), its num_batches_tracked (int64)
    assert memory_profile.weight_bytes(model) == (64 + 6 * 8) * 4 + 8


def test_kv_budget_ignores_ram_other_processes_take_during_the_load(context, monkeypatch):
    """Neighbours take 0.5 GiB, then 1.2 GiB, of 8 during the load: stock SGLang's budget shrinks by the first and
    it refuses to start under the second (as two servers started side by side did: "minimum viable 0.1496"); the
    hooked budget is the one without them."""
    alone = _profile(context, monkeypatch, 0, hooked=False)
    assert alone == int(MEM_FRACTION_STATIC * AVAILABLE) - memory_profile.weight_bytes(_tiny_model())
    assert _profile(context, monkeypatch, 0, hooked=True) == alone
    assert _profile(context, monkeypatch, GiB // 2, hooked=False) < alone
    for taken in (GiB // 2, int(1.2 * GiB)):
        assert _profile(context, monkeypatch, taken, hooked=True) == alone, \
            f"the hooked KV budget changed when other processes took {taken / GiB:.1f} GiB during the load"
    with pytest.raises(ValueError, match=r"leave no GPU memory for the KV cache.*minimum viable.*0\.15"):
        _profile(context, monkeypatch, int(1.2 * GiB), hooked=False)

    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.utils import common

    assert kv_cache_configurator.get_available_gpu_memory is common.get_available_gpu_memory  # SGLang's again
