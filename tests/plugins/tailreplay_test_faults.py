"""Test-only SGLang plugin: fault injection for the reliability tests, kept out of the package.

SGLang finds it through the `sglang.srt.plugins` entry point in the dist-info beside it, in every process of a server
started with this folder on PYTHONPATH (`tests/helpers.py: FAULTS_ENV`). With `TAILREPLAY_FAULT_REPLAY_DELAY_S` set
it holds every replay pass that ran for that long, so that aborts, evictions and new arrivals land while a replay is
in flight.
"""

import os
import time

DELAY_ENV = "TAILREPLAY_FAULT_REPLAY_DELAY_S"
TARGET = "tailreplay_sglang.replay.run_pending"  # returns the replayed batch, or None when nothing ran


def register() -> None:
    delay = float(os.environ.get(DELAY_ENV, "0"))
    if delay <= 0:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def hold_replay(result, *args, **kwargs):
        if result is not None:
            time.sleep(delay)
        return result

    HookRegistry.register(TARGET, hold_replay, HookType.AFTER)
