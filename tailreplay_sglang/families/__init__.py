"""The recurrent families, one module each, chosen by the layout's mixer: a new family is one module plus its row
here and its INTERVAL_ANCHORS rows in `hooks.py`."""

import importlib

from tailreplay_sglang.families.base import Family, FamilyBindError, ReplayBatch
from tailreplay_sglang.architectures import (CCA, GDN, HYPER_GDN, JET, KDA, KDA_ATTN_RES, LIGHTNING, MAMBA2,
                                             MHC_KDA, SHORT_CONV)

# Imported on first use: a family module imports its kernels, which the launcher never needs.
MODULES = {GDN: "tailreplay_sglang.families.gdn", MAMBA2: "tailreplay_sglang.families.mamba2",
           KDA: "tailreplay_sglang.families.kda", LIGHTNING: "tailreplay_sglang.families.lightning",
           SHORT_CONV: "tailreplay_sglang.families.short_conv", HYPER_GDN: "tailreplay_sglang.families.hyper_gdn",
           JET: "tailreplay_sglang.families.jet", KDA_ATTN_RES: "tailreplay_sglang.families.attn_res_kda",
           CCA: "tailreplay_sglang.families.cca", MHC_KDA: "tailreplay_sglang.families.mhc_kda"}

__all__ = ["MODULES", "Family", "FamilyBindError", "ReplayBatch", "family_for"]


def family_for(layout) -> Family:
    return importlib.import_module(MODULES[layout.mixer]).FAMILY
