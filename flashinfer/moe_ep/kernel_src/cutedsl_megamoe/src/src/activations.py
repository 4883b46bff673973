"""Activation functions evaluated in fp32 registers inside kernel epilogues.

Plain Python functions called while tracing a ``@cute.kernel``: they emit inline device code on
``cutlass.Float32`` values. The formulas mirror ``moe_bf16_glu.reference`` exactly (same clamps,
same constants); ``exp`` and ``tanh`` use the hardware approximations, whose error is far below
the bf16 rounding of the result, and so does the approximate reciprocal.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from ..common import constants

_LOG2E = math.log2(math.e)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _sigmoid(x: cutlass.Float32) -> cutlass.Float32:
    # 1 / (1 + 2^(-x*log2(e))): exp2 saturates to +inf for very negative x, giving 0 as wanted.
    e = cute.math.exp2(-x * _LOG2E, fastmath=True)
    return cute.arch.rcp_approx(cutlass.Float32(1.0) + e)


def _relu(x: cutlass.Float32) -> cutlass.Float32:
    return cute.arch.fmax(x, cutlass.Float32(0.0))


def gated_act(act: str, g: cutlass.Float32, u: cutlass.Float32, limit: float | None) -> cutlass.Float32:
    """act(g, u) for the gated activations, all in fp32. ``limit`` is a trace-time constant."""
    if act == constants.ACT_SWIGLU:
        if limit is not None:
            g = cute.arch.fmin(g, cutlass.Float32(limit))
            u = cute.arch.fmax(cute.arch.fmin(u, cutlass.Float32(limit)), cutlass.Float32(-limit))
        return g * _sigmoid(g) * u
    if act == constants.ACT_SWIGLU_OAI:
        lim = constants.SWIGLU_OAI_LIMIT if limit is None else limit
        g = cute.arch.fmin(g, cutlass.Float32(lim))
        u = cute.arch.fmax(cute.arch.fmin(u, cutlass.Float32(lim)), cutlass.Float32(-lim))
        glu = g * _sigmoid(g * constants.SWIGLU_OAI_ALPHA)
        return (u + cutlass.Float32(1.0)) * glu
    if act == constants.ACT_GEGLU:
        inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        return cutlass.Float32(0.5) * g * (cutlass.Float32(1.0) + cute.math.tanh(inner)) * u
    if act == constants.ACT_REGLU:
        return _relu(g) * u
    raise ValueError(f"not a gated activation: {act}")


def plain_act(act: str, h: cutlass.Float32) -> cutlass.Float32:
    """Non-gated activations (FC1 has I rows)."""
    if act == constants.ACT_RELU2:
        r = _relu(h)
        return r * r
    raise ValueError(f"not a non-gated activation: {act}")
