"""What each prefix cache keeps in memory, from a model's config.json and the server's flags.

    python bench/memory.py [--preset small | --model-path M] [--server-args "--dtype float32 --enable-tail-replay"]

Both bench/ttft.py and bench/workloads.py print this table and put it in their JSON, so that reuse is weighed
against what it costs:
- FA KV per cached token (stock and Tail-Replay alike);
- Tail-Replay's stored hiddens per cached token (`hidden_store.bytes_per_token` at the server's hidden dtype);
- one mamba slot: the conv + SSM states of every GDN layer. Stock SGLang holds one per running request (three with
  `extra_buffer`: two ping-pong track slots) and one per cached checkpoint; Tail-Replay holds one per running
  request and none per cached prefix.

The formulas are SGLang 0.5.23's own pool sizing, restated so that no server or parallel state is needed:
`configs/mamba_utils.py` (`Mamba2StateShape.create`, `BaseLinearStateParams.mamba_cache_per_req`, conv dtype from
`SGLANG_MAMBA_CONV_DTYPE`, default bfloat16; SSM dtype float32 unless the config or `SGLANG_MAMBA_SSM_DTYPE` says
otherwise) and the per-token KV cell of `DefaultPoolConfigurator._compute_cell_size` (K and V of every FA layer).
The server log shows the same numbers: `Tail-Replay: KV cell ... B/token + hidden store ... B/token` and
`Mamba Cache is allocated ... ssm_state size`.
"""

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tailreplay_sglang import hidden_store  # noqa: E402
from tailreplay_sglang.config import TailReplayConfig  # noqa: E402
from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout  # noqa: E402
from tailreplay_sglang.plugin import add_cli_args, config_from_args  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


def _flag(flags: list[str], name: str, default: str | None = None) -> str | None:
    """Value of `--name X` or `--name=X` in a server flag list (the last one wins, as in argparse)."""
    value = default
    for i, arg in enumerate(flags):
        if arg == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _text_config(model_path: Path) -> dict:
    raw = json.loads((Path(model_path) / "config.json").read_text())
    return raw.get("text_config", raw)


def kv_dtype(config: dict, flags: list[str]) -> torch.dtype:
    """The KV pool's dtype: --kv-cache-dtype, else the serving dtype (--dtype, 'auto' = the checkpoint's)."""
    kv = _flag(flags, "--kv-cache-dtype", "auto")
    if kv != "auto":
        return DTYPES[kv]
    dtype = _flag(flags, "--dtype", "auto")
    if dtype == "auto":
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return DTYPES[dtype]


def tail_replay_config(model_path: Path, flags: list[str]) -> TailReplayConfig:
    """The Tail-Replay config a server started with these flags runs, parsed by the plugin's own flag parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    args, _ = parser.parse_known_args(list(flags))
    args.model_path = str(model_path)
    return config_from_args(args)


def mamba_slot_bytes(config: dict, n_gdn_layers: int) -> dict:
    """Bytes of one mamba slot (SGLang's `mamba_cache_per_req` at TP 1), split into conv and SSM states."""
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim = value_heads * value_dim + 2 * key_heads * key_dim  # conv runs over cat(q, k, v)
    conv_dtype = DTYPES[os.environ.get("SGLANG_MAMBA_CONV_DTYPE", "bfloat16")]
    ssm_dtype = DTYPES[os.environ.get("SGLANG_MAMBA_SSM_DTYPE") or config.get("mamba_ssm_dtype") or "float32"]
    conv = conv_dim * (config["linear_conv_kernel_dim"] - 1) * conv_dtype.itemsize
    ssm = value_heads * value_dim * key_dim * ssm_dtype.itemsize
    return {"conv_bytes": conv * n_gdn_layers, "ssm_bytes": ssm * n_gdn_layers,
            "total_bytes": (conv + ssm) * n_gdn_layers, "conv_dtype": str(conv_dtype).removeprefix("torch."),
            "ssm_dtype": str(ssm_dtype).removeprefix("torch.")}


def account(model_path: Path, flags: list[str] | tuple = ()) -> dict:
    """Memory per cached token and per recurrent state for this model served with these flags."""
    flags = list(flags)
    config = _text_config(model_path)
    layout = HybridLayout.from_model_path(str(model_path))
    n_fa, n_gdn = layout.layer_types.count(FULL), layout.layer_types.count(LINEAR)
    kv = kv_dtype(config, flags)
    kv_per_token = n_fa * 2 * config["num_key_value_heads"] * config["head_dim"] * kv.itemsize
    # The store's dtype as a Tail-Replay server with these flags would have it (defaults included), also for stock.
    hidden = DTYPES[tail_replay_config(model_path, [*flags, "--enable-tail-replay"]).hidden_dtype]
    hidden_per_token = hidden_store.bytes_per_token(layout, hidden)
    slot = mamba_slot_bytes(config, n_gdn)
    return {
        "fa_layers": n_fa, "gdn_layers": n_gdn, "stored_groups": len(layout.stored_groups),
        "kv_dtype": str(kv).removeprefix("torch."), "hidden_dtype": str(hidden).removeprefix("torch."),
        "fa_kv_bytes_per_token": kv_per_token,
        "tail_replay_hidden_bytes_per_token": hidden_per_token,
        "tail_replay_bytes_per_cached_token": kv_per_token + hidden_per_token,
        "mamba_slot": slot,
        "stock_slots_per_running_request": {"no_buffer": 1, "extra_buffer": 3},
        "stock_slots_per_checkpoint": 1,
        "tail_replay_slots_per_running_request": 1,
        "tail_replay_slots_per_checkpoint": 0,
        # One stock checkpoint costs as much as the hiddens of this many cached tokens.
        "hidden_tokens_per_mamba_slot": slot["total_bytes"] / hidden_per_token,
        "kv_tokens_per_mamba_slot": slot["total_bytes"] / kv_per_token,
    }


def account_for_configs(model_path: Path, configs: dict[str, tuple | None], server_args: list[str]) -> dict:
    """The accounting for the first Tail-Replay server's flags (its hidden dtype), else for the common flags."""
    flags = next((f for f in configs.values() if f and "--enable-tail-replay" in f), server_args)
    return account(model_path, flags)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def table(acc: dict, title: str = "memory per cached token and per recurrent state") -> Table:
    t = Table(title=title)
    t.add_column("what")
    t.add_column("bytes", justify="right")
    t.add_column("note")
    slot = acc["mamba_slot"]
    t.add_row("FA KV per token", _size(acc["fa_kv_bytes_per_token"]),
              f"{acc['fa_layers']} FA layers, K and V, {acc['kv_dtype']}; stock and Tail-Replay alike")
    t.add_row("Tail-Replay hiddens per token", _size(acc["tail_replay_hidden_bytes_per_token"]),
              f"{acc['stored_groups']} stored groups x hidden, {acc['hidden_dtype']}, + 8 B token id")
    t.add_row("Tail-Replay per cached token", _size(acc["tail_replay_bytes_per_cached_token"]), "KV + hiddens")
    t.add_row("one mamba slot", _size(slot["total_bytes"]),
              f"{acc['gdn_layers']} GDN layers: conv {_size(slot['conv_bytes'])} ({slot['conv_dtype']}) + "
              f"SSM {_size(slot['ssm_bytes'])} ({slot['ssm_dtype']})")
    t.add_row("stock, per running request", _size(slot["total_bytes"]), "1 slot (no_buffer); 3 with extra_buffer")
    t.add_row("stock, per cached checkpoint", _size(slot["total_bytes"]),
              f"1 slot = hiddens of {acc['hidden_tokens_per_mamba_slot']:.0f} tokens "
              f"= FA KV of {acc['kv_tokens_per_mamba_slot']:.0f} tokens")
    t.add_row("Tail-Replay, per running request", _size(slot["total_bytes"]), "1 slot; no slot per cached prefix")
    return t


def prefix_cost(acc: dict, tokens: int, checkpoints: int) -> dict:
    """Bytes to keep a cached prefix: stock holds KV + its checkpoints, Tail-Replay KV + hiddens."""
    return {"stock_bytes": tokens * acc["fa_kv_bytes_per_token"] + checkpoints * acc["mamba_slot"]["total_bytes"],
            "tail_replay_bytes": tokens * acc["tail_replay_bytes_per_cached_token"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-path", help="a checkpoint directory with config.json (default: models/<preset>)")
    ap.add_argument("--server-args", default="--dtype float32")
    ap.add_argument("--prefix-tokens", type=int, default=16384, help="example prefix for the cost comparison")
    args = ap.parse_args(argv)
    model_path = Path(args.model_path) if args.model_path else ROOT / "models" / args.preset
    acc = account(model_path, shlex.split(args.server_args))
    console = Console(width=150)
    console.print(table(acc, f"{model_path.name} ({args.server_args})"))
    # One checkpoint per 4096-token chunk is what stock no_buffer keeps of a long prompt prefilled on CPU.
    checkpoints = math.ceil(args.prefix_tokens / 4096)
    cost = prefix_cost(acc, args.prefix_tokens, checkpoints)
    console.print(f"a {args.prefix_tokens}-token prefix: stock {_size(cost['stock_bytes'])} (KV + {checkpoints} "
                  f"checkpoints), Tail-Replay {_size(cost['tail_replay_bytes'])} (KV + hiddens)")


if __name__ == "__main__":
    main()
