#!/usr/bin/env python3
"""End-to-end error of the combine wire formats (``ReferenceMegaMoeConfig.combine_dtype``), on any machine.

For each weight format (bf16, mxfp8, nvfp4) and wire (bf16, mxfp8): ``||out - ref|| / ||ref||`` and the
mean elementwise relative error against the fp32 layer on the unquantized weights, on random inputs of
a contract's H and I (fewer experts than the contract, so that it runs on a CPU in seconds). Numerics
only, no timing: ``python scripts/combine_wire_error.py [--contract qwen3-30b-a3b] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer.moe_ep.core.contracts import get_contract
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk, relative_errors
from flashinfer.moe_ep.core.reference import moe_reference
from flashinfer.moe_ep.core.reference_quant import moe_reference_quantized, quantize_expert_weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contract", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    args = p.parse_args()
    c = get_contract(args.contract)
    g = torch.Generator().manual_seed(7)
    e, k = args.experts, min(c.top_k, args.experts)
    w13, w2 = make_expert_weights(e, c.hidden_size, c.intermediate_size, c.activation, generator=g)
    x = make_hidden_states(args.tokens, c.hidden_size, generator=g)
    ids, w = make_topk(args.tokens, e, k, generator=g)
    act = (c.activation, c.activation_limit)
    dense = moe_reference(x, ids, w, w13, w2, *act)
    print(f"{args.contract} (H {c.hidden_size}, I {c.intermediate_size}), {e} experts, top {k}, T {args.tokens}")
    print(f"{'weights':<8} {'wire':<6} {'norm err':>9} {'mean err':>9}")
    for fmt in ("bf16", "mxfp8", "nvfp4"):
        q = None if fmt == "bf16" else quantize_expert_weights(w13, w2, fmt)
        for wire in ("bf16", "mxfp8"):
            if q is None:
                out = moe_reference(x, ids, w, w13, w2, *act, combine_dtype=wire)
            else:
                out = moe_reference_quantized(x, ids, w, q, *act, fmt=fmt, combine_dtype=wire)
            norm = ((out.double() - dense.double()).norm() / dense.double().norm()).item()
            print(f"{fmt:<8} {wire:<6} {norm:>9.2e} {relative_errors(out, dense)[0]:>9.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
