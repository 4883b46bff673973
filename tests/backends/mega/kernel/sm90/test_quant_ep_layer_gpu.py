"""The SM90 MXFP8 and NVFP4 backends at world_size > 1 through the public layer API, with loopback
ranks on one GPU (marked ``gpu``): every rank's output against the format-aware single-process
reference (``core.reference_quant.moe_reference_quantized``) on the concatenated global inputs, with
the gates of ``test_quant_gpu`` (format units everywhere, the mean relative error from 128 global
tokens on), outputs poisoned with NaN, a zero-token rank, ranks in different token buckets, uniform /
skewed / empty-expert routing, both dispatches, pre-quantized inputs, the mxfp8 combine wire (against
the reference with ``combine_dtype="mxfp8"``), bitwise repeatability, CUDA-graph replays with other
live counts, and a missing rank raising ``MoEEpTransportError`` then recovering.

Run it in its own pytest process (it sets ``CUDA_DEVICE_MAX_CONNECTIONS`` before CUDA starts).
Kernels: ``scripts/gpu_session.py build`` (``QUANT_EP_CASES``).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import zlib

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.kernel.sm90.block_scaled import ep_token_bucket
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk, relative_errors
from flashinfer.moe_ep.core.reference_quant import moe_reference_quantized, quantize_expert_weights

from .test_quant_gpu import CONFIG_CLS, MAX_UNITS, MEAN_GATE_T, SMALL, _prequantized, calibrated_scales, format_units

pytestmark = pytest.mark.gpu

QUANT_EP_MAX_TOKENS = 1024
#: (name, fmt, world size, knobs, prequantized input, combine wire) of every layer these tests build
#: (prebuilt by scripts/gpu_session.py): the default buckets of both formats, push dispatch, the
#: 128-row shared-memory-dequantization GEMMs, codes and scales as input, the mxfp8 combine wire,
#: swap-AB CTAs of four consumer warpgroups (2 atoms, and 1: a gate/up block over four warpgroups)
QUANT_EP_CASES = [
    ("mxfp8-w2", "mxfp8", 2, None, False, "bf16"),
    ("nvfp4-w2", "nvfp4", 2, None, False, "bf16"),
    ("mxfp8-w4-push", "mxfp8", 4, {"dispatch": "push"}, False, "bf16"),
    ("nvfp4-w2-m128-push", "nvfp4", 2, {"tile_m": 128, "dispatch": "push"}, False, "bf16"),
    ("mxfp8-w2-preq", "mxfp8", 2, None, True, "bf16"),
    ("nvfp4-w2-preq-push", "nvfp4", 2, {"dispatch": "push"}, True, "bf16"),
    ("mxfp8-w2-wire", "mxfp8", 2, None, False, "mxfp8"),
    ("nvfp4-w4-push-wire", "nvfp4", 4, {"dispatch": "push"}, False, "mxfp8"),
    ("nvfp4-w2-wg4", "nvfp4", 2, {"tile_m": 16, "swap_ab": True, "swap_wg": 4, "swap_atoms": 2}, False, "bf16"),
    ("mxfp8-w2-wg4a1", "mxfp8", 2, {"tile_m": 32, "swap_ab": True, "swap_wg": 4, "swap_atoms": 1}, False, "bf16"),
]
GEOMETRY = {**SMALL, "activation": "swiglu", "activation_limit": None}
#: cases on a wider layer: four consumer warpgroups per swap-AB CTA need 512 FC1 rows (2 atoms: two
#: 256-row gate/up blocks) and H = 512 (FC2 rows), which SMALL does not have
WIDE_CASES = {"nvfp4-w2-wg4", "mxfp8-w2-wg4a1"}


def case_geometry(name: str) -> dict:
    return {**GEOMETRY, "hidden_size": 512, "intermediate_size": 256} if name in WIDE_CASES else GEOMETRY


def quant_ep_config(name: str):
    """The config of case ``name`` (the NVFP4 activation scales are runtime values: any serve the build)."""
    _, fmt, _, knobs, preq, wire = next(c for c in QUANT_EP_CASES if c[0] == name)
    return CONFIG_CLS[fmt](**case_geometry(name), knobs=knobs, prequantized_input=preq, combine_dtype=wire)


class World:
    """Every loopback rank's layer of one case, the global quantized weights, one stream per rank."""

    def __init__(self, name: str, timeout_s: float = 2.0) -> None:
        _, fmt, world, knobs, preq, wire = next(c for c in QUANT_EP_CASES if c[0] == name)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        geometry = case_geometry(name)
        e, h, i = geometry["num_experts"], geometry["hidden_size"], geometry["intermediate_size"]
        w13, w2 = make_expert_weights(e, h, i, "swiglu", generator=g, device="cuda")
        self.q = quantize_expert_weights(w13, w2, fmt)
        calib = make_hidden_states(256, h, generator=g, device="cuda")
        self.scales = calibrated_scales(fmt, geometry, self.q, calib)
        self.cfg = CONFIG_CLS[fmt](**geometry, knobs=knobs, prequantized_input=preq, combine_dtype=wire,
                                   **self.scales)  # fmt: skip
        self.name, self.fmt, self.world, self.preq = name, fmt, world, preq
        group = moe.make_loopback_group(world, "cuda")
        e_loc = e // world
        q = self.q
        self.layers = []
        for r in range(world):
            part = slice(r * e_loc, (r + 1) * e_loc)
            pack = moe.MoEWeightPack(q.w13[part], q.w2[part], q.w13_scale[part], q.w2_scale[part],
                                     None if q.w13_global_scale is None else q.w13_global_scale[part],
                                     None if q.w2_global_scale is None else q.w2_global_scale[part])  # fmt: skip
            bootstrap = moe.BootstrapConfig(world_size=world, rank=r, device="cuda", symmetric_memory="loopback",
                                            loopback_group=group, transport_timeout_s=timeout_s)  # fmt: skip
            fleet = moe.FleetParams(e, QUANT_EP_MAX_TOKENS, h)
            layer = moe.MoEEpLayer(bootstrap, fleet, pack, backend=moe.MegaConfig(self.cfg), check_values=False)
            self.layers.append(layer)
        for layer in self.layers:
            layer.warmup()
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()
        self.prime()

    def prime(self) -> None:
        """One forward per token bucket with every rank in that bucket. Loopback only: a kernel
        library's first call loads its CUDA module, which waits for the kernels already on the GPU; when
        one rank's chain is spinning for a peer whose first call of another bucket's library is loading,
        that wait would expire. With every library called once in lockstep, ranks may mix buckets. Rows
        down to 0: at world size 4 the bucket of the fewest tokens (``sparse16``) serves 0 rows only."""
        c, fronts = self.cfg, self.layers[0].backend.frontends
        first_rows: dict[str, int] = {}
        for t in range(QUANT_EP_MAX_TOKENS, -1, -1):
            first_rows[ep_token_bucket(t, self.world, c.top_k, c.num_experts, c.weight_format, fronts)] = t
        for t in first_rows.values():
            inputs = self.inputs([t] * self.world, "uniform", seed=t)
            self.check(inputs, self.forward(inputs), f"priming {t} rows")

    def inputs(self, tokens: list[int], routing: str, seed: int) -> list[moe.MoEEpTensors]:
        """Every rank's inputs (with codes and scales for a pre-quantized case) and, as ``self.ref_x``,
        the reference's global input."""
        g = torch.Generator().manual_seed(seed)
        out, xs, refs = [], [], []
        for r, t in enumerate(tokens):
            x = make_hidden_states(t, self.cfg.hidden_size, generator=g, device="cuda")
            ids, w = make_topk(t, self.cfg.num_experts, self.cfg.top_k, routing=routing, generator=g, device="cuda")
            if self.preq:
                codes, sc, ref_x = _prequantized(self.cfg, x, "random" if r % 2 else "ocp", seed=seed + r)
                out.append(moe.MoEEpTensors(codes, ids, w, scales=sc))
                refs.append(ref_x)
            else:
                out.append(moe.MoEEpTensors(x, ids, w))
            xs.append(x)
        if self.preq:  # the global codes and scales (NVFP4: one static global scale for every rank)
            self.ref_x = (torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]), *refs[0][2:])
        else:
            self.ref_x = torch.cat(xs)
        return out

    def forward(self, inputs: list[moe.MoEEpTensors], ranks=None) -> list[torch.Tensor]:
        outs = [None] * self.world
        for r in ranks if ranks is not None else range(self.world):
            with torch.cuda.stream(self.streams[r]):
                t = inputs[r].topk_ids.shape[0]
                outs[r] = torch.full((t, self.cfg.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
                self.layers[r].forward(inputs[r], output=outs[r])
        torch.cuda.synchronize()
        return outs

    def check(self, inputs: list[moe.MoEEpTensors], outs: list[torch.Tensor], label: str) -> None:
        for layer in self.layers:
            layer.check_transport()
        got = torch.cat(outs)
        scales = {k: v for k, v in self.scales.items() if not (self.preq and k == "input_global_scale")}
        ref, term = moe_reference_quantized(self.ref_x, torch.cat([i.topk_ids for i in inputs]),
                                            torch.cat([i.topk_weights for i in inputs]), self.q, "swiglu", None,
                                            fmt=self.fmt, return_term_scale=True,
                                            combine_dtype=self.cfg.combine_dtype, **scales)  # fmt: skip
        assert not bool(got.isnan().any()), f"{label}: some output rows were never written"
        mean_err, max_err = relative_errors(got, ref)
        units = format_units(got, ref, term, self.fmt)
        exact = (got == ref).float().mean().item() if got.numel() else 1.0
        t = got.shape[0]
        print(f"{self.name} {label} T={t}: mean rel {mean_err:.2e}, max rel {max_err:.2e}, {units:.2f} units, "
              f"{exact:.1%} bit-equal")  # fmt: skip
        assert units <= MAX_UNITS, (label, mean_err, max_err, units)
        assert t < MEAN_GATE_T or mean_err < 1e-2, (label, mean_err, max_err, units)

    def destroy(self) -> None:
        for layer in self.layers:
            layer.destroy()


def _token_cases(world: int) -> list[list[int]]:
    """Per-rank token counts: one token, a zero-token rank, odd sizes, ranks in different buckets
    (the bucket follows ``world * rows``), up to the capacity."""
    return [
        [1] + [0] * (world - 1),
        [7] + [(3 * r) % 5 for r in range(1, world)],
        [60 if r % 2 == 0 else 200 for r in range(world)],
        [1000 - 483 * (r % 2) for r in range(world)],
    ]


@pytest.mark.parametrize("name", [c[0] for c in QUANT_EP_CASES])
def test_loopback_quant_ep_layer_matches_the_reference(name: str) -> None:
    w = World(name)
    for i, tokens in enumerate(_token_cases(w.world)):
        for routing in ("uniform", "skewed", "empty"):
            inputs = w.inputs(tokens, routing, seed=zlib.crc32(f"{name}/{i}/{routing}".encode()))
            first = w.forward(inputs)
            w.check(inputs, first, f"{tokens} {routing}")
            again = w.forward(inputs)
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), f"{tokens}: runs differ"
    w.destroy()


def test_missing_rank_raises_transport_error_then_recovers() -> None:
    w = World("nvfp4-w2", timeout_s=0.2)
    inputs = w.inputs([5, 9], "uniform", seed=3)
    w.forward(inputs, ranks=[0])  # rank 1 never arrives
    with pytest.raises(moe.MoEEpTransportError, match=r"rank 0 of 2: .* on rank 1 timed out"):
        w.layers[0].check_transport()
    for layer in w.layers:
        layer.recover_transport()
    for _ in range(2):
        w.check(inputs, w.forward(inputs), "after recovery")
    w.destroy()


@pytest.mark.parametrize("name", ["mxfp8-w2", "nvfp4-w2-preq-push"])
def test_graph_replays_with_other_live_token_counts(name: str) -> None:
    """Each rank captures one graph over capacity-row buffers with a device-side live count; replays
    with other uneven counts match the reference on the live rows, leave the rest untouched and equal
    an eager forward of the same inputs."""
    w = World(name)
    cap = 256
    template = w.inputs([cap] * w.world, "uniform", seed=40)
    static = []
    for inp in template:
        live = torch.full((1,), cap, dtype=torch.int32, device="cuda")
        scales = None if inp.scales is None else inp.scales.clone()
        x, ids, wts = inp.hidden_states.clone(), inp.topk_ids.clone(), inp.topk_weights.clone()
        static.append(moe.MoEEpTensors(x, ids, wts, scales=scales, num_tokens=live))
    outs = [torch.empty(cap, w.cfg.hidden_size, dtype=torch.bfloat16, device="cuda") for _ in range(w.world)]
    for r in range(w.world):
        with torch.cuda.stream(w.streams[r]):
            w.layers[r].forward(static[r], output=outs[r])
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(w.world)]
    for r in range(w.world):
        with torch.cuda.graph(graphs[r], stream=w.streams[r]):
            w.layers[r].forward(static[r], output=outs[r])
    for i, tokens in enumerate(([0, cap], [77, 1], [cap, 130])):
        inputs = w.inputs(tokens, "skewed", seed=50 + i)
        for s, inp, out in zip(static, inputs, outs, strict=True):
            t = inp.topk_ids.shape[0]
            s.topk_ids.fill_(-1)  # rows past the live count hold garbage that must not matter
            s.hidden_states[:t], s.topk_ids[:t], s.topk_weights[:t] = inp.hidden_states, inp.topk_ids, inp.topk_weights
            if inp.scales is not None:
                s.scales[:t] = inp.scales
            s.num_tokens.fill_(t)
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for r in range(w.world):
            with torch.cuda.stream(w.streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for out, t in zip(outs, tokens, strict=True):
            assert bool(out[t:].isnan().all()), f"{tokens}: rows past the live count were written"
        live_rows = [out[:t] for out, t in zip(outs, tokens, strict=True)]
        w.check(inputs, live_rows, f"graph {tokens}")
        eager = w.forward(inputs)
        assert all(torch.equal(a, b) for a, b in zip(eager, live_rows, strict=True)), f"{tokens}: eager != replay"
    del graphs
    w.destroy()
