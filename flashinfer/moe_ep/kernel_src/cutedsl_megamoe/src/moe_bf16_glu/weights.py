"""Host-side weight-layout preprocessing for the BF16 MoE kernel (torch only)."""

from __future__ import annotations

import torch


def interleave_gate_up(w13: torch.Tensor, tile_n: int) -> torch.Tensor:
    """Reorder FC1 rows so each N tile of ``tile_n`` rows is [gate block | up block].

    ``w13`` is [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up). In the result, rows
    ``[j*tile_n, j*tile_n + tile_n/2)`` are gate rows ``[j*tile_n/2, (j+1)*tile_n/2)`` and the next
    ``tile_n/2`` rows are the up rows of the same range, so one FC1 accumulator tile holds matching
    gate and up columns and the activation runs in the epilogue. Returns a new contiguous tensor.
    """
    if w13.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H], got shape {tuple(w13.shape)}")
    e, two_i, h = w13.shape
    half = tile_n // 2
    if two_i % 2 != 0 or (two_i // 2) % half != 0:
        raise ValueError(f"I={two_i // 2} must be a multiple of tile_n/2={half}")
    blocks = (two_i // 2) // half
    return w13.reshape(e, 2, blocks, half, h).transpose(1, 2).reshape(e, two_i, h).contiguous()


def deinterleave_gate_up(w13_il: torch.Tensor, tile_n: int) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    e, two_i, h = w13_il.shape
    half = tile_n // 2
    blocks = (two_i // 2) // half
    return w13_il.reshape(e, blocks, 2, half, h).transpose(1, 2).reshape(e, two_i, h).contiguous()


def tile_weights(w: torch.Tensor, tile_n: int, tile_k: int) -> torch.Tensor:
    """[E, N, K] -> [E, N/tile_n, K/tile_k, tile_n, tile_k] contiguous: every (tile_n x tile_k) weight tile
    one contiguous block, so each TMA load of a tile reads one run of memory instead of tile_n runs of
    tile_k elements one row pitch apart. Returns a new contiguous tensor."""
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    if n % tile_n or k % tile_k:
        raise ValueError(f"N={n} and K={k} must be multiples of tile_n={tile_n} and tile_k={tile_k}")
    return w.reshape(e, n // tile_n, tile_n, k // tile_k, tile_k).transpose(2, 3).contiguous()


def untile_weights(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`tile_weights`."""
    e, nt, kt, tn, tk = w.shape
    return w.transpose(2, 3).reshape(e, nt * tn, kt * tk).contiguous()
