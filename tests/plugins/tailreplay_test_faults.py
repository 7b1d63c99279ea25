"""Test-only SGLang plugin: fault injection for the reliability tests, kept out of the package.

SGLang finds it through the `sglang.srt.plugins` entry point in the dist-info beside it, in every process of a server
started with this folder on PYTHONPATH (`tests/helpers.py: faults_env`). With `TAILREPLAY_FAULT_REPLAY_DELAY_S` set
it holds every replay pass that ran for that long, so that aborts, evictions and new arrivals land while a replay is
in flight; with `TAILREPLAY_FAULT_EVENTS` naming a file it appends a JSON line per held pass before holding it
(`{"held": [rid, ...], "t": time.time()}`), so a test waits for the hold it needs and shows that it happened (the
`FaultEvents` helper in tests/helpers.py). With `TAILREPLAY_FAULT_DROP_MODEL_ATTR` set to a path below a decoder
layer (`linear_attn.norm`), that attribute is deleted from the class that owns it once the model is loaded, as a
renamed SGLang model internal would be missing. With `TAILREPLAY_FAULT_CUT_PREFIX` set, a request whose rid
starts with `cut<N>-` extends from at most N tokens although its match planned for more (its prefix cut after the
match, before the batch's `prepare_for_extend`, the tree lock kept): the scheduler settling on a shorter prefix than
the one the match planned for, which Tail-Replay answers by retargeting the hit (`cache/request.py: retarget`).
With `TAILREPLAY_FAULT_RAISE` set, a replay pass that served a request whose rid starts with `raise-` raises
`ReplayFault` once it has run (on that request's rank only: a fault on one rank of a DP-attention server).
With `TAILREPLAY_WATCH_POOL_WRITES` naming a file, every write to the mamba pool's slots (`MambaPool.clear_slots`,
`copy_from`) is checked against whether a forward is running: each one made outside a forward appends a JSON line
(`{"outside_forward": method}`), and the first one inside a forward appends `{"inside_forward": method}` (the watch
is live). A watch, not a fault: the stream-order argument device anchors rest on (docs/design.md, GPU path review
F1) holds only while no mamba slot is written outside a forward under the overlap scheduler.
With `TAILREPLAY_FAULT_NEIGHBOUR_SHARE` set to a fraction, a neighbour process takes that share of the machine's
available RAM (written, so resident) between SGLang's first free-memory reading and the KV pool's sizing, and gives
it back once the pools exist: another server starting beside this one, at the worst moment, every time (issue 65 item
3; it prints `test neighbour holds <GiB> GiB during the load` to the server's log).
With `TAILREPLAY_DUMP_REPLAYED_STATES` naming a folder, every replay pass saves the recurrent states it rebuilt for
each request whose rid starts with `dump-`, as `{"temporal": {layer id: [HV, V, K]}, "conv": {layer id: [dim, K - 1]},
"conv1": {layer id: ...}}` (float32; a pool without recurrent states, LFM2's, has no "temporal" entries; "conv1" holds a
second conv state where the pool keeps one, ZAYA1's previous input) in `<folder>/<rid>.pt`: a probe,
so that a test compares rebuilt states with HF's directly (issue 65 class 10: a fault in the replay's feed-forward
collectives moved the next tokens' log-probs by only about the exactness tolerance on the tiny models).
With `TAILREPLAY_TEST_HOST_RESERVE_GIB` set, SGLang keeps that much host memory free of its HiCache host pools instead
of 10 GiB (`pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`, a margin for a production host's OS and neighbours). Not
a fault: the test machine's setting. Its 24 GiB hold two workers' servers at about 1.7 GB each, so with 10 GiB kept
free a HiCache server's start (host pools of tens of MB) depended on what the other worker had up and was refused
("Requesting 0.00 GB but only have -0.11 GB free": clean-clone CI runs of 749ceda, 810d1d2 and e2fee35). It prints
`test host reserve <GiB> GiB` to the server's log.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

DELAY_ENV = "TAILREPLAY_FAULT_REPLAY_DELAY_S"
EVENTS_ENV = "TAILREPLAY_FAULT_EVENTS"
TARGET = "tailreplay_sglang.replay.run_pending"  # returns the replayed batch, or None when nothing ran
DROP_ENV = "TAILREPLAY_FAULT_DROP_MODEL_ATTR"
LOADED = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"  # the model is loaded; pools next
CUT_ENV = "TAILREPLAY_FAULT_CUT_PREFIX"
EXTEND = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
CUT_RID = re.compile(r"cut(\d+)-")
RAISE_ENV = "TAILREPLAY_FAULT_RAISE"
WATCH_ENV = "TAILREPLAY_WATCH_POOL_WRITES"
DUMP_ENV = "TAILREPLAY_DUMP_REPLAYED_STATES"
NEIGHBOUR_ENV = "TAILREPLAY_FAULT_NEIGHBOUR_SHARE"
RESERVE_ENV = "TAILREPLAY_TEST_HOST_RESERVE_GIB"
LOAD = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"  # after the first free-memory reading
# the neighbour: n bytes written (so resident), "ready", then held until its stdin closes (its server gone or done)
NEIGHBOUR = "import sys\nblock = b'\\x01' * int(sys.argv[1])\nprint('ready', flush=True)\nsys.stdin.read()\n"
FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
POOL_WRITES = ("sglang.srt.mem_cache.memory_pool.MambaPool.clear_slots",
               "sglang.srt.mem_cache.memory_pool.MambaPool.copy_from")


class ReplayFault(RuntimeError):
    """The injected failure of a replay pass (`TAILREPLAY_FAULT_RAISE`)."""


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get(DROP_ENV):
        HookRegistry.register(LOADED, drop_model_attr, HookType.BEFORE)
    if os.environ.get(CUT_ENV):
        HookRegistry.register(EXTEND, cut_prefixes, HookType.BEFORE)
    if os.environ.get(RAISE_ENV):
        HookRegistry.register(TARGET, raise_after_replay, HookType.AFTER)
    if os.environ.get(WATCH_ENV):
        watch = PoolWriteWatch(os.environ[WATCH_ENV])
        HookRegistry.register(FORWARD, watch.forward, HookType.AROUND)
        for target in POOL_WRITES:
            HookRegistry.register(target, watch.writer(target.rsplit(".", 1)[1]), HookType.BEFORE)
    if os.environ.get(NEIGHBOUR_ENV):
        neighbour = Neighbour(float(os.environ[NEIGHBOUR_ENV]))
        HookRegistry.register(LOAD, neighbour.arrive, HookType.BEFORE)
        HookRegistry.register(LOADED, neighbour.around_pools, HookType.AROUND)
    if os.environ.get(DUMP_ENV):
        HookRegistry.register(TARGET, dump_replayed_states, HookType.AFTER)
    if os.environ.get(RESERVE_ENV):
        from sglang.srt.mem_cache.pool_host import base  # read at each sizing (host_memory_budget_bytes)

        base.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(float(os.environ[RESERVE_ENV]) * 2**30)
        print(f"test host reserve {base.HICACHE_HOST_MEMORY_RESERVE_BYTES / 2**30:g} GiB", file=sys.stderr, flush=True)
    delay = float(os.environ.get(DELAY_ENV, "0"))
    if delay <= 0:
        return

    events = os.environ.get(EVENTS_ENV)

    def hold_replay(result, *args, **kwargs):
        if result is not None:
            if events:
                with open(events, "a") as f:  # one write of one line: readers never see half of it
                    f.write(json.dumps({"held": [req.rid for req in result.reqs], "t": time.time()}) + "\n")
            time.sleep(delay)
        return result

    HookRegistry.register(TARGET, hold_replay, HookType.AFTER)


def drop_model_attr(runner, *args, **kwargs):
    """Delete the attribute at DROP_ENV's path from the class owning it on the first decoder layer that has it."""
    *owner_path, name = os.environ[DROP_ENV].split(".")
    for layer in runner.model.model.layers:
        owner = layer
        for part in owner_path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(type(owner), name):
            delattr(type(owner), name)
            return


def cut_prefixes(batch, *args, **kwargs):
    """Shorten the prefix of each first-round request whose rid asks for it (`cut<N>-...`). The KV of the cut part
    is read off the path to the locked match node as far as the new prefix only (`prefix_device_indices`), and the
    extend computes the rest anew; `cache_protected_len` follows, so the insert frees the recomputed duplicates."""
    for req in batch.reqs:
        cut = CUT_RID.match(str(req.rid))
        if cut and not req.kv.holds_kv and req.prefix_len > int(cut[1]):
            req.prefix_len = req.kv.cache_protected_len = int(cut[1])


def raise_after_replay(result, *args, **kwargs):
    """Fail the replay pass that served a `raise-` request, after it ran."""
    rids = [str(req.rid) for req in result.reqs] if result is not None else []
    if any(rid.startswith("raise-") for rid in rids):
        raise ReplayFault(f"injected replay fault for {rids}")
    return result


def dump_replayed_states(result, runner, *args, **kwargs):
    """Save the states the pass rebuilt for each `dump-` request: its mamba slot holds them until its extend runs."""
    import torch

    if result is None:
        return result
    pool = runner.req_to_token_pool
    for req, slot in zip(result.reqs, result.mamba_slots.tolist()):
        if str(req.rid).startswith("dump-"):
            caches = {layer_id: pool.mamba2_layer_cache(layer_id) for layer_id in pool.mamba_map}
            states = {"conv": {i: c.conv[0][slot].float().clone() for i, c in caches.items()},
                      # a second conv state where the pool has one (ZAYA1's prev_hs: the layer's last input)
                      "conv1": {i: c.conv[1][slot].float().clone() for i, c in caches.items() if len(c.conv) > 1},
                      "temporal": {i: c.temporal[slot].float().clone() for i, c in caches.items()
                                   if getattr(c, "temporal", None) is not None and c.temporal.numel()}}
            torch.save(states, Path(os.environ[DUMP_ENV]) / f"{req.rid}.pt")
    return result


class Neighbour:
    """Another process taking a share of the available RAM while this server loads and sizes its pools
    (`NEIGHBOUR_ENV`)."""

    def __init__(self, share: float):
        self.share, self.proc = share, None

    def arrive(self, *args, **kwargs):
        import psutil

        size = int(psutil.virtual_memory().available * self.share)
        self.proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the test neighbour did not start")
        print(f"test neighbour holds {size / (1 << 30):.2f} GiB during the load", flush=True)

    def around_pools(self, original, *args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            if self.proc is not None:
                self.proc.stdin.close()
                self.proc.wait()
                self.proc = None


class PoolWriteWatch:
    """Whether each mamba-pool slot write happens inside a forward (`WATCH_ENV`)."""

    def __init__(self, path: str):
        self.path, self.depth, self.seen_inside = path, 0, False

    def forward(self, original, *args, **kwargs):
        self.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            self.depth -= 1

    def writer(self, method: str):
        def check(*args, **kwargs):
            if self.depth == 0:
                self._log({"outside_forward": method})
            elif not self.seen_inside:
                self.seen_inside = True
                self._log({"inside_forward": method})
        return check

    def _log(self, record: dict) -> None:
        with open(self.path, "a") as f:  # one write of one line
            f.write(json.dumps({**record, "pid": os.getpid(), "t": time.time()}) + "\n")
