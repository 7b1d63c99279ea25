"""Depthwise causal conv1d over packed varlen sequences, with conv states in a slot pool (pure torch).

Conv states are `[slots, dim, width - 1]`: the last `width - 1` inputs of each sequence, which the next extend or
decode step sees as its left context. A slot index < 0 marks a padded row (nothing read or written).
"""

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation) -> torch.Tensor:
    if activation in ("silu", "swish", True):
        return F.silu(y)
    if activation in (None, False, "none", "identity"):
        return y
    raise ValueError(f"unsupported conv activation {activation!r}; supported: silu, swish, none")


def causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    """x: [dim, T] (tokens packed along the last axis); weight: [dim, width]; returns y: [dim, T] in x's dtype.

    Each sequence i (tokens query_start_loc[i]:query_start_loc[i+1]) is left-padded with its slot's conv state
    when has_initial_state[i], else with zeros; the slot then receives the sequence's last width - 1 inputs.
    """
    dim, width = weight.shape
    y = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(cache_indices[i]) if cache_indices is not None else i
        use_state = slot >= 0 and has_initial_state is not None and bool(has_initial_state[i])
        left = conv_states[slot].to(x.dtype) if use_state else x.new_zeros(dim, width - 1)
        window = torch.cat([left, x[:, start:end]], dim=-1)
        out = F.conv1d(window.float().unsqueeze(0), weight.float().unsqueeze(1),
                       None if bias is None else bias.float(), groups=dim)[0]
        y[:, start:end] = _activate(out, activation).to(x.dtype)
        if slot >= 0 and conv_states is not None:
            conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return y


def causal_conv1d_update(x, conv_states, weight, bias, activation, conv_state_indices):
    """Decode step(s). x: [B, dim] or [B, dim, T]; slot conv_state_indices[b] holds sequence b's state.

    Returns y shaped like x; states shift left by the new tokens.
    """
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    width = weight.shape[1]
    slots = conv_state_indices.long() if conv_state_indices is not None else torch.arange(xs.shape[0])
    live = slots >= 0
    state = xs.new_zeros(xs.shape[0], xs.shape[1], width - 1, dtype=torch.float32)
    state[live] = conv_states[slots[live]].float()
    window = torch.cat([state, xs.float()], dim=-1)  # [B, dim, width - 1 + T]
    out = F.conv1d(window, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=xs.shape[1])
    conv_states[slots[live]] = window[live, :, -(width - 1):].to(conv_states.dtype)
    y = _activate(out, activation).to(x.dtype)
    return y.squeeze(-1) if squeeze else y
