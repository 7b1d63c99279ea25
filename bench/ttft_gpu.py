"""The paper's Table 2 on one GPU, without SGLang: TTFT of full prefill against Tail-Replay hits.

    python bench/ttft_gpu.py [--device cuda] [--lengths 8192 16384 32768] [--ratios 0.05 0.1] [--reps 20]
                             [--warmup 3] [--suffix 64] [--check-length 2048] [--out runs/ttft_gpu.json]
    python bench/ttft_gpu.py --small --device cpu      # tiny model and lengths, for CI (tests/test_ttft_gpu.py)

On a machine where this package is not installed (the GPU machines), run it from the repository root with the root on
the import path: `PYTHONPATH=. python bench/ttft_gpu.py ...` (or install it first: `pip install -e . --no-deps`).

A Qwen3.5-4B-shaped hybrid with random weights is built from transformers' Qwen3.5 modules (needs torch, triton,
transformers and, on a GPU, fla-core; no SGLang). For each matched-prefix length m, the prefix is run once, untimed,
to fill a host cache in pinned memory: each FA layer's K/V, the residual-stream value entering every stored group,
the token ids (what the server keeps). Then, per length, the mean of --reps timed runs after --warmup runs of:
- full: a cold prefill of the m prefix tokens plus a --suffix-token suffix (transformers' forward; fla GDN kernels);
- H2D-SER: a hit on the m-token prefix at replay ratio r: copy the FA KV and the k = ceil(r m) tail tokens' hiddens
  host -> device on the compute stream, replay every group's GDN layers over the tail with this project's kernels
  (`kernels.replay.replay_gdn_layer`, each group from zero state), then the suffix forward over the copied KV and the
  rebuilt states; every layer of the replay runs completely (outputs, FFN);
- H2D-OVL+skip: the same hit with the copies on a copy stream overlapped with the replay (`transfer.HostToDevice`:
  each FA layer waits only for its own KV) and the tail-FFN skip: the last GDN layer of each group computes only
  its states, as the server's replay does.
Each timed run goes from the first copy (or the prefill) to the first token's argmax, synchronized.

Before timing, a check at replay ratio 1 (the whole prefix replayed, which is exact up to float error): the suffix
logits of SER, OVL and OVL+skip must match the full prefill's, SER and OVL must be bitwise equal (streams change only
timing), and zero GDN states must do worse than the replay (so the check can see a wrong state). The script prints
the table in the paper's layout, writes JSON, and exits 1 when the check failed.
"""

import argparse
import datetime
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tailreplay_eval import models
from tailreplay_eval.reference import force_torch_gdn
from tailreplay_sglang.config import TailReplayConfig
from tailreplay_sglang.kernels.replay import replay_gdn_layer, replay_gdn_layer_triton
from tailreplay_sglang.layout import HybridLayout
from tailreplay_sglang.store.transfer import HostToDevice, pin

ROOT = Path(__file__).resolve().parents[1]

# Qwen3.5-4B's text config (Qwen/Qwen3.5-4B, config.json `text_config`): 32 layers, every 4th full attention
# (8 groups, 7 of them fed by stored hiddens); hidden 2560, FFN 9216, vocab 248320, tied embeddings; FA: 16 query heads,
# 4 KV heads, head dim 256; GDN: 16 key heads, 32 value heads, head dim 128, conv width 4. Cross-checks within this
# project: bench/kernel_bench.py uses the same GDN heads; DESIGN.md's 32 KiB of FA KV (8 x K,V x 4 x 256 x 2 B) and
# 35 KiB of stored hiddens (7 x 2560 x 2 B) per token in bf16. About 4.2B parameters.
QWEN35_4B = models.Preset(
    model_type="qwen3_5_text", num_hidden_layers=32, hidden_size=2560, intermediate_size=9216, vocab_size=248320,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_head_dim=128,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=262144, dtype="bfloat16",
)
# A full default run on an H200 is planned at about 3 minutes (docs/perf.md); --small is for CPUs and CI.
DEFAULTS = {
    "full": dict(preset=QWEN35_4B, lengths=[8192, 16384, 32768], reps=20, warmup=3, suffix=64, check_length=2048,
                 threads=None),
    "small": dict(preset=models.PRESETS["tiny-qwen35"], lengths=[256, 512], reps=3, warmup=1, suffix=16,
                  check_length=128, threads=1),
}
# The ratio-1 check compares suffix logits as max |difference| / max |reference logit|. float32 on a CPU: only
# summation order differs, so the bound is absolute. On a GPU (any dtype) the replay kernels (chunks of 16) and fla
# (chunks of 64, TF32 in its solve even for float32) round differently and 32 random layers amplify it (8 layers of
# Qwen3.5-4B widths in bf16 on a CPU: 3.6e-2, against 1.35 for zero states), so the bound is relative: the replay
# must close at least 90% of the gap that zero GDN states leave. A wrong state, conv window or layout leaves most of
# that gap.
FP32_TOLERANCE = 1e-4
GPU_FRACTION_OF_ZERO = 0.1
# --replay-kernels: "auto" is what the server does (Triton on CUDA, torch ops on CPU); "triton" forces the Triton
# kernels, which on a CPU needs TRITON_INTERPRET=1 (tests run the GPU replay's call sites that way).
REPLAY_KERNELS = {"auto": replay_gdn_layer, "triton": replay_gdn_layer_triton}
PATHS = {"ser": ("ser", False), "ovl_skip": ("ovl", True)}  # table column -> (transfer mode, tail-FFN skip)


# --- model -------------------------------------------------------------------------------------------------------

def build_model(preset: models.Preset, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random-weight Qwen3.5 causal LM (transformers), drawn directly on `device`, GDN gates set to long memory."""
    from transformers import AutoModelForCausalLM

    # models.model_config takes a tokenizer only for the ChatML ids; this model never sees text.
    ids = SimpleNamespace(token_to_id=models.SPECIAL_TOKENS.index)
    config = models.model_config(preset, ids)
    config.tie_word_embeddings = True  # as Qwen3.5-4B; the head only ever computes the kept logits
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: 4B parameters drawn on a CPU take minutes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    # Without this, random GDN heads forget within a token or two and zero states would look as good as a replay.
    models._init_gdn_gates(model)
    return model.to(device).eval()


class PrefixCache:
    """The part of transformers' Cache API that Qwen3.5 decoder layers call, over this benchmark's own tensors.

    Empty (`kv` None): a prefix prefill that records each FA layer's K, V in `recorded`. A hit: FA layer i attends
    to kv[i] ([2, KV heads, m, head dim], waited for through `h2d`) plus the suffix; GDN layer i starts from
    states[i] = (conv state [1, conv_dim, width], recurrent state [1, HV, K, V]), transformers' layouts.
    """

    def __init__(self, kv=None, states=None, h2d=None):
        self.kv, self.h2d = kv, h2d
        self.states = states or {}
        self.recorded = {}
        self.layers = {i: SimpleNamespace(conv_states={0: c}, recurrent_states={0: s}, record_past=False)
                       for i, (c, s) in self.states.items()}

    def update(self, key, value, layer_idx, *args, **kwargs):
        if self.kv is None:
            self.recorded[layer_idx] = torch.cat([key, value])
            return key, value
        self.h2d.wait(layer_idx)  # this layer's KV, and only it, must have landed
        cached = self.kv[layer_idx]
        return torch.cat([cached[None, 0], key], dim=-2), torch.cat([cached[None, 1], value], dim=-2)

    def has_previous_state(self, layer_idx=None, state_idx=0):
        return layer_idx in self.states

    def update_conv_state(self, conv_input, layer_idx, **kwargs):
        if layer_idx not in self.states:
            return conv_input
        return torch.cat([self.states[layer_idx][0], conv_input], dim=-1)  # left context of the suffix's conv

    def update_recurrent_state(self, state, layer_idx, **kwargs):
        return state


def forward(model, ids, start: int, cache, fa_mask, keep: int):
    """transformers' forward of `ids` at positions start.. with our cache; logits of the last `keep` tokens."""
    positions = torch.arange(start, start + len(ids), device=ids.device)[None]
    masks = {"full_attention": fa_mask, "linear_attention": None}  # a dict is used as given (no mask building)
    out = model(input_ids=ids[None], position_ids=positions, past_key_values=cache, attention_mask=masks,
                use_cache=True, logits_to_keep=keep)
    return out.logits[0]


def full_prefill(model, ids, keep: int):
    """Cold prefill, transformers' own forward end to end (no cache): the baseline."""
    return model(input_ids=ids[None], use_cache=False, logits_to_keep=keep).logits[0]


# --- host cache --------------------------------------------------------------------------------------------------

@dataclass
class HostPrefix:
    """What the cache holds for an m-token prefix, in pinned host memory."""

    ids: torch.Tensor  # [m] token ids
    hiddens: dict  # stored group index -> [m, hidden]: the residual stream entering the group's first GDN layer
    kv: dict  # FA layer id -> [2, KV heads, m, head dim]


@torch.no_grad()
def capture_prefix(model, layout: HybridLayout, ids) -> HostPrefix:
    cache, hiddens = PrefixCache(), {}
    hooks = [model.model.layers[g.first_layer].register_forward_pre_hook(_grabber(hiddens, g.index), with_kwargs=True)
             for g in layout.stored_groups]
    try:
        forward(model, ids, 0, cache, None, keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return HostPrefix(pin(ids.cpu()), {g: pin(h.cpu()) for g, h in hiddens.items()},
                      {i: pin(kv.cpu()) for i, kv in cache.recorded.items()})


def _grabber(store: dict, group: int):
    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        store[group] = x[0]
    return hook


# --- a hit: transfer, replay, suffix -----------------------------------------------------------------------------

@torch.no_grad()
def hit(model, layout: HybridLayout, host: HostPrefix, suffix, k: int, mode: str, skip: bool, keep: int):
    """TTFT path of a hit on the whole host prefix: copies (mode "ser" or "ovl"), replay of k tail tokens, suffix."""
    m, device = len(host.ids), suffix.device
    h2d = HostToDevice(device, mode)
    # Every copy is queued before any compute, in the order the compute stream needs them: the replay's inputs
    # (token ids for group 0, then each stored group's hiddens), then the KV layer by layer.
    ids = h2d.copy("ids", host.ids[m - k:])
    hiddens = {g: h2d.copy(("hidden", g), h[m - k:]) for g, h in host.hiddens.items()}
    kv = {i: h2d.copy(i, t) for i, t in host.kv.items()}
    states = replay(model, layout, h2d, ids, hiddens, k, skip)
    positions = torch.arange(m, m + len(suffix), device=device)
    fa_mask = (torch.arange(m + len(suffix), device=device)[None, :] <= positions[:, None])[None, None]
    return forward(model, suffix, m, PrefixCache(kv, states, h2d), fa_mask, keep)


def replay(model, layout: HybridLayout, h2d: HostToDevice, ids, hiddens: dict, k: int, skip: bool) -> dict:
    """Each group from zero state over the k tail tokens; returns {GDN layer: (conv, recurrent) state} for the suffix.
    With `skip` the group's last GDN layer computes only its states (the server's replay); k = 0 leaves zero states."""
    layers, device = model.model.layers, ids.device
    cu_seqlens = torch.arange(2, device=device) * k  # one tail [0, k); built on the device, no host sync
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    pools = {i: _zero_pools(layers[i].linear_attn, model.dtype, device)
             for g in layout.groups for i in g.recurrent_layers}
    for group in layout.groups:
        if k == 0:
            break
        key = ("hidden", group.index) if group.index in hiddens else "ids"
        h2d.wait(key)
        x = hiddens[group.index] if group.index in hiddens else model.model.embed_tokens(ids)
        for j, layer_id in enumerate(group.recurrent_layers):
            state_only = skip and j == len(group.recurrent_layers) - 1
            x = replay_layer(layers[layer_id], x, cu_seqlens, slots, *pools[layer_id], k, state_only)
    # the pools' layouts -> transformers': conv state one column wider (its first column never reaches an output),
    # recurrent state [HV, K, V] instead of SGLang's [HV, V, K]
    return {i: (F.pad(conv, (1, 0)), ssm.transpose(-1, -2).contiguous()) for i, (conv, ssm) in pools.items()}


def _zero_pools(la, dtype, device):
    """One request's mamba slot of a GDN layer in SGLang's layouts: conv [1, conv_dim, width - 1], ssm [1, HV, V, K]."""
    conv = torch.zeros(1, la.conv_dim, la.conv_kernel_size - 1, dtype=dtype, device=device)
    ssm = torch.zeros(1, la.num_v_heads, la.head_v_dim, la.head_k_dim, dtype=torch.float32, device=device)
    return conv, ssm


_replay_kernels = replay_gdn_layer  # set from --replay-kernels


def replay_layer(layer, x, cu_seqlens, slots, conv_pool, ssm_pool, k: int, state_only: bool):
    """One transformers GDN decoder layer over the tail, conv + GDN through `replay_gdn_layer` (states into the
    pools). Returns the next residual-stream value, or None when only the states were needed (tail-FFN skip)."""
    la = layer.linear_attn
    h = layer.input_layernorm(x)
    core = _replay_kernels(la.in_proj_qkv(h), la.in_proj_a(h), la.in_proj_b(h), la.conv1d.weight[:, 0],
                           la.conv1d.bias, la.A_log, la.dt_bias, cu_seqlens, slots, conv_pool, ssm_pool,
                           state_only=state_only, max_seqlen=k)
    if state_only:
        return None
    dv = la.head_v_dim
    out = la.norm(core.reshape(-1, dv), la.in_proj_z(h).reshape(-1, dv)).reshape(len(x), -1)
    x = x + la.out_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


# --- check, timing -----------------------------------------------------------------------------------------------

def rel_max_err(actual, expected) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def check(model, layout, prefix, suffix) -> dict:
    """Ratio 1 (the whole prefix replayed): hits must reproduce the full prefill's suffix logits."""
    host = capture_prefix(model, layout, prefix)
    m, s = len(prefix), len(suffix)
    # name -> (replayed tokens, transfer mode, tail-FFN skip); "zero" replays nothing (the paper's zero baseline)
    paths = {"ser": (m, "ser", False), "ovl": (m, "ovl", False), "ovl_skip": (m, "ovl", True),
             "zero": (0, "ovl", True)}
    with torch.no_grad():
        ref = full_prefill(model, torch.cat([prefix, suffix]), keep=s)
        hit(model, layout, host, suffix, m, "ser", False, keep=s)  # compile and autotune before comparing anything
        out = {name: hit(model, layout, host, suffix, k, mode, skip, keep=s)
               for name, (k, mode, skip) in paths.items()}
    err = {name: rel_max_err(logits, ref) for name, logits in out.items()}
    float32_cpu = model.dtype == torch.float32 and prefix.device.type == "cpu"  # no TF32 anywhere: exact bound
    limit = FP32_TOLERANCE if float32_cpu else GPU_FRACTION_OF_ZERO * err["zero"]
    result = {
        "prefix": m, "suffix": s, "dtype": str(model.dtype).removeprefix("torch."), "limit": limit,
        "err_ser": err["ser"], "err_ovl_skip": err["ovl_skip"], "err_zero_states": err["zero"],
        "ser_equals_ovl": torch.equal(out["ser"], out["ovl"]),
        "skip_vs_no_skip": rel_max_err(out["ovl_skip"], out["ovl"]),
    }
    result["passed"] = bool(max(err["ser"], err["ovl_skip"]) <= limit and result["ser_equals_ovl"]
                            and err["zero"] > err["ser"])
    return result


def time_ms(fn, device: torch.device, warmup: int, reps: int) -> list[float]:
    """Wall time of each of `reps` calls after `warmup` calls, synchronized on both sides (TTFT includes launches)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def measure_row(model, layout, m: int, ratios, args, device) -> dict:
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(len(models.SPECIAL_TOKENS), model.config.vocab_size, (m + args.suffix,), generator=g)
    ids = ids.to(device)
    prefix, suffix = ids[:m], ids[m:]
    host = capture_prefix(model, layout, prefix)
    with torch.no_grad():
        full = time_ms(lambda: full_prefill(model, ids, keep=1).argmax(-1), device, args.warmup, args.reps)
    row = {"prefix": m, "full_ms": _mean(full), "full_times_ms": full, "ratios": {}}
    for r in ratios:
        k = TailReplayConfig(enabled=True, ratio=r, min_tokens=1).tail_len(m)  # ceil(r m), as the paper
        cell = {"tail_tokens": k}
        for name, (mode, skip) in PATHS.items():
            times = time_ms(lambda: hit(model, layout, host, suffix, k, mode, skip, keep=1).argmax(-1),
                            device, args.warmup, args.reps)
            cell.update({f"{name}_ms": _mean(times), f"{name}_times_ms": times,
                         f"{name}_speedup": row["full_ms"] / _mean(times)})
        row["ratios"][str(r)] = cell
    host = None  # the prefix's captured hiddens, freed before the next length
    return row


def _mean(xs):
    return sum(xs) / len(xs)


# --- output ------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    """Rows: matched prefix; columns: full, then per ratio H2D-SER and H2D-OVL+skip (speedup vs full)."""
    ratios = list(result["rows"][0]["ratios"])
    head1 = f"{'':>16} {'':>10}" + "".join(f" {f'{float(r):.0%} replay':^35}" for r in ratios)
    head2 = f"{'matched prefix':>16} {'full':>10}" + f" {'H2D-SER':>17} {'H2D-OVL+skip':>17}" * len(ratios)
    lines = [f"TTFT (ms, mean of {result['reps']} timed repetitions), {result['model']['name']}, "
             f"{result['dtype']}, suffix {result['suffix']} tokens, {result['device']}", head1, head2]
    for row in result["rows"]:
        line = f"{row['prefix']:>16,} {row['full_ms']:>10.1f}"
        for r in ratios:
            cell = row["ratios"][r]
            for name in PATHS:
                line += f" {cell[f'{name}_ms']:>8.1f} ({cell[f'{name}_speedup']:>5.2f}x)"
        lines.append(line)
    tails = ", ".join(f"{float(r):.0%}: {result['rows'][-1]['ratios'][r]['tail_tokens']} tokens" for r in ratios)
    lines.append(f"speedups in parentheses are relative to same-row full prefill; tail at "
                 f"{result['rows'][-1]['prefix']:,}: {tails}")
    return "\n".join(lines)


def format_check(c: dict) -> str:
    verdict = "PASSED" if c["passed"] else "FAILED"
    return (f"check at ratio 1 ({c['prefix']} prefix + {c['suffix']} suffix tokens), max |logit diff| / max |logit| "
            f"against full prefill: SER {c['err_ser']:.2e}, OVL+skip {c['err_ovl_skip']:.2e} "
            f"(limit {c['limit']:.1e}); zero GDN states {c['err_zero_states']:.2e}; "
            f"SER == OVL bitwise: {c['ser_equals_ovl']}; skip vs no skip {c['skip_vs_no_skip']:.2e}: {verdict}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu} ({torch.get_num_threads()} threads), torch {torch.__version__}"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny model and lengths (CPU, CI)")
    parser.add_argument("--lengths", type=int, nargs="+", help="matched-prefix lengths (default 8K 16K 32K)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1], help="replay ratios")
    parser.add_argument("--reps", type=int, help="timed repetitions per cell (default 20; 3 with --small)")
    parser.add_argument("--warmup", type=int, help="untimed runs before each cell (default 3; 1 with --small)")
    parser.add_argument("--suffix", type=int, help="unmatched suffix tokens (default 64; 16 with --small)")
    parser.add_argument("--check-length", type=int, help="prefix of the ratio-1 check (default 2048; 128 --small)")
    parser.add_argument("--check-only", action="store_true", help="the ratio-1 check only, no timing")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--replay-kernels", choices=sorted(REPLAY_KERNELS), default="auto",
                        help="auto: Triton on CUDA, torch on CPU; triton: always (on CPU with TRITON_INTERPRET=1)")
    # NOTE: 1 with --small: on a CPU shared with other jobs, two threads made each call 10-50x slower than one.
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's; 1 with --small)")
    parser.add_argument("--out", type=Path, help="JSON (default runs/ttft_gpu.json; runs/ttft_gpu_small.json)")
    args = parser.parse_args(argv)
    defaults = DEFAULTS["small" if args.small else "full"]
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.out = args.out or ROOT / "runs" / ("ttft_gpu_small.json" if args.small else "ttft_gpu.json")
    if args.suffix < 2:
        parser.error("--suffix must be at least 2 (transformers' one-token step is a decode, not an extend)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    global _replay_kernels
    _replay_kernels = REPLAY_KERNELS[args.replay_kernels]
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        force_torch_gdn()  # fla is Triton-only: transformers must use its torch GDN on CPU
    elif not _has_fla():
        sys.exit("fla-core is not importable: transformers would prefill with its reference torch GDN, an order of "
                 "magnitude slower than a real baseline; install the fla-core wheel")
    model = build_model(args.preset, device, dtype)
    model.config.architectures = model.config.architectures or [type(model).__name__]  # as a saved checkpoint's
    layout = HybridLayout.from_hf_config(model.config)
    params = sum(p.numel() for p in model.parameters())
    print(f"{device_name(device)}: model {params / 1e6:,.1f}M parameters, {len(layout.groups)} groups, {args.dtype}, "
          f"built in {time.perf_counter() - started:.1f} s", flush=True)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(models.SPECIAL_TOKENS), model.config.vocab_size, (args.check_length + args.suffix,),
                        generator=g).to(device)
    checked = check(model, layout, ids[:args.check_length], ids[args.check_length:])
    print(format_check(checked), flush=True)

    rows = []
    result = {
        "device": device_name(device), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": {"name": "Qwen3.5-4B-shaped" if args.preset is QWEN35_4B else "tiny Qwen3.5", "parameters": params,
                  "layer_types": list(layout.layer_types), "hidden_size": layout.hidden_size},
        "dtype": args.dtype, "suffix": args.suffix, "reps": args.reps, "warmup": args.warmup,
        "check": checked, "rows": rows, "seconds": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for m in [] if args.check_only else args.lengths:
        rows.append(measure_row(model, layout, m, args.ratios, args, device))
        print(f"  {m:,} tokens done at {time.perf_counter() - started:.0f} s", flush=True)
        _write(args.out, result, started)  # row by row: a run cut short by a time limit keeps what it measured
    if rows:
        print(format_table(result))
    _write(args.out, result, started)
    print(f"total {result['seconds']:.0f} s")
    print(f"wrote {args.out}")
    return 0 if checked["passed"] else 1


def _write(out: Path, result: dict, started: float) -> None:
    result["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(result, indent=1) + "\n")


def _has_fla() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
