"""Qwen3.5's multi-token-prediction (MTP) head, as Qwen ships it inside the target checkpoint under `mtp.*`.

SGLang serves it as the NEXTN draft (`sglang/srt/models/qwen3_5_mtp.py`): row i of a draft pass sees the target's
final-norm hidden at token i and the embedding of token i + 1, and predicts token i + 2:

    x_i = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])  ->  one full-attention decoder layer  ->  norm  ->  lm_head

transformers has no module for it (its Qwen3.5 ignores `mtp.*` on load), so this is that head in HF's own parts: a
one-layer Qwen3.5 text model fed `inputs_embeds`, which is what SGLang builds for the draft (`is_nextn=True`,
`full_attention_interval=1`); `distill_head` trains it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextModel

MTP_PREFIX = "mtp."


def mtp_text_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The draft's config: the target's, one full-attention layer (as SGLang rewrites it for the draft)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    config.full_attention_interval = 1
    return config


class MtpHead(nn.Module):
    """The `mtp.*` weights of a Qwen3.5 checkpoint; `forward` returns the head's final-norm hidden states."""

    def __init__(self, text_config: PretrainedConfig):
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.model = Qwen3_5TextModel(mtp_text_config(text_config))
        self.model.embed_tokens = None  # the draft shares the target's embedding and lm_head

    def forward(self, next_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """next_embeds[:, i] embeds token i + 1, target_hidden[:, i] is the target's hidden at token i."""
        fused = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds),
                                   self.pre_fc_norm_hidden(target_hidden)], dim=-1))
        return self.model(inputs_embeds=fused).last_hidden_state

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors under Qwen's names: mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm."""
        state = {}
        for name, tensor in self.state_dict().items():
            name = name.removeprefix("model.")
            state[MTP_PREFIX + name] = tensor.detach().contiguous()
        return state


def distilled_head(target: nn.Module, seed: int = 0, corpus: torch.Tensor | None = None) -> tuple[MtpHead, float]:
    """A fresh head (drawn from seed + 1, after the target's own weights) distilled from `target`, whose weights are
    frozen for it; and its held-out accuracy."""
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    torch.manual_seed(seed + 1)
    head = MtpHead(target.config)
    return head, distill_head(target, head, seed=seed, corpus=corpus)


def distill_head(target: nn.Module, head: MtpHead, steps: int = 600, batches: int = 40, batch_size: int = 16,
                 length: int = 128, lr: float = 3e-3, seed: int = 0, corpus: torch.Tensor | None = None) -> float:
    """Train `head` to predict what `target` itself predicts one token further (self-distillation, teacher-forced):
    row i learns the target's greedy token after t_0..t_{i+1}. The sequences are random tokens (what a random
    model's behaviour is defined on), or windows of `corpus` (token ids of the text a trained model was trained on:
    on random tokens its predictions carry nothing to learn, 2 % accuracy measured). About 10 s for the tiny models;
    without it a random head's drafts are almost never accepted and acceptance would measure nothing. Returns the
    head's accuracy on a held-out batch."""
    from tailreplay_eval.reference import force_torch_gdn

    force_torch_gdn()
    generator = torch.Generator().manual_seed(seed)
    text_model = target.model.language_model if hasattr(target.model, "language_model") else target.model
    vocab = target.config.get_text_config().vocab_size

    @torch.no_grad()
    def sample(n: int):
        if corpus is None:
            ids = torch.randint(0, vocab, (n, length), generator=generator)
        else:
            starts = torch.randint(0, corpus.numel() - length, (n,), generator=generator)
            ids = torch.stack([corpus[s : s + length] for s in starts.tolist()])
        hidden = text_model(input_ids=ids).last_hidden_state
        return text_model.embed_tokens(ids)[:, 1:], hidden[:, :-1], target.lm_head(hidden).argmax(-1)[:, 1:]

    data = [sample(batch_size) for _ in range(batches)]
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    for step in range(steps):
        embeds, hidden, labels = data[step % batches]
        logits = target.lm_head(head(embeds, hidden))
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    embeds, hidden, labels = sample(batch_size)
    with torch.no_grad():
        return (target.lm_head(head(embeds, hidden)).argmax(-1) == labels).float().mean().item()


def write_head(checkpoint: Path, head: MtpHead, dtype: torch.dtype) -> None:
    """Append `head` to the checkpoint's single safetensors file and declare it in config.json, as Qwen ships it."""
    import json

    from safetensors.torch import load_file, save_file

    weights = checkpoint / "model.safetensors"
    state = {name: t.to(dtype) for name, t in head.checkpoint_state().items()}
    save_file(dict(load_file(weights), **state), weights, metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=1), indent=2) + "\n")


def with_mtp_head(source: Path, out_dir: Path, corpus_texts: list[str] | None = None, seed: int = 0) -> Path:
    """A copy of checkpoint `source` carrying a distilled MTP head (`mtp.*`, `mtp_num_hidden_layers: 1`), built once
    into `out_dir` (a marker records what it was built from). `corpus_texts`: the text the model was trained on,
    which the head is distilled on (else random tokens)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from tailreplay_eval.reference import load_hf_model

    marker = out_dir / "tailreplay_mtp.json"
    record = {"source": str(source), "seed": seed, "corpus": corpus_texts is not None}
    if marker.is_file() and json.loads(marker.read_text()).get("source") == record["source"]:
        return out_dir
    target = load_hf_model(source)
    corpus = None
    if corpus_texts is not None:
        tokenizer = AutoTokenizer.from_pretrained(source)
        corpus = torch.tensor(tokenizer("\n".join(corpus_texts), add_special_tokens=False).input_ids)
    head, record["heldout_accuracy"] = distilled_head(target, seed, corpus)
    shutil.copytree(source, out_dir, dirs_exist_ok=True)
    write_head(out_dir, head, target.dtype)
    marker.write_text(json.dumps(record, indent=2) + "\n")
    return out_dir

