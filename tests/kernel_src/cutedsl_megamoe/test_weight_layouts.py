"""The BF16 kernel's weight layouts on the CPU: the tiled FC1 layout (``fc1_tiled``) holds every
(tile_n x 64) weight tile as one contiguous block with the same element at each (row, k) coordinate;
the world-size-1 frontend tiles by default and the EP frontend never does (its kernel reads w13 untiled)."""

from __future__ import annotations

import pytest
import torch

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh


def test_tile_weights_places_every_tile_contiguously() -> None:
    e, n, k, tn, tk = 3, 512, 192, 256, 64
    w = torch.randn(e, n, k)
    t = kh.tile_weights(w, tn, tk)
    assert t.shape == (e, n // tn, k // tk, tn, tk) and t.is_contiguous()
    for ei, j, kt in ((0, 0, 0), (2, 1, 2), (1, 1, 0)):
        assert torch.equal(t[ei, j, kt], w[ei, j * tn : (j + 1) * tn, kt * tk : (kt + 1) * tk])
    flat = t.reshape(-1)  # tile (1, 1, 2) starts at ((1 * 2 + 1) * 3 + 2) tiles of tn * tk elements
    start = ((1 * (n // tn) + 1) * (k // tk) + 2) * tn * tk
    assert torch.equal(flat[start : start + tn * tk].view(tn, tk), w[1, tn:, 2 * tk :])
    assert torch.equal(kh.untile_weights(t), w)
    with pytest.raises(ValueError, match="multiples"):
        kh.tile_weights(w, 384, tk)


def test_frontends_prepare_tiled_fc1_weights_at_world_size_1_only() -> None:
    g = drop.Geometry(256, 128, 4, 2, "swiglu", None)
    w13, w2 = torch.randn(4, 256, 256), torch.randn(4, 256, 128)
    fe = drop.Bf16Frontend(g, drop.Bf16Knobs(fc1_tile_n=128, fc2_tile_n=128))
    p13, p2 = fe.prepare_weights(w13, w2)
    assert p13.shape == (4, 2, 4, 128, 64) and torch.equal(p2, w2)
    assert torch.equal(kh.untile_weights(p13), kh.interleave_gate_up(w13, 128))
    flat, _ = drop.Bf16Frontend(g, drop.Bf16Knobs(fc1_tile_n=128, fc2_tile_n=128, fc1_tiled=False)).prepare_weights(
        w13, w2
    )
    assert torch.equal(flat, kh.interleave_gate_up(w13, 128))
    ep = drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2))
    assert ep.prepare_weights(w13, w2)[0].dim() == 3
