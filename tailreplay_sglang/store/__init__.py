"""The hidden store: per-token token ids and group input hiddens, addressed by KV slot.

- `hidden_store`: the store (device tier, or host tier with async write-back and tail-only fetch);
- `codec`: how a stored row is encoded (a float dtype as is, or float8 e4m3 with a float32 scale per token);
- `transfer`: host-to-device loads of a hit's tail and the device-to-host write-back.
"""
