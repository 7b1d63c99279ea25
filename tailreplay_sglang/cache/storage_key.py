"""The namespace of a Tail-Replay server's pages in a shared L3 store (`--hicache-storage-backend mooncake` or
`file`).

SGLang's Mooncake backend names a page by its prefix hash behind a prefix of `extra_backend_tag` and the model name
(`--model-path`, '/' -> '-'). Two servers of one model path with another checkpoint (config), `--dtype`,
`--kv-cache-dtype` or hidden-row dtype would read each other's pages: KV of another dtype, hidden rows of another
width or group split, restored and then replayed as exact. So the launcher adds a tag naming what its pages hold, a
short hash of those settings, to the extra config it hands to the scheduler: servers that agree on them share pages,
others never see each other's. The anchors' states go to the store too (`storage_anchors.py`), and their layout is
resolved only in the scheduler (the conv dtype follows `SGLANG_MAMBA_CONV_DTYPE`, which the CPU port sets to the
model's dtype under extra_buffer; the SSM dtype follows `--mamba-ssm-dtype`): the scheduler adds `state_tag` of its
mamba pool before HiCache reads the config (`TailReplayRadixCache.init_hicache`), so a server reads no state of
another layout (a state of another size fails the read and loses the whole prefetch; one of the same size but
another dtype would be read as exact).

The checkpoint is named by its config and its weights' identity (`weights_identity`: each weight file's name, size
and the hash of its first and last MiB), so a fine-tune served under its base's path and config gets pages of its
own. The `file` backend keys its files by the model path alone and ignores tags, so a `file` folder is claimed
instead: the first server writes its tag into the folder (`claim_file_folder`), and a server with another tag is
refused at start-up, naming the folder (multi-server review F7).
"""

import hashlib
import json
import os
import uuid
from pathlib import Path

FORMAT = 2  # bump when the bytes of a hidden page change (store/hicache_pool.py; 2: float8 rows' 8-byte scale slot)


def storage_tag(args, hidden_dtype: str) -> str:
    """'tr<FORMAT>-<hash>' of the checkpoint (config, weights) and the dtypes of the pages this server writes."""
    config = Path(args.model_path, "config.json")
    what = {"format": FORMAT, "config": config.read_text() if config.is_file() else str(args.model_path),
            "weights": weights_identity(Path(args.model_path)),
            "revision": getattr(args, "revision", None), "dtype": getattr(args, "dtype", None),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", None), "hidden_dtype": hidden_dtype,
            "page_size": getattr(args, "page_size", None)}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return f"tr{FORMAT}-{digest}"


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
EDGE_BYTES = 1 << 20


def weights_identity(model_path: Path) -> list:
    """(name, size, sha256 of the first and last MiB) of each weight file of a local checkpoint; [] for a hub name.
    Cheap (2 MiB read per file) and different for a fine-tune of the same shapes, whose config may be its base's."""
    if not model_path.is_dir():
        return []
    identity = []
    for path in sorted(p for p in model_path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = path.stat().st_size
        digest = hashlib.sha256()
        with path.open("rb") as f:
            digest.update(f.read(EDGE_BYTES))
            f.seek(max(0, size - EDGE_BYTES))
            digest.update(f.read(EDGE_BYTES))
        identity.append((path.name, size, digest.hexdigest()[:16]))
    return identity


TAG_FILE = "tail_replay_storage_tag"


class StorageFolderTagError(ValueError):
    """A `file` L3 folder holds pages of another checkpoint, dtype or state layout."""


def claim_file_folder(folder: str | Path, tag: str) -> None:
    """The `file` backend's folder is this tag's: written atomically by the first server (a link that fails if the
    file exists), checked by every later one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target, staged = folder / TAG_FILE, folder / f".{TAG_FILE}.{uuid.uuid4().hex}"
    staged.write_text(tag)
    try:
        os.link(staged, target)
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    found = target.read_text()
    if found != tag:
        raise StorageFolderTagError(
            f"--hicache-storage-backend file: {folder} holds pages tagged {found}, this server's are {tag} (another "
            f"checkpoint, --dtype, --kv-cache-dtype, --tail-replay-hidden-dtype, page size or state layout): their "
            f"KV, hidden rows and states would be read as this server's. Give this server its own folder "
            f"(SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, or file_storage_path in "
            f"--hicache-storage-backend-extra-config)")


def file_folder(extra_config: str | None) -> str:
    """The folder SGLang's `file` backend writes to (`HiCacheFile`): its environment variable, else the extra
    config's `file_storage_path`, else its default."""
    from sglang.srt.environ import envs

    return (envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get() or _load(extra_config).get("file_storage_path")
            or "/tmp/hicache")


def state_tag(mamba_cache) -> str:
    """'s-<hash>' of one state's layout in the mamba pool: the per-slot shape and dtype of every conv part and of
    the SSM part."""
    parts = [(list(t.shape[:1]) + list(t.shape[2:]), str(t.dtype)) for t in (*mamba_cache.conv, mamba_cache.temporal)]
    return "s-" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:8]


def with_storage_tag(extra_config: str | None, tag: str) -> str:
    """`--hicache-storage-backend-extra-config` (a JSON object, or '@file.json') with `extra_backend_tag` extended by
    `tag` (a user's own tag stays in front), as a JSON object."""
    config = _load(extra_config)
    own = config.get("extra_backend_tag")
    config["extra_backend_tag"] = tag if own is None else f"{own}_{tag}"
    return json.dumps(config)


def _load(extra_config: str | None) -> dict:
    if not extra_config:
        return {}
    if extra_config.startswith("@"):
        path = Path(extra_config[1:])
        if path.suffix.lower() == ".json":
            return json.loads(path.read_text())
        if path.suffix.lower() == ".toml":
            import tomllib

            return tomllib.loads(path.read_text())
        import yaml  # SGLang's own reader takes .yaml and .yml too

        return yaml.safe_load(path.read_text())
    return json.loads(extra_config)
