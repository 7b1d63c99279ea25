"""Tail-Replay in a PD (prefill/decode disaggregated) deployment of SGLang.

The prefill server (P) runs Tail-Replay as a colocated server does: its requests go through the ordinary extend
path, so the match, the replay, the capture and the anchors are unchanged, and the request's live mamba slot, which
the replay wrote before the extend, is the state SGLang sends to the decode server with the last chunk (no hidden
rows cross the wire). The decode server (D) never replays: it receives the final state. What D needs is:
- the labels: P's per-request `tail_replay_*` values ride to D in spare int32 slots of the aux metadata row SGLang
  already transfers (`MetadataBuffers.cached_tokens[:, 7:16]`: slots 0-6 are SGLang's, 7-15 spare), written on P
  after `set_buf` (`relay_to_decode`), read on D when the transfer is committed (`take_relayed`), and streamed by
  D as a colocated server streams them (`visibility.py`);
- with `--disaggregation-decode-enable-radix-cache`, a radix cache that reuses only KV whose labels are honest
  (`cache/decode_component.py`): the relayed label taints the KV an approximate request leaves in D's tree.
"""

import math
import struct

from tailreplay_sglang.cache.request import REQ_ATTR, TailReplayReq, state_of

FIRST_SLOT = 7  # of the (size, 16) int32 `cached_tokens` rows: SGLang uses 0-6 (utils.py's set_buf)
MARKER = 0x54524C31  # "TRL1": the row was written by a Tail-Replay prefill server (a stock one leaves 0)
_NONE_ANCHOR = -1


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<f", struct.pack("<i", i))[0]


def encode(state) -> list[int]:
    """A request's Tail-Replay values (`cache.request.TailReplayReq`) as the int32 slots the relay writes."""
    anchor = _NONE_ANCHOR if state.anchor is None else state.anchor
    survival = math.nan if state.state_survival is None else state.state_survival
    return [MARKER, state.tokens, int(bool(state.exact)), anchor, _float_bits(state.ms), _float_bits(survival)]


def decode(slots) -> TailReplayReq | None:
    """The request state `encode` wrote, or None where no Tail-Replay prefill server wrote one."""
    slots = [int(s) for s in slots]
    if len(slots) < 6 or slots[0] != MARKER:
        return None
    _, tokens, exact, anchor, ms, survival = slots[:6]
    survival = _bits_float(survival)
    return TailReplayReq(exact=bool(exact), anchor=None if anchor == _NONE_ANCHOR else anchor, tokens=tokens,
                         ms=round(_bits_float(ms), 3),
                         state_survival=None if math.isnan(survival) else round(survival, 6))


def relay_to_decode(runtime, result, buffers, req, *args, **kwargs):
    """P, after `MetadataBuffers.set_buf(req)` (the last chunk's forward and its replay are done): the request's
    values into the spare slots of its row, which the transfer copies to D whole."""
    row = buffers.cached_tokens[req.metadata_buffer_index]
    values = encode(state_of(req))
    row[FIRST_SLOT:FIRST_SLOT + len(values)] = row.new_tensor(values)
    return result


def take_relayed(runtime, result, queue, decode_req, *args, **kwargs):
    """D, after `DecodeTransferQueue._commit_transfer_to_req`: the values P relayed become the request's own, so
    that D streams them and its radix cache taints what an approximate request leaves. A row without the marker
    came from a stock prefill server, which never approximates: exact, nothing replayed."""
    req, idx = decode_req.req, decode_req.metadata_buffer_index
    buffers = queue.metadata_buffers
    if idx is None or idx < 0 or int(buffers.bootstrap_room[idx, 0]) != (req.bootstrap_room or 0):
        return result  # aborted or not a real transfer (SGLang already failed the request)
    relayed = decode(buffers.cached_tokens[idx, FIRST_SLOT:FIRST_SLOT + 6].tolist()) or TailReplayReq(exact=True)
    before = getattr(req, REQ_ATTR, None)
    # a rebootstrap (D sent the request back to P) after D streamed output from an approximate state (review F5)
    if before is not None and getattr(req, "output_ids", None) and not before.exact:
        relayed.emitted_approximate, relayed.exact = True, False
    setattr(req, REQ_ATTR, relayed)
    return result
