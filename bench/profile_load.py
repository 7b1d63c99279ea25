"""Where a Tail-Replay server's time goes under load: py-spy samples of its scheduler process during a
`sglang.bench_serving` run, attributed to the plugin's modules.

    pip install py-spy   # not a project dependency: a profiler, used by hand
    python bench/profile_load.py [--preset small] [--flags "--enable-tail-replay"] [--workload "no reuse"] \
        [--prompts 24] [--rate inf] [--out runs/profile_load.json]

The scheduler is sampled (py-spy, 100 Hz, Python frames) while bench_serving sends the workload (bench/load.py's
datasets, tailreplay_eval/bench_serving.py). A sample counts for a plugin module when a frame of that module is on
its stack (the innermost one decides); the CPU port (`sglang_cpu_compat`) and `tailreplay_sglang/ops/` are not
counted, since stock SGLang on this CPU runs them too. Prints the share of samples per module and writes them with the
bench_serving record.
"""

import argparse
import collections
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tailreplay_eval import bench_serving, harness
from tailreplay_eval.server import ServerProcess

PLUGIN = "tailreplay_sglang/"
# The CPU port (a package of its own, whatever folder holds it) and the plugin's torch ops it serves as sgl-kernel:
# stock SGLang on this CPU runs them too
STOCK_ON_CPU = ("sglang_cpu_compat/", f"{PLUGIN}ops/")


def around_hook_bodies() -> set[str]:
    """Names of the plugin functions that wrap a stock SGLang function (`hooks.py`, kind "around"): a sample inside
    the function they wrap is stock's work, not theirs."""
    from tailreplay_sglang import hooks

    tables = (hooks.ALWAYS, hooks.MODEL_LOADER, hooks.RUNTIME, hooks.INTERVAL_ANCHORS)
    return {hook.fn.rpartition(":")[2] for table in tables for hook in table if hook.kind == "around"}


def attribute(stacks: str, wrappers: set[str] | None = None) -> tuple[int, collections.Counter]:
    """py-spy `raw` output (one 'frame;frame;... count' line per stack) -> (samples, samples per plugin module).
    A frame reads 'function (path/to/file.py:line)'. The innermost plugin frame decides, unless it is a wrapper
    (`around_hook_bodies`) whose next frame is not the plugin's: then the sample is in the stock function it wraps."""
    wrappers = around_hook_bodies() if wrappers is None else wrappers
    total, per_module = 0, collections.Counter()
    for line in stacks.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        total += int(count)
        frames = stack.split(";")
        ours = [i for i, f in enumerate(frames) if PLUGIN in f and not any(part in f for part in STOCK_ON_CPU)]
        if not ours:
            continue
        innermost = frames[ours[-1]]
        if innermost.split(" (")[0].rpartition(".")[2] in wrappers and ours[-1] + 1 < len(frames):
            continue  # inside the stock function the hook wraps
        path = innermost.rsplit("(", 1)[-1].split(":")[0]
        per_module[path[path.index(PLUGIN):]] += int(count)
    return total, per_module


def scheduler_pid(server: ServerProcess) -> int:
    return next(p.pid for p in psutil.Process(server.proc.pid).children(recursive=True) if "scheduler" in p.name())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "profile_load.json")
    ap.add_argument("--flags", default="--enable-tail-replay", help="the profiled server's Tail-Replay flags")
    ap.add_argument("--workload", choices=bench_serving.WORKLOADS, default="no reuse")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens of each prompt's first part (system_len)")
    ap.add_argument("--rate", default="inf")
    args = ap.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("bench/profile_load.py needs py-spy on PATH: pip install py-spy")
    run = harness.Run.begin(args)
    shape = argparse.Namespace(groups=1, prompts_per_group=args.prompts, system_len=args.prompt_len, question_len=64,
                               output_len=16, seed=args.seed)
    flags = (*run.server_args, *shlex.split(args.flags))
    stacks = run.out.with_suffix(".stacks.txt")
    with ServerProcess(str(run.model_path), flags, log_path=run.out.with_suffix(".server.log"),
                       max_total_tokens=32768, max_running_requests=16) as server:
        sampler = subprocess.Popen([spy, "record", "--pid", str(scheduler_pid(server)), "--rate", "100", "--format",
                                    "raw", "--output", str(stacks), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)  # py-spy attached
        record = bench_serving.run(server, run.model_path, args.workload, float(args.rate), shape,
                                   run.out.with_suffix(".bench_serving.jsonl"))
        sampler.send_signal(2)  # SIGINT: py-spy writes its output and exits
        sampler.wait(120)
    total, per_module = attribute(stacks.read_text())
    print(f"{total} scheduler samples; plugin modules (outside ops/): "
          f"{100 * sum(per_module.values()) / max(total, 1):.2f} %")
    for module, n in per_module.most_common():
        print(f"  {100 * n / total:6.2f} %  {module}")
    run.out.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
        "flags": list(flags), "workload": args.workload, "samples": total,
        "share_per_module": {m: n / total for m, n in per_module.items()},
        "summary": bench_serving.summary(record)}, indent=1))
    print(f"wrote {run.out}")


if __name__ == "__main__":
    main()
