"""GDN replay kernels at Qwen3.5-4B's GDN shapes against a floor measured on this machine (docs/perf.md).

    python bench/kernel_bench.py [--device auto|cpu|cuda] [--lengths 256 1024 4096] [--requests 1 4]
                                 [--per-token-tokens 256] [--passes 3] [--threads N] [--out runs/kernels.json]

Where this package is not installed (a GPU machine), run it from the repository root as
`PYTHONPATH=. python bench/kernel_bench.py ...` (or `pip install -e . --no-deps` first).

One GDN layer (16 key heads, 32 value heads, K = V = 128) replays N tails of k tokens each from zero state and
writes the final states into mamba slots. Variants:
- GPU (bfloat16): the Triton kernel state-only and with outputs, what a replay dispatches to (that kernel, or for
  tails past `CHUNK_KERNEL_FROM` tokens fla's chunk kernel as SGLang ships it, states in place), fla's
  chunk_gated_delta_rule (outputs + final state, gating and l2norm in kernel, states then scattered into the
  slots), and the per-token loop;
- CPU (float32): the chunked torch replay state-only and with outputs, and the per-token loop; the grid runs
  --passes times and each cell keeps its best time, as other work on a shared CPU comes in bursts.
The per-token loop is the decode op (`tailreplay_sglang.ops.gdn.recurrent_gated_delta_rule_update`, all tails
advance one token per step); it runs on at most --per-token-tokens tokens per tail and is scaled linearly to k.
Floor = max(bytes moved / copy bandwidth, chunk-form FLOPs / matmul rate), both measured here; a state-only
variant is compared with the state-only floor, the others with the floor that includes the outputs.
Prints a table, writes JSON and a PNG plot of time against tail length.
"""

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tailreplay_sglang.kernels import gdn_replay, gdn_replay_fwd, gdn_replay_torch
from tailreplay_sglang.ops import gdn as cpu_gdn

# Not named kernels.py: Python puts a script's folder first on the module search path, where a bench/kernels.py
# would shadow the `kernels` package that SGLang depends on (transformers and SGLang's FA3 loader import it) for
# every script run from bench/.
ROOT = Path(__file__).resolve().parents[1]

H, HV, K, V = 16, 32, 128, 128
FLOOR_CHUNK = 64  # chunk length of the chunk-form FLOP count
DEFAULTS = {  # the CPU grid is smaller so the run takes a few minutes
    "cpu": {"lengths": [256, 1024, 4096], "requests": [1, 4], "per_token_tokens": 256, "passes": 3,
            "dtype": torch.float32},
    "cuda": {"lengths": [256, 1024, 4096], "requests": [1, 8, 32], "per_token_tokens": 256, "passes": 1,
             "dtype": torch.bfloat16},
}
PER_TOKEN = "per-token loop"


def time_call(fn, device: str, reps: int = 1) -> float:
    """Seconds per call: triton's do_bench (median) on CUDA, the best of `reps` after a warm-up call on CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: str) -> float:
    """Bytes per second of a large tensor copy (read + write)."""
    src = torch.randn((256 if device == "cpu" else 2048) * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / time_call(lambda: dst.copy_(src), device, reps=3)


def measure_matmul(device: str, dtype) -> float:
    """FLOP per second of a large square matmul in the benchmark's dtype."""
    n = 2048 if device == "cpu" else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / time_call(lambda: a @ b, device, reps=3)


def floor_seconds(T: int, N: int, elem_bytes: int, with_output: bool, bandwidth: float, matmul_rate: float):
    """max(bytes / bandwidth, FLOPs / matmul rate) for N tails, T tokens in all.

    Bytes: q, k, v, a, b read once, final fp32 states written, outputs written. FLOPs per token and value head, in
    chunks of C: K K^T (2CK), the state's two products (4KV), the WY inverse applied (2CV); outputs add q S^T (2KV),
    q K^T (2CK) and its product with u (2CV).
    """
    C = FLOOR_CHUNK
    moved = T * (2 * H * K + HV * V + 2 * HV) * elem_bytes + N * HV * V * K * 4
    flops = T * HV * (2 * C * K + 4 * K * V + 2 * C * V)
    if with_output:
        moved += T * HV * V * elem_bytes
        flops += T * HV * (2 * K * V + 2 * C * K + 2 * C * V)
    return max(moved / bandwidth, flops / matmul_rate)


def make_inputs(N: int, k: int, device: str, dtype):
    T = N * k
    q, k_, v = (torch.randn(T, h, d, device=device, dtype=dtype) for h, d in ((H, K), (H, K), (HV, V)))
    a, b = (torch.randn(T, HV, device=device, dtype=dtype) for _ in range(2))
    A_log, dt_bias = torch.rand(HV, device=device).log(), torch.randn(HV, device=device)
    cu = torch.arange(N + 1, device=device, dtype=torch.int32) * k
    slots = torch.arange(N, device=device)
    pool = torch.zeros(N, HV, V, K, device=device)
    return dict(q=q, k=k_, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, cu=cu, slots=slots, pool=pool)


def variants(device: str):
    """name -> (writes outputs, fn(inputs) running one replay)."""
    def torch_chunked(state_only):
        def run(x):
            _, final = gdn_replay_torch(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["cu"],
                                        state_only=state_only)
            x["pool"][x["slots"]] = final
        return run

    def triton_kernel(state_only):
        return lambda x: gdn_replay_fwd(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["cu"],
                                        x["slots"], x["pool"], state_only=state_only)

    def dispatched(x):  # what a replay runs: the kernel above, or fla's chunk kernel for long tails
        gdn_replay(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["cu"], x["slots"], x["pool"],
                   x["max_tail"])

    if device == "cpu":
        return {"torch chunked, state only": (False, torch_chunked(True)),
                "torch chunked + outputs": (True, torch_chunked(False)),
                PER_TOKEN: (True, per_token_loop)}
    return {"triton, state only": (False, triton_kernel(True)),
            "triton + outputs": (True, triton_kernel(False)),
            "replay (dispatched) + outputs": (True, dispatched),
            "fla chunk + outputs": (True, fla_chunk),
            PER_TOKEN: (True, per_token_loop)}


def fla_chunk(x):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu = x["cu"].long()
    _, final = chunk_gated_delta_rule(
        x["q"][None], x["k"][None], x["v"][None], g=x["a"][None], beta=x["b"][None], A_log=x["A_log"],
        dt_bias=x["dt_bias"], use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True,
        output_final_state=True, state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=x["cu_cpu"],
    )
    x["pool"][x["slots"]] = final


def per_token_loop(x):
    x["pool"][x["slots"]] = 0  # a replay starts from zero; the decode op reads the slot
    cpu_gdn.recurrent_gated_delta_rule_update(
        x["A_log"], x["dt_bias"], x["q"][None], x["k"][None], x["v"][None], x["a"], x["b"], x["pool"], x["slots"],
        x["cu"], use_qk_l2norm_in_kernel=True,
    )


def measured_tokens(name: str, k: int, per_token_tokens: int) -> int:
    return min(k, per_token_tokens) if name == PER_TOKEN else k


def bench_config(device, dtype, N, k, per_token_tokens) -> dict[str, float]:
    """Seconds of each variant on N tails of k tokens (the per-token loop scaled from fewer tokens)."""
    full = make_inputs(N, k, device, dtype)
    seconds = {}
    for name, (_, fn) in variants(device).items():
        m = measured_tokens(name, k, per_token_tokens)
        x = full if m == k else make_inputs(N, m, device, dtype)
        x["cu_cpu"], x["max_tail"] = x["cu"].cpu().long(), m
        with torch.inference_mode():
            seconds[name] = time_call(lambda: fn(x), device) * k / m
    return seconds


def make_row(device, dtype, N, k, per_token_tokens, seconds: dict[str, float], rates):
    """A table row: the floors and each variant's time with its ratio to its floor."""
    elem = torch.finfo(dtype).bits // 8
    floors = {w: floor_seconds(N * k, N, elem, w, *rates) for w in (False, True)}
    row = {"tail_tokens": k, "requests": N, "floor_state_s": floors[False], "floor_output_s": floors[True],
           "variants": {}}
    for name, (with_output, _) in variants(device).items():
        m = measured_tokens(name, k, per_token_tokens)
        row["variants"][name] = {"seconds": seconds[name], "ratio": seconds[name] / floors[with_output],
                                 "measured_tokens": m, "extrapolated": m != k}
    return row


def machine(device: str) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    desc = f"{cpu}, {torch.get_num_threads()} threads"
    return f"{torch.cuda.get_device_name()} ({desc})" if device == "cuda" else desc


def print_table(rows, device, rates, console):
    bandwidth, matmul_rate = rates
    table = Table(title=f"GDN replay, Qwen3.5-4B layer (H={H}, HV={HV}, K=V={K}), {device}: "
                        f"copy {bandwidth / 1e9:.1f} GB/s, matmul {matmul_rate / 1e12:.2f} TFLOP/s")
    names = list(rows[0]["variants"])
    for col in ["tail", "req", "floor state / +out (ms)", *names]:
        table.add_column(col, justify="right")
    for row in rows:
        cells = []
        for name in names:
            v = row["variants"][name]
            cells.append(f"{v['seconds'] * 1e3:.2f}{'*' if v['extrapolated'] else ''} ({v['ratio']:.1f}x)")
        floor = f"{row['floor_state_s'] * 1e3:.2f} / {row['floor_output_s'] * 1e3:.2f}"
        table.add_row(str(row["tail_tokens"]), str(row["requests"]), floor, *cells)
    console.print(table)
    console.print("ms per replay (ratio to the floor); * = per-token loop timed on "
                  f"{rows[0]['variants'][PER_TOKEN]['measured_tokens']} tokens per tail, scaled linearly")


def print_speedup(rows, device, console):
    """Target (reported, not asserted): chunked at least 5x faster than the per-token loop at 4096 tokens."""
    chunked = "torch chunked + outputs" if device == "cpu" else "triton + outputs"
    for row in rows:
        if row["tail_tokens"] == 4096:
            v = row["variants"]
            speedup = v[PER_TOKEN]["seconds"] / v[chunked]["seconds"]
            console.print(f"{chunked} vs {PER_TOKEN}, 4096 tokens x {row['requests']} requests: {speedup:.1f}x "
                          f"faster (target >= 5x){' [per-token extrapolated]' if v[PER_TOKEN]['extrapolated'] else ''}")


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = sorted({r["requests"] for r in rows})
    fig, axes = plt.subplots(1, len(requests), figsize=(5 * len(requests), 4), squeeze=False)
    for ax, n in zip(axes[0], requests):
        sub = [r for r in rows if r["requests"] == n]
        lengths = [r["tail_tokens"] for r in sub]
        for name in sub[0]["variants"]:
            ax.plot(lengths, [r["variants"][name]["seconds"] * 1e3 for r in sub], marker="o", label=name)
        for key, label in (("floor_state_s", "floor, state"), ("floor_output_s", "floor, + outputs")):
            ax.plot(lengths, [r[key] * 1e3 for r in sub], linestyle="--", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tail tokens", ylabel="ms", title=f"{n} request(s)")
        ax.set_xticks(lengths, labels=[str(length) for length in lengths], minor=False)
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", help="tail tokens (default: per device)")
    ap.add_argument("--requests", type=int, nargs="+", help="tails per replay (default: per device)")
    ap.add_argument("--per-token-tokens", type=int, help="tokens per tail the per-token loop is timed on")
    ap.add_argument("--passes", type=int, help="passes over the grid, best time kept (default: CPU 3, GPU 1)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's, one per core)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "kernels.json"))
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg = DEFAULTS[device]
    lengths, requests = args.lengths or cfg["lengths"], args.requests or cfg["requests"]
    per_token_tokens = args.per_token_tokens or cfg["per_token_tokens"]
    passes = args.passes or cfg["passes"]
    if args.threads:
        torch.set_num_threads(args.threads)

    console = Console(width=160)  # wide enough that table rows never wrap when piped
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    # repeated passes keep the best of each cell: bursts of other work on a shared CPU rarely hit a cell every time
    bandwidth, matmul_rate, best = 0.0, 0.0, {}
    for i in range(passes):
        bandwidth = max(bandwidth, measure_bandwidth(device))
        matmul_rate = max(matmul_rate, measure_matmul(device, cfg["dtype"]))
        for N in requests:
            for k in lengths:
                for name, t in bench_config(device, cfg["dtype"], N, k, per_token_tokens).items():
                    best[N, k, name] = min(best.get((N, k, name), math.inf), t)
        console.log(f"pass {i + 1}/{passes} done")
    rates = (bandwidth, matmul_rate)
    rows = [make_row(device, cfg["dtype"], N, k, per_token_tokens,
                     {name: t for (n, length, name), t in best.items() if (n, length) == (N, k)}, rates)
            for N in requests for k in lengths]
    print_table(rows, device, rates, console)
    print_speedup(rows, device, console)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device, "machine": machine(device),
        "dtype": str(cfg["dtype"]), "shape": {"H": H, "HV": HV, "K": K, "V": V}, "copy_bytes_per_s": rates[0],
        "matmul_flops_per_s": rates[1], "passes": passes, "rows": rows, "wall_s": time.perf_counter() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }, indent=2))
    plot(rows, out.with_suffix(".png"))
    console.print(f"{machine(device)}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
                  f"wrote {out} and {out.with_suffix('.png')} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
