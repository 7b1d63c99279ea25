"""Qwen3.5's multi-token-prediction (MTP) head, as Qwen ships it inside the target checkpoint under `mtp.*`.

SGLang serves it as the NEXTN draft (`sglang/srt/models/qwen3_5_mtp.py`): row i of a draft pass sees the target's
final-norm hidden at token i and the embedding of token i + 1, and predicts token i + 2:

    x_i = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])  ->  one full-attention decoder layer  ->  norm  ->  lm_head

transformers has no module for it (its Qwen3.5 ignores `mtp.*` on load), so this is that head in HF's own parts: a
one-layer Qwen3.5 text model fed `inputs_embeds`, which is what SGLang builds for the draft (`is_nextn=True`,
`full_attention_interval=1`). It is the reference the served draft is compared with, and what
`distill_head` trains.
"""

from __future__ import annotations

import copy

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

    @classmethod
    def from_checkpoint(cls, text_config: PretrainedConfig, tensors: dict[str, torch.Tensor]) -> MtpHead:
        head = cls(text_config)
        own = {}
        for name, tensor in tensors.items():
            if name.startswith(MTP_PREFIX):
                name = name.removeprefix(MTP_PREFIX)
                own[name if name.startswith(("fc.", "pre_fc_")) else "model." + name] = tensor
        head.load_state_dict(own, strict=True)
        return head


def distill_head(target: nn.Module, head: MtpHead, steps: int = 600, batches: int = 40, batch_size: int = 16,
                 length: int = 128, lr: float = 3e-3, seed: int = 0) -> float:
    """Train `head` to predict what `target` itself predicts one token further (self-distillation, teacher-forced on
    random token sequences): row i learns the target's greedy token after t_0..t_{i+1}. About 10 s for the tiny
    models; without it a random head's drafts are almost never accepted and acceptance would measure nothing.
    Returns the head's accuracy on a held-out batch."""
    from tailreplay_eval.reference import force_torch_gdn

    force_torch_gdn()
    generator = torch.Generator().manual_seed(seed)
    text_model = target.model.language_model if hasattr(target.model, "language_model") else target.model
    vocab = target.config.get_text_config().vocab_size

    @torch.no_grad()
    def sample(n: int):
        ids = torch.randint(0, vocab, (n, length), generator=generator)
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


@torch.no_grad()
def draft_predictions(target: nn.Module, head: MtpHead, input_ids: torch.Tensor) -> torch.Tensor:
    """The head's greedy guess for token i + 2 at every i (of a [1, T] sequence): shape [1, T - 1]."""
    text_model = target.model.language_model if hasattr(target.model, "language_model") else target.model
    hidden = text_model(input_ids=input_ids).last_hidden_state
    embeds = text_model.embed_tokens(input_ids)
    drafted = head(embeds[:, 1:], hidden[:, :-1])
    return target.lm_head(drafted).argmax(-1)
