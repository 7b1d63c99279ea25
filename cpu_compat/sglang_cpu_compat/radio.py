"""Nemotron-H VL / Omni's RADIO tower (`models/radio.py`) served in float32, as the CPU route serves."""


def pixels_in_tower_dtype(original, self, pixel_values=None, num_frames=None):
    """AROUND `RadioModel.forward`: SGLang's Nemotron-H VL processor hands the tower bfloat16 pixels whatever the
    served dtype (`NanoNemotronVLImageProcessor`: `.to(dtype=torch.bfloat16)`), and a float32 tower's patch embedding
    then raises "expected m1 and m2 to have the same dtype" on the first image. The pixels are cast to the tower's
    dtype (their bfloat16 rounding stays, as on a bfloat16 GPU serve). A no-op where the dtypes agree."""
    dtype = next(self.parameters()).dtype
    if isinstance(pixel_values, list):
        pixel_values = [p.to(dtype) for p in pixel_values]
    elif pixel_values is not None:
        pixel_values = pixel_values.to(dtype)
    return original(self, pixel_values, num_frames)


def packed_images_masked_apart(original, self, q, k, v, bsz, cu_seqlens=None, attention_mask=None, **kwargs):
    """AROUND `VisionSdpaAttention.forward` (the vision attention a CPU gets): RADIO packs a request's images into one
    row (`RadioModel._forward_dynamic`: bsz 1, cu_seqlens over the images), and the backend's unflattened mask is one
    [b, 1, s, s] per cu_seqlens entry, so two images raised "output with shape [1, 6, s, s] doesn't match the
    broadcast shape [2, 6, s, s]" and took the scheduler down. A packed row gets the block-diagonal mask the backend
    builds for flattened batches (each image attends to itself), as varlen attention does on a GPU."""
    if attention_mask is None and cu_seqlens is not None and bsz == 1 and len(cu_seqlens) > 2 \
            and not self.flatten_batch:
        attention_mask = self._generate_mask_cache(q.shape[0], True, tuple(cu_seqlens.cpu().tolist()))
    return original(self, q, k, v, bsz, cu_seqlens, attention_mask, **kwargs)
