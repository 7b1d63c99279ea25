"""DeepSeek-style NEXTN layers as vendors ship them inside the target checkpoint (Ling-3.0's, GLM-5.3-Flash's): the
tensors beside the draft's decoder block, which `ling.write_mtp_head` and `glm5.write_mtp_head` add."""

import torch


def nextn_fusion(prefix: str, hidden: int, dtype: torch.dtype, seed: int, norms: tuple[str, ...]) -> dict:
    """The tensors a DeepSeek-style NEXTN layer (Ling-3.0's, GLM-5.3-Flash's) adds beside its decoder block: `eh_proj`,
    projecting the normed embedding of token i + 1 and the target's hidden at token i together, drawn from `seed`
    (no reference to distil it from), and unit `norms`, all under `prefix`."""
    generator = torch.Generator().manual_seed(seed)
    eh_proj = torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    return {f"{prefix}eh_proj.weight": eh_proj.to(dtype),
            **{f"{prefix}{norm}.weight": torch.ones(hidden, dtype=dtype) for norm in norms}}
