"""What re-blocking MXFP8 to one scale per 128 of K changes in a GEMM's result (CPU, no GPU needed).

Hopper has no block-scaled MMA. FP8 WGMMA reaches about twice the BF16 rate, but an exact MXFP8
product must fold every 32 of K into the fp32 accumulator with its own two scales, which costs as
many instructions as BF16 WGMMA needs for the same K (TUNING.md, session 10: 0.56x the BF16 tile).
With one scale per 128 of K (DeepGEMM's blocking) the fold happens once per four FP8 WGMMAs. An
MXFP8 tensor can be re-blocked that way: per 128-block the largest of its four UE8M0 exponents
becomes the block's, and the E4M3 codes of the 32-blocks below it are multiplied by 2**-d (d the
exponent difference) and rounded to E4M3 again. That is exact unless a code falls below E4M3's
subnormal grid (2**-9), i.e. for elements about 2**(d-15) of their 128-block's largest or smaller.

This script measures the effect on ``A @ B^T`` against the exact MXFP8 product (both operands as
quantized by ``core.quant.quantize_mxfp8``, products and sums in fp64), with the metrics of the
kernel tests (mean relative error = sum |diff| / sum |ref|; max relative error over |ref| > 1e-2
max |ref|), for activation distributions with and without outlier channels, and two ways to re-block
the activations: ``shift`` (the per-32 codes shifted, as weights from an MXFP8 checkpoint must be) and
``direct`` (quantized from the BF16 values with the 128-block's exponent, which a kernel that
quantizes its own activations can do; it is not the same numbers: MXFP8's per-32 scale saturates
a 32-block's largest elements at 448 where they exceed it, and a 32-block under a larger 128-block
exponent keeps them). For scale, the last column is the MXFP8 format's own error
against the unquantized product. It does not model the FP8 tensor core's own accumulation precision
over 128 of K (``scripts/mxfp8_mma_probe.py``'s ``b128`` check measures that on the GPU).

Usage: ``python scripts/mxfp8_reblock_study.py [--tokens 256] [--seed 0]``
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer.moe_ep.core.quant import quantize_mxfp8, round_to_e4m3

BLOCK = 128


def reblock_shift(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 codes and per-32 UE8M0 exponents -> (codes, per-128 exponents): codes of 32-blocks
    below the 128-block's largest exponent scaled by 2**-d and rounded to E4M3 (RNE)."""
    *lead, k = q.shape
    e = scale.to(torch.int32).reshape(*lead, k // BLOCK, BLOCK // 32)
    emax = e.amax(-1, keepdim=True)
    shifted = q.float().reshape(*lead, k // BLOCK, BLOCK // 32, 32) * torch.exp2((e - emax).float()).unsqueeze(-1)
    return round_to_e4m3(shifted).reshape(*lead, k), emax.squeeze(-1)


def reblock_direct(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 values quantized with one exponent per 128 of K: the largest of the block's four MXFP8
    exponents (equal to what ``quantize_mxfp8`` would give a 128-element block)."""
    _, scale = quantize_mxfp8(x)
    *lead, k = x.shape
    emax = scale.to(torch.int32).reshape(*lead, k // BLOCK, BLOCK // 32).amax(-1)
    v = x.float().reshape(*lead, k // BLOCK, BLOCK) * torch.exp2(127.0 - emax.float()).unsqueeze(-1)
    return round_to_e4m3(v).reshape(*lead, k), emax


def dequant(codes: torch.Tensor, exps: torch.Tensor, block: int) -> torch.Tensor:
    return codes.double() * torch.exp2(exps.double() - 127).repeat_interleave(block, -1)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    mean = ((out - ref).abs().sum() / ref.abs().sum()).item()
    big = ref.abs() > 1e-2 * ref.abs().max()
    return mean, ((out - ref).abs()[big] / ref.abs()[big]).max().item()


def study(name: str, x: torch.Tensor, w: torch.Tensor) -> str:
    qx, sx = quantize_mxfp8(x)
    qw, sw = quantize_mxfp8(w)
    ref = dequant(qx, sx, 32) @ dequant(qw, sw, 32).T
    wq, we = reblock_shift(qw, sw)
    w128 = dequant(wq, we, BLOCK)
    shift = dequant(*reblock_shift(qx, sx), BLOCK) @ w128.T
    direct = dequant(*reblock_direct(x), BLOCK) @ w128.T
    fmt = errors(ref, x.double() @ w.double().T)
    cells = [*errors(shift, ref), *errors(direct, ref), fmt[0]]
    return f"| {name} | {x.shape[1]} | " + " | ".join(f"{c:.1e}" for c in cells) + " |"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    t, h, n, i = a.tokens, 2048, 1536, 768
    w1 = torch.randn(n, h) * 0.02
    w2 = torch.randn(h, i) * 0.02
    student = torch.distributions.StudentT(3.0)

    def outliers(count: int, factor: float) -> torch.Tensor:
        x = torch.randn(t, h)
        x[:, torch.randperm(h)[:count]] *= factor
        return x

    cases = [
        ("FC1, gaussian x", torch.randn(t, h), w1),
        ("FC1, x with 8 channels x100", outliers(8, 100.0), w1),
        ("FC1, x with 32 channels x30", outliers(32, 30.0), w1),
        ("FC1, x per-channel log-normal (sigma 1.5)", torch.randn(t, h) * torch.exp(torch.randn(1, h) * 1.5), w1),
        ("FC1, student-t(3) x and w", student.sample((t, h)), student.sample((n, h)) * 0.02),
        ("FC2, h = silu(g) * u", torch.nn.functional.silu(torch.randn(t, i) * 2) * torch.randn(t, i), w2),
    ]
    print(f"re-blocked (per 128 of K) against exact MXFP8, T = {t}, bf16 inputs, fp64 products")
    print("| case | K | shift: mean | shift: max | direct: mean | direct: max | MXFP8 vs unquantized: mean |")
    print("|---|---|---|---|---|---|---|")
    for name, x, w in cases:
        print(study(name, x.bfloat16().float(), w.bfloat16().float()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
