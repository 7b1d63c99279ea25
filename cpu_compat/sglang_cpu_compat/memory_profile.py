"""The KV pool's budget on a CPU is charged with what this process loaded, not with what the machine lost meanwhile.

SGLang sizes the pool from two readings of free memory, one before the model loads (`pre`) and one after: budget =
free after - pre * (1 - mem_fraction_static). On a GPU the drop between them is this process's weights; on a CPU
the reading is the machine's available RAM (psutil), so whatever other processes take during the load (a second
server starting beside this one) is charged as weights too, and a drop of more than pre * mem_fraction_static
refuses to start ("Loaded weights leave no GPU memory for the KV cache ... minimum viable ..."). Here the reading
after the load is pre less the loaded model's weights, so the budget no longer depends on the neighbours.
"""

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied or shared weights count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


def budget_from_own_load(original, self, pre_model_load_memory):
    """AROUND `KVCacheConfigurator._profile_available_bytes`: SGLang's own sizing (slack, mamba share, its error)
    over a free-memory reading of `pre_model_load_memory` less the weights, in GB, MIN-reduced over ranks as SGLang's
    reading is. A draft model loaded into this process is not charged (its few layers are far within the slack)."""
    from sglang.srt.mem_cache import kv_cache_configurator as configurator

    if self.device != "cpu":
        return original(self, pre_model_load_memory)
    free_after_load = pre_model_load_memory - weight_bytes(self.model) / (1 << 30)

    def reading(device, gpu_id, distributed=False, cpu_group=None, **_):
        free = torch.tensor(free_after_load, dtype=torch.float64)
        if distributed:
            torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
        return free.item()

    sglang_reading = configurator.get_available_gpu_memory
    configurator.get_available_gpu_memory = reading  # read only by the call below (it runs in the scheduler's init)
    try:
        return original(self, pre_model_load_memory)
    finally:
        configurator.get_available_gpu_memory = sglang_reading
