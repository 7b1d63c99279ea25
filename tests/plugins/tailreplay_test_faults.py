"""Test-only SGLang plugin: fault injection for the reliability tests, kept out of the package.

SGLang finds it through the `sglang.srt.plugins` entry point in the dist-info beside it, in every process of a server
started with this folder on PYTHONPATH (`tests/helpers.py: faults_env`). With `TAILREPLAY_FAULT_REPLAY_DELAY_S` set
it holds every replay pass that ran for that long, so that aborts, evictions and new arrivals land while a replay is
in flight; with `TAILREPLAY_FAULT_EVENTS` naming a file it appends a JSON line per held pass before holding it
(`{"held": [rid, ...], "t": time.time()}`), so a test waits for the hold it needs and shows that it happened (the
`FaultEvents` helper in tests/helpers.py). With `TAILREPLAY_FAULT_DROP_MODEL_ATTR` set to a path below a decoder
layer (`linear_attn.norm`), that attribute is deleted from the class that owns it once the model is loaded, as a
renamed SGLang model internal would be missing.
"""

import json
import os
import time

DELAY_ENV = "TAILREPLAY_FAULT_REPLAY_DELAY_S"
EVENTS_ENV = "TAILREPLAY_FAULT_EVENTS"
TARGET = "tailreplay_sglang.replay.run_pending"  # returns the replayed batch, or None when nothing ran
DROP_ENV = "TAILREPLAY_FAULT_DROP_MODEL_ATTR"
LOADED = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"  # the model is loaded; pools next


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get(DROP_ENV):
        HookRegistry.register(LOADED, drop_model_attr, HookType.BEFORE)
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
