"""Linear layers with weights pre-packed once: the fast CPU path for decode-sized matmuls.

torch runs a float32 CPU linear through BLAS, which re-packs the whole weight on every call once more than one
row comes in; at the 1-16 rows of a decode step or a block verify that is most of the cost, and it makes a
verify of 8 tokens cost ~1.5 decode steps. Packing each weight once makes a step ~1.5x faster and a verify of 8
cost about what one step does (docs/performance.md). float32 weights go to flashdraft's own kernel
(kernels.py: blocks of 64 columns streamed at memory speed, a row's result independent of the batch) where it
builds, else to oneDNN's blocked layout, as bfloat16 ones do. The packed copy is taken at load time for
inference; a call with autograd live takes the unpacked weight, and a module whose weights change after packing
must not be packed (its copy would go stale), so only loaded, frozen models are.

The packed float32 copies live in memory the kernel is asked to back with 2 MiB pages (transparent huge pages, where
Linux allows them): a decode step streams every weight once, and through 4 KiB pages the TLB misses cost a 4-row
replay of the default target's linears 26 -> 21 ms on a 2-core Xeon (docs/performance.md). FLASHDRAFT_HUGE_PAGES=0
keeps them in ordinary memory.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

# Rows per call the blocked layout is tuned for: covers decode steps (1) and block verifies (<= 16) alike.
BATCH_HINT = 8
HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20  # weights are carved from chunks this large: at most one partly used huge page wasted a chunk


def packable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """oneDNN packing applies on CPU to float32 weights, and to bfloat16 ones where the CPU has oneDNN's bf16 path
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); FLASHDRAFT_PACKED=0 turns it off."""
    if (os.environ.get("FLASHDRAFT_PACKED", "1") == "0" or torch.device(device).type != "cpu"
            or not torch.backends.mkldnn.is_available()):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _cpu_has_onednn_bf16())


@functools.cache
def _cpu_has_onednn_bf16() -> bool:
    """Whether oneDNN can reorder bf16 weights here; without it, packing raises on e.g. an AVX2-only AMD EPYC."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class BlockedWeight:
    """A float32 weight [out, in] packed for torch.ops.flashdraft.matvec: blocks [ceil(out / 64), in, 64]."""

    blocks: torch.Tensor
    out_features: int


def huge_pages_allowed() -> bool:
    """Whether packed weights go to memory madvised for transparent huge pages (Linux; FLASHDRAFT_HUGE_PAGES=0: no)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("FLASHDRAFT_HUGE_PAGES", "1") != "0"


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a 2 MiB boundary of private anonymous memory madvised for huge pages; it is unmapped
    when the last tensor viewing it is freed (the tensor holds the mapping)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages are backed huge as they fault in
    except OSError:  # a kernel built without transparent huge pages: ordinary pages, as before
        pass
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


_arena: dict = {"chunk": None, "used": 0}
_arena_lock = threading.Lock()


def huge_page_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of x carved from the current huge-page chunk (a fresh chunk when it does not fit)."""
    nbytes = -(-x.numel() * x.element_size() // 64) * 64  # 64-byte aligned, as the kernel's vector loads like
    with _arena_lock:
        chunk = _arena["chunk"]
        if chunk is None or _arena["used"] + nbytes > chunk.numel():
            chunk, _arena["used"] = huge_page_buffer(max(ARENA_CHUNK, nbytes)), 0
            _arena["chunk"] = chunk
        start = _arena["used"]
        _arena["used"] += nbytes
    out = chunk[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    return out.copy_(x)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | BlockedWeight:
    """weight [out, in] → a packed copy for `linear` (the original stays usable): flashdraft's blocked layout for
    float32 where the native kernel is available (in huge pages where allowed), else an opaque oneDNN tensor."""
    weight = weight.detach()
    if weight.dtype == torch.float32 and kernels.available():
        blocks = torch.ops.flashdraft.matvec_pack(weight.contiguous())
        return BlockedWeight(huge_page_copy(blocks) if huge_pages_allowed() else blocks, weight.shape[0])
    return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor | BlockedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain or a packed weight; x [..., in] → [..., out]."""
    if isinstance(weight, BlockedWeight):
        out = torch.ops.flashdraft.matvec(x.reshape(-1, x.shape[-1]), weight.blocks, weight.out_features)
        out = out.view(*x.shape[:-1], weight.out_features)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or mod.weight.requires_grad):
        return F.linear(x, mod.weight, mod.bias)  # the packed op has no backward (a frozen target's head in training)
    return linear(x, mod.packed_weight, mod.packed_bias)


def pack_linears(model: nn.Module) -> int:
    """Route every nn.Linear of a frozen CPU model through a packed copy of its weight; returns how many.

    Weights stay in place (state_dict, exports and tied embeddings keep working), at the cost of a second copy.
    """
    count = 0
    for mod in model.modules():
        if not isinstance(mod, nn.Linear) or getattr(mod, "packed_weight", None) is not None:
            continue
        if not packable(mod.weight.device, mod.weight.dtype):
            continue
        mod.packed_weight = pack_weight(mod.weight)
        mod.packed_bias = None if mod.bias is None else mod.bias.detach()
        mod.forward = functools.partial(_forward, mod)
        count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether pack_linears has routed any of model's linear layers through a packed weight."""
    return packed_kind(model) is not None


def packed_kind(model: nn.Module) -> str | None:
    """Which kernel runs model's packed linears: "matvec" (flashdraft's), "onednn", or None when unpacked."""
    w = next((m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None), None)
    return None if w is None else "matvec" if isinstance(w, BlockedWeight) else "onednn"
