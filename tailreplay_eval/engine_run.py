"""Run a scripted workload through `sglang.Engine` in a process of its own (tests/test_python_api.py).

    python -m tailreplay_eval.engine_run SPEC.json OUT.json

Its own process because `Engine.shutdown()` kills every child process of the process it runs in (SGLang's
`kill_process_tree(os.getpid(), include_parent=False)`), which in a test run would take the shared servers down too.

SPEC: `model_path`, `keywords` (Engine keywords), `sampling_params`, and two workloads on a flushed cache:
- `batch`: `{"first": ids, "batch": [ids, ...], "logprobs": {...}}`: `first` alone, then the batch in one
  `generate` call with the `logprobs` keywords (`return_logprob`, `logprob_start_len`, `top_logprobs_num`), if any;
- `conversation`: `{"start": ids, "turns": [ids, ...]}`: each turn appends its ids to the conversation so far
  (previous prompt + answer); turn 1 goes through `async_generate`.
OUT: what each request reported (`output_ids`, `meta_info`), the Engine's child PIDs and which of them were still
alive after `shutdown()`.
"""

import json
import sys
import time


def flush(engine, timeout: float = 30.0) -> None:
    """`Engine.flush_cache()`, retried: SGLang refuses a flush while a finished request is still in its running batch
    (it leaves on the scheduler's next step, after its output went out), and says so only in the result."""
    deadline = time.monotonic() + timeout
    while not getattr(engine.flush_cache(), "success", True):
        if time.monotonic() > deadline:
            raise RuntimeError("Engine.flush_cache() kept being refused")
        time.sleep(0.2)


def summary(out: dict) -> dict:
    return {"output_ids": out["output_ids"], "meta_info": out["meta_info"]}


def run_batch(engine, spec: dict, params: dict) -> list[dict]:
    flush(engine)
    first = engine.generate(input_ids=spec["first"], sampling_params=params)
    batch = engine.generate(input_ids=spec["batch"], sampling_params=params, **spec.get("logprobs", {}))
    return [summary(first), *map(summary, batch)]


def run_conversation(engine, spec: dict, params: dict) -> list[dict]:
    flush(engine)
    ids, outs = list(spec["start"]), []
    for turn, new in enumerate(spec["turns"]):
        ids = ids + new
        if turn == 1:
            out = engine.loop.run_until_complete(engine.async_generate(input_ids=ids, sampling_params=params))
        else:
            out = engine.generate(input_ids=ids, sampling_params=params)
        outs.append(summary(out))
        ids = ids + out["output_ids"]
    return outs


def main(spec_path: str, out_path: str) -> None:
    import psutil
    import sglang

    spec = json.loads(open(spec_path).read())
    engine = sglang.Engine(model_path=spec["model_path"], **spec["keywords"])
    try:
        result = {"batch": run_batch(engine, spec["batch"], spec["sampling_params"]),
                  "conversation": run_conversation(engine, spec["conversation"], spec["sampling_params"])}
        children = [psutil.Process(pid) for pid in engine.get_all_child_pids()]
    finally:
        engine.shutdown()
    _, alive = psutil.wait_procs(children, timeout=30)
    result.update(child_pids=[c.pid for c in children], alive_after_shutdown=[c.pid for c in alive])
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
