"""The target over a batch of sequences of different lengths: a ragged K/V cache and one padded verify forward.

Row i of the cache holds lens[i] committed positions. A verify forward takes one block per row (an anchor and its
drafts: a chain, or a tree), pads the blocks to one width T, writes each row's new K/V at its own end
(lens[i] .. lens[i] + T) and runs every row at its own positions under its own mask: the committed context of that row
and, inside the block, what the row's chain or tree lets each draft see. Padded query rows see only themselves and
are thrown away; their K/V lie past the row's end and are overwritten by the next forward. Committing a row moves
its end (and, for a tree, first gathers the kept rows to be contiguous), exactly as target.keep_rows does for one
sequence, so each row's cache always equals what decoding that sequence alone would hold.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from . import lean
from . import target as T
from .tree import node_depths


class RaggedLayer(DynamicLayer):
    """One layer's K/V [slots, heads, capacity, head_dim]; the first cache.rows slots are the live rows, and new
    positions land at each row's own end (cache.lens)."""

    def __init__(self, cache: BatchCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True
        shape = (self.cache.slots, key_states.shape[1], self.cache.capacity, key_states.shape[-1])
        self.keys, self.values = key_states.new_zeros(shape), value_states.new_zeros(shape)

    def resize(self, slots: int, capacity: int) -> None:
        """Buffers of `slots` rows × `capacity` positions, the live rows' positions copied over (growth only)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            buf = old.new_zeros(slots, old.shape[1], capacity, old.shape[-1])
            n, m = self.cache.rows, min(old.shape[-2], capacity)
            buf[:n, :, :m] = old[:n, :, :m]
            setattr(self, name, buf)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, (rows, pos) = key_states.shape[0], self.cache.writes  # each row's new positions, set once per forward
        self.keys[rows, :, pos] = key_states.transpose(1, 2)  # indexing puts [n, t] first: [n, t, heads, dim]
        self.values[rows, :, pos] = value_states.transpose(1, 2)
        width = self.cache.width
        return self.keys[:n, :, :width], self.values[:n, :, :width]  # views: nothing is copied to attend

    def get_seq_length(self) -> int:
        return int(self.cache.lens.max()) if len(self.cache.lens) else 0


class BatchCache(DynamicCache):
    """The K/V of several sequences in preallocated row slots; lens[i] positions of row i are committed.

    Rows are a dense prefix of the slots, so attention reads views. Joining copies one sequence into the next free
    slot; leaving moves the last row into the hole (one row's positions, never the whole cache), which reorders the
    rows: remove_rows says how. Positions per row grow by doubling up to the target's context (plus one block of
    padding), never beyond; slots grow by doubling when more rows join than `slots` allowed for.
    """

    def __init__(self, model: PreTrainedModel, slots: int = 8):
        super().__init__(config=model.config)
        self.slots, self.capacity = max(1, slots), 0
        self.limit = T.context_limit(model)
        self.layers = [RaggedLayer(self) for _ in range(T.num_layers(model))]
        self.lens = torch.zeros(0, dtype=torch.long, device=model.device)
        self.width = 0  # keys each verify attends to: max(lens) + the block width
        self.writes: tuple[torch.Tensor, torch.Tensor] | None = None  # ([n, 1] rows, [n, t] positions) of a forward

    @property
    def rows(self) -> int:
        return len(self.lens)

    @torch.inference_mode()  # the buffers are inference tensors; callers need not be in that mode
    def ensure(self, capacity: int, slots: int | None = None) -> None:
        """Room for `capacity` positions in every slot (and at least `slots` slots)."""
        slots = max(self.slots, slots or 0)
        if capacity <= self.capacity and slots == self.slots:
            return
        if capacity > self.capacity:  # doubling amortises growth; the context bounds it
            capacity = max(capacity, min(max(256, 2 * self.capacity), self.limit))
        self.slots, self.capacity = slots, max(capacity, self.capacity)
        for layer in self.layers:
            if layer.is_initialized:
                layer.resize(self.slots, self.capacity)

    def begin(self, t: int) -> None:
        """Before a forward of t positions per row: room for them, and where each row writes (shared by all layers)."""
        self.width = int(self.lens.max()) + t
        self.ensure(self.width)
        self.writes = (torch.arange(self.rows, device=self.lens.device)[:, None],
                       self.lens[:, None] + torch.arange(t, device=self.lens.device))

    @torch.inference_mode()  # the buffers are inference tensors; callers need not be in that mode
    def add_row(self, single: DynamicCache) -> int:
        """Copy a sequence prefilled alone (a target.new_cache) into the next free slot; returns its row."""
        n, row = single.get_seq_length(), self.rows
        self.ensure(n, 2 * self.slots if row == self.slots else None)
        for layer, one in zip(self.layers, single.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(one.keys, one.values)
            layer.keys[row, :, :n] = one.keys[0, :, :n]
            layer.values[row, :, :n] = one.values[0, :, :n]
        self.lens = torch.cat([self.lens, self.lens.new_tensor([n])])
        return row

    @torch.inference_mode()  # the buffers are inference tensors; callers need not be in that mode
    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop these rows, filling each hole with the last row → the new order: new row j was row order[j]."""
        order = list(range(self.rows))
        lens = self.lens.tolist()
        for i in sorted(set(rows), reverse=True):
            last = len(order) - 1
            if i != last:
                n = lens[last]
                for layer in self.layers:
                    if layer.is_initialized:
                        layer.keys[i, :, :n] = layer.keys[last, :, :n]
                        layer.values[i, :, :n] = layer.values[last, :, :n]
                lens[i], order[i] = n, order[last]
            lens.pop()
            order.pop()
        self.lens = self.lens.new_tensor(lens)
        return order

    @torch.inference_mode()  # the buffers are inference tensors; callers need not be in that mode
    def keep(self, row: int, start: int, kept: list[int]) -> None:
        """Row `row` verified a block at `start`: keep its rows `kept` (relative, increasing) as start.. and drop the
        rest (target.keep_rows for one row of the batch)."""
        if kept != list(range(len(kept))):
            idx = torch.tensor(kept, device=self.lens.device) + start
            for layer in self.layers:
                for buf in (layer.keys, layer.values):
                    buf[row, :, start:start + len(kept)] = buf[row, :, idx]  # the gather copies first
        self.lens[row] = start + len(kept)


def batch_inputs(blocks: list[list[int]], parents: list[list[int] | None], lens: list[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ids [N, W] and positions [N, W] on `device`, and what each row's block positions see of its block
    [N, W, W] bool on the CPU, where the ragged kernel and the mask builder read it (a padding position sees itself
    only, so that no row is empty), of a batched verify."""
    n, w = len(blocks), max(len(b) for b in blocks)
    ids = torch.zeros(n, w, dtype=torch.long)
    pos = torch.zeros(n, w, dtype=torch.long)
    see = torch.zeros(n, w, w, dtype=torch.bool)
    pad = torch.arange(w)
    for i, (block, par, start) in enumerate(zip(blocks, parents, lens)):
        k = len(block)
        ids[i, :k] = torch.tensor(block)
        depth = torch.tensor([0] + node_depths(par)) if par is not None else torch.arange(k)
        pos[i] = start + torch.cat([depth, torch.arange(k, w)])  # padding continues past the block, unseen
        see[i, :k, :k] = T.block_visibility(par, k)
        see[i, pad[k:], pad[k:]] = True
    return ids.to(device), pos.to(device), see


def batch_mask(see: torch.Tensor, lens: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask [N, 1, W, max(lens) + W] of a batched verify for SDPA: row i sees its lens[i] committed
    positions and, at lens[i].., its block as `see` [N, W, W] says."""
    n, w = see.shape[:2]
    full = torch.zeros(n, w, max(lens) + w, dtype=torch.bool)
    for i, start in enumerate(lens):
        full[i, :, :start] = True
        full[i, :, start:start + w] = see[i]
    mask = torch.zeros(full.shape, dtype=dtype).masked_fill(~full, torch.finfo(dtype).min)
    return mask[:, None].to(device)


def forward_batch(model: PreTrainedModel, blocks: list[list[int]], parents: list[list[int] | None],
                  cache: BatchCache, layer_ids: list[int]) -> list[T.TargetOutput]:
    """One target forward verifying blocks[i] (anchor + drafts) on top of cache row i → per row: logits [k_i, V]
    (float32) and features [k_i, F] of its real (unpadded) positions."""
    lens = cache.lens.tolist()
    ids, pos, see = batch_inputs(blocks, parents, lens, model.device)
    cache.begin(ids.shape[1])
    lm = lean.current(model) if not torch.is_grad_enabled() else None
    rows = (cache.lens, see) if lm is not None and lean.ragged(lm, ids.shape[1]) else None
    mask = None if rows is not None else batch_mask(see, lens, model.dtype, model.device)
    if lm is not None:
        logits, feats = lean.lean_forward(lm, ids, pos, cache, mask, layer_ids, rows=rows)
        return [T.TargetOutput(logits[i, :len(b)], feats[i, :len(b)] if feats is not None else ids.new_zeros(0))
                for i, b in enumerate(blocks)]
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                output_hidden_states=bool(layer_ids), **{T.cache_kwarg(model): cache})
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1) if layer_ids else None
    return [T.TargetOutput(out.logits[i, :len(b)].float(), feats[i, :len(b)] if feats is not None else ids.new_zeros(0))
            for i, b in enumerate(blocks)]


def supports_batch(model: PreTrainedModel) -> bool:
    """Whether the target can decode batched: every layer full attention (a ragged cache cannot slide a window)."""
    return T.supports_tree(T.new_cache(model))
