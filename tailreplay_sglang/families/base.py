"""What every recurrent family gives the mechanism (`Family`), the packed replay batch it works on, and the helpers
the families share."""

import pkgutil
from dataclasses import dataclass, field

import torch

from tailreplay_sglang.store.transfer import pin


@dataclass
class ReplayBatch:
    """One packed varlen replay: tails of all hit requests in a prefill batch."""

    kv_slots: torch.Tensor  # [sum k] KV slot of every replayed token
    cu_seqlens: torch.Tensor  # [n + 1]
    mamba_slots: torch.Tensor  # [n] each request's mamba slot: a copied anchor state or a cleared one
    tail_lens: list[int]
    reqs: list
    log_survival: torch.Tensor | None = None  # [n] filled by the replay: max over layers and heads of the log-decays
    # Under attention DP: every rank's replay rows this step (`dp_attention.py`), which the feed-forward blocks run on
    exchange: object | None = None
    # Whether any tail is a zero-init one, whose survival bound is reported; an all-exact pass computes none
    needs_survival: bool = True
    token_tail: torch.Tensor | None = None  # [sum k] which tail each replayed token belongs to (built once a pass)
    tail_starts: list[int] | None = None  # each tail's first position in its sequence (families whose mixer rotates)
    # [n + 1] cu_seqlens on the host, for kernels that would otherwise read them back (fla's chunk kernel: review H)
    cu_seqlens_cpu: torch.Tensor | None = None
    pool_rows: list[int] | None = None  # [n] each request's row in the request-to-token pool
    kv_pool: object | None = None  # the runner's KV pool, for families whose replay attends to the cached KV (cca)
    store: object | None = None  # the hidden store, for families that read rows beyond the tails (PLE's conv window)
    # What a family builds once per pass and every group reuses, under the family's name (short_conv: its kernel)
    pass_state: dict = field(default_factory=dict)

    def tail_of_each_token(self, device) -> torch.Tensor:
        """[sum k] the tail index of every replayed token, on `device`: built on the host from `tail_lens` once per
        pass and uploaded without a sync, not per layer (a device `repeat_interleave` syncs for its length)."""
        if self.token_tail is None:
            lens = torch.tensor(self.tail_lens)
            host = torch.repeat_interleave(torch.arange(len(self.tail_lens)), lens)
            self.token_tail = pin(host).to(device, non_blocking=True)
        return self.token_tail

    def token_positions(self, device) -> torch.Tensor:
        """[sum k] the position in its sequence of every replayed token, on `device` (uploaded without a sync)."""
        host = torch.cat([torch.arange(start, start + n) for start, n in zip(self.tail_starts, self.tail_lens)])
        return pin(host).to(device, non_blocking=True)

    def feed_forward(self, mlp, h: torch.Tensor) -> torch.Tensor:
        """A feed-forward block (MLP or MoE) over this batch's rows `h`, its TP sum complete."""
        if self.exchange is None:
            return tp_reduced(mlp(h), reduction_owner(mlp))
        return self.exchange.feed_forward(mlp, h, h.shape[-1], h.dtype, h.device, _ffn_reduce(mlp))

    def observe_decay(self, log_decay: torch.Tensor) -> None:
        """Fold one layer's log-decays [T, heads] into `log_survival` (the zero-init tail's survival bound)."""
        if self.needs_survival:
            self.log_survival = torch.maximum(self.log_survival, tail_log_survival(log_decay, self))


def token_embedding(model):
    """The model's token embedding: `embed_tokens`, or `word_embeddings` where Bailing (Ling) names it so."""
    return model.embed_tokens if hasattr(model, "embed_tokens") else model.word_embeddings


class FamilyBindError(RuntimeError):
    """The loaded model lacks a module, attribute or kernel the family's capture or replay uses."""


class Family:
    """A recurrent mixer family: how its groups are captured, replayed and anchored.

    One instance per family (`families.family_for`); it holds no per-model state, so every method gets what it
    works on.
    """

    name: str = ""
    # A replayed hit's state at its match end can be kept as an anchor (offset 0 of its extend): true where the
    # prefill's per-chunk states start at every sequence's first token.
    anchor_at_replay_end: bool = True
    # SGLang's linear-attention prefill backends (`--linear-attn-prefill-backend`) whose per-chunk states the
    # family's interval-anchor hooks read; None where the family's prefill does not go through that choice (Mamba2).
    anchor_prefill_backends: tuple[str, ...] | None = None
    # The replay runs under attention DP: its feed-forward blocks as one pass of every rank (`feed_forwards`)
    dp_attention: bool = False
    # Speculative decoding (NEXTN, NGRAM) is tested with this family's verify (`supported.check_speculative_family`)
    speculative: bool = False
    # SGLang's prefill CUDA-graph backends that capture this family's extend, where the interval anchors are written
    # (`supported.check_anchor_graphs`), and the flag that keeps the extend eager
    anchor_capturing_prefill_graphs: tuple[str, ...] = ("full",)
    eager_prefill_flag: str = "--cuda-graph-backend-prefill breakable"

    def state_window(self, layout) -> int | None:
        """Tokens from which a zero-init replay rebuilds every group's state exactly, where the state is a window
        of the last few inputs (LFM2's short conv); None where the state depends on the whole prefix. With a window,
        every hit replays that many tokens from a cleared slot, exact, and no anchor is kept (`plugin._for_mixer`)."""
        return None

    def anchor_grid(self, layout) -> int:
        """Interval anchors are taken on this grid of prefill positions: the interval must be a multiple of it."""
        return 64

    def install_capture(self, model, store) -> list:
        """Hooks on the decoder stack `model` that write token ids and group inputs into the store during every
        forward; returns removable handles."""
        raise NotImplementedError

    def replay_group(self, model, pool, group, x: torch.Tensor, batch: ReplayBatch) -> None:
        """Replay one group over the packed tails from its input x [T, hidden]; states land in the batch's slots."""
        raise NotImplementedError

    def required(self, model, layout) -> list[tuple[object, str, str]]:
        """(object, dotted attribute path, where) of every model internal the capture and replay touch."""
        raise NotImplementedError

    def on_hits(self, runner, store, hits: list[tuple[int, int]]) -> None:
        """After a batch's replay pass: per-request states beside the recurrent ones that every hit, replayed or not,
        must find right at its match end; `hits` are (request-pool row, matched tokens). Most families keep none."""

    def feed_forwards(self, model, layout) -> list:
        """Under attention DP (`dp_attention`): the feed-forward blocks a replay pass runs, in its order
        (`participate`)."""
        raise NotImplementedError

    def participate(self, model, layout, exchange) -> None:
        """Take part in a replay pass other ranks run, with no rows of this rank's own: the same feed-forward blocks
        in the same order, so that their collectives pair up (`dp_attention.py`)."""
        weight = token_embedding(model).weight
        for mlp in self.feed_forwards(model, layout):
            exchange.feed_forward(mlp, None, weight.shape[-1], weight.dtype, weight.device, _ffn_reduce(mlp))

    def required_kernels(self) -> tuple[str, ...]:
        """`module:name` of every SGLang function the replay calls by name."""
        return ()

    def bind(self, model, layout) -> None:
        """At start-up: raise `FamilyBindError` naming every model internal or kernel the replay would touch and the
        installed SGLang lacks, so a rename fails at launch rather than at the first hit."""
        missing = [f"{where}.{path}" for obj, path, where in self.required(model, layout) if not _has_path(obj, path)]
        for name in self.required_kernels():
            try:
                pkgutil.resolve_name(name)
            except (ImportError, AttributeError):
                missing.append(name)
        if missing:
            raise FamilyBindError(f"Tail-Replay ({self.name}): this SGLang's model lacks what the replay uses: "
                                  f"{', '.join(missing)}. Tail-Replay supports sglang==0.5.23's model classes.")


def _has_path(obj, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def layer_requirements(model, layer_ids, paths, where: str = "model.layers") -> list[tuple[object, str, str]]:
    """The same attribute paths on each of the given decoder layers."""
    return [(model.layers[i], path, f"{where}[{i}]") for i in layer_ids for path in paths]


FEED_FORWARD = ("mlp", "post_attention_layernorm")  # a pre-norm decoder layer's feed-forward block and its norm


def replayed_layer_requirements(model, layout, paths_of, feed_forward=FEED_FORWARD) -> list[tuple[object, str, str]]:
    """`paths_of(layer_id)` on every recurrent layer of every group, and `feed_forward` on each but a group's last:
    the replay computes only the last one's states, never its output."""
    needs = []
    for group in layout.groups:
        for layer_id in group.recurrent_layers:
            paths = tuple(paths_of(layer_id)) + (feed_forward if layer_id != group.recurrent_layers[-1] else ())
            needs += layer_requirements(model, [layer_id], paths)
    return needs


def tp_reduced(partial: torch.Tensor, linear) -> torch.Tensor:
    """Output projections, MLPs and MoE blocks built with reduce_results=False leave the TP sum to the layer's
    communicator in the model's forward. The replay calls them directly, so it reduces them itself, over the group
    the module is sharded on: a linear keeps it (`tp_group`: the attention-TP group for the mixers' projections
    under attention DP, of size 1 at --tp N --dp N), a MoE block is sharded over the whole TP group. Every rank of
    that group replays the same batch at the same point (TP schedulers run in lockstep; attention-TP peers hold one
    DP group's batch), so the collectives pair up. A no-op at TP 1 and for modules that reduce inside."""
    if linear is None or getattr(linear, "reduce_results", True):
        return partial
    group = getattr(linear, "tp_group", None)
    if hasattr(group, "all_reduce"):  # a GroupCoordinator (a logical or replicated group is never a TP sum here)
        return group.all_reduce(partial) if group.world_size > 1 else partial
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_reduce
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

    return tensor_model_parallel_all_reduce(partial) if get_tensor_model_parallel_world_size() > 1 else partial


def _ffn_reduce(mlp):
    """The TP sum a feed-forward block's output still lacks, as a function (`tp_reduced` on its owner)."""
    owner = reduction_owner(mlp)
    return lambda partial: tp_reduced(partial, owner)


def reduction_owner(mlp):
    """The module whose `reduce_results` says whether a feed-forward output still lacks its TP sum: a MoE block
    carries the flag itself, a dense MLP on its down projection, a MoE with a shared expert on its experts (the
    shared expert's partial sum is added before the reduction, as in its layer)."""
    if hasattr(mlp, "reduce_results"):
        return mlp
    down = getattr(mlp, "down_proj", None)
    return down if down is not None else getattr(mlp, "experts", None)


def tail_log_survival(g: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
    """[n] max over heads of sum_t g_t over each tail, from the log-decays g [T, heads] of one layer."""
    seq = batch.tail_of_each_token(g.device)
    sums = torch.zeros(len(batch.tail_lens), g.shape[1], device=g.device).index_add_(0, seq, g)
    return sums.max(dim=1).values
