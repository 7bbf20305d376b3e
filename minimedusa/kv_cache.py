"""A static KV cache: a preallocated key tensor and value tensor for each layer.

Every decoding step writes its new tokens' keys/values in place at explicit slots and attends to
slots [0, S); nothing is concatenated or reallocated, so every step has the same memory layout
(gpt-fast's design). The cache keeps the sequence's length and is the only one to change it:
`next_slots` says where a step writes, `advance` keeps what it wrote, and Medusa's `compact` keeps
only the accepted tree nodes, copied into place (KV compaction, paper section 3).
Left out: paging, sliding windows, quantized caches.

Shapes: L layers, B batch, G key/value heads, M capacity (slots), D head dim, N tokens written.
"""
import torch


class CacheOverflowError(RuntimeError):
    """A write past the cache's capacity (the prompt plus new tokens do not fit)."""


class LayerCache:
    """One layer's keys and values, (B, G, M, D) each, written in place at explicit slots."""

    def __init__(self, shape, device, dtype):
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "LayerCache":
        """A layer cache over these tensors (views of another's: KVCache.row)."""
        layer = cls.__new__(cls)
        layer.k, layer.v = k, v
        return layer

    def update(self, slots, k, v, n_read: int):
        """Store k, v (B, G, N, D) at `slots`: (N,), the same slots in every row, or (B, N),
        each row its own (batched decoding, where the rows' sequences differ in length);
        return slots [0, n_read) of the layer.

        The returned tensors are views of the cache, (B, G, n_read, D) each: no copy.
        """
        if slots.dim() == 1:
            self.k.index_copy_(2, slots, k)
            self.v.index_copy_(2, slots, v)
        else:  # row b's N entries at slots[b]: (B, N, G, D) through the indices
            rows = torch.arange(len(slots), device=slots.device).unsqueeze(1)  # (B, 1)
            self.k[rows, :, slots] = k.transpose(1, 2)
            self.v[rows, :, slots] = v.transpose(1, 2)
        return self.k[:, :, :n_read], self.v[:, :, :n_read]

    def copy_slots(self, src, dst) -> None:
        """Copy the entries at slots `src` (N,) to slots `dst` (N,); reading first makes
        overlapping src/dst safe."""
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))


class KVCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, capacity, head_dim, device, dtype):
        shape = (batch_size, num_kv_heads, capacity, head_dim)  # (B, G, M, D) for each layer
        # note: one pair of tensors per layer rather than one for the model, so that a layer's
        # step (speed/compiled_step.py) owns its own and writes them in place: a write into a
        # slice of one shared tensor made the compiler copy the whole of it at every layer
        self.layers = [LayerCache(shape, device, dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.device = torch.device(device)
        # note: the length lives on the host (a Python int) so that building the next step's
        # slots and mask never waits for the device.
        self.length = 0

    @classmethod
    def for_model(cls, model, capacity, batch_size=1) -> "KVCache":
        cfg, weight = model.config, model.embed.weight
        return cls(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, capacity,
                   cfg.head_dim, weight.device, weight.dtype)

    def row(self, b: int) -> "KVCache":
        """Row b of a batch's cache as a cache of one sequence, empty: views of the row, so what
        is written through it (a prompt's prefill, as for batch-1 decoding) is the batch's."""
        view = KVCache.__new__(KVCache)
        view.layers = [LayerCache.of(layer.k[b:b + 1], layer.v[b:b + 1]) for layer in self.layers]
        view.capacity, view.device, view.length = self.capacity, self.device, 0
        return view

    def keep_rows(self, rows: list[int]) -> None:
        """Keep these rows of a batch's cache, in this order (the others' sequences are done)."""
        index = torch.tensor(rows, device=self.device)
        for layer in self.layers:
            layer.k, layer.v = layer.k[index], layer.v[index]

    def next_slots(self, n: int) -> torch.Tensor:
        """Where the next n tokens are written: slots [length, length + n), (N,)."""
        return self.slots(self.length, n)

    def advance(self, n: int) -> None:
        """The n tokens written at next_slots(n) are now part of the sequence."""
        self.length += n

    def compact(self, kept: list[int]) -> None:
        """Keep, of the tokens written at next_slots(...), those at offsets `kept` (increasing:
        the accepted tree nodes, root first), moved to slots length, length + 1, ...; the
        others (rejected nodes) are dropped: later steps overwrite them. The leading nodes
        already in place (offset i kept as the i-th) are not copied: often the root alone, or
        the root and the first node."""
        in_place = next((i for i, node in enumerate(kept) if node != i), len(kept))
        if in_place < len(kept):
            src = torch.tensor(kept[in_place:], device=self.device) + self.length  # (N,)
            self.copy_slots(src, self.slots(self.length + in_place, len(kept) - in_place))
        self.advance(len(kept))

    def rewind(self, length: int) -> None:
        """Forget every token after the first `length` (timing the same step again)."""
        self.length = min(self.length, length)

    def slots(self, start: int, n: int) -> torch.Tensor:
        """Slots [start, start + n) as a (N,) tensor on the cache's device; checked on the host."""
        if start < 0 or start + n > self.capacity:
            raise CacheOverflowError(f"KV cache overflow: writing slots [{start}, {start + n}) "
                                     f"but the cache holds {self.capacity}")
        return torch.arange(start, start + n, device=self.device)

    def copy_slots(self, src, dst) -> None:
        """Copy every layer's entries at slots `src` (N,) to slots `dst` (N,), e.g. the accepted
        tree nodes to the end of the prefix."""
        for layer in self.layers:
            layer.copy_slots(src, dst)
