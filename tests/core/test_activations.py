import math

import pytest
import torch

from flashinfer.moe_ep.core.activations import ACTIVATIONS, ActivationSpec, apply_activation, fc1_rows
from flashinfer.moe_ep.errors import MoEEpConfigError


def _scalar(name: str, g: float, u: float, limit: float | None = None) -> float:
    h = torch.tensor([[g, u]], dtype=torch.float64)
    if name == "relu2":
        h = torch.tensor([[g]], dtype=torch.float64)
    return apply_activation(h, name, limit).item()


def test_hand_computed_values() -> None:
    silu = lambda x: x / (1 + math.exp(-x))  # noqa: E731
    assert _scalar("swiglu", 1.5, -2.0) == pytest.approx(silu(1.5) * -2.0, rel=1e-6)
    assert _scalar("reglu", -1.0, 3.0) == 0.0
    assert _scalar("reglu", 2.0, 3.0) == pytest.approx(6.0)
    assert _scalar("relu2", -3.0, 0) == 0.0
    assert _scalar("relu2", 3.0, 0) == pytest.approx(9.0)
    gelu = 0.5 * 0.7 * (1 + math.tanh(math.sqrt(2 / math.pi) * (0.7 + 0.044715 * 0.7**3)))
    assert _scalar("geglu", 0.7, 2.0) == pytest.approx(gelu * 2.0, rel=1e-6)


def test_swiglu_clamp_limit() -> None:
    silu = lambda x: x / (1 + math.exp(-x))  # noqa: E731
    # gate clamped above only, up clamped both ways
    assert _scalar("swiglu", 10.0, -20.0, limit=5.0) == pytest.approx(silu(5.0) * -5.0, rel=1e-6)
    assert _scalar("swiglu", -10.0, 2.0, limit=5.0) == pytest.approx(silu(-10.0) * 2.0, rel=1e-6)


def test_swiglu_oai_matches_gpt_oss_formula() -> None:
    g, u = 9.0, -8.0
    gc, uc = min(g, 7.0), max(min(u, 7.0), -7.0)
    want = (uc + 1) * gc / (1 + math.exp(-1.702 * gc))
    assert _scalar("swiglu_oai", g, u) == pytest.approx(want, rel=1e-6)


def test_vectorized_split_gate_then_up() -> None:
    h = torch.randn(4, 6, dtype=torch.float64)
    out = apply_activation(h, "reglu")
    assert torch.allclose(out, torch.relu(h[:, :3]) * h[:, 3:])


def test_fc1_rows_and_validation() -> None:
    assert fc1_rows("swiglu", 7) == 14 and fc1_rows("relu2", 7) == 7
    for name in ACTIVATIONS:
        ActivationSpec(name)
    with pytest.raises(MoEEpConfigError, match="unknown activation"):
        ActivationSpec("gelu")
    with pytest.raises(MoEEpConfigError, match="takes no clamp"):
        ActivationSpec("geglu", 3.0)
    with pytest.raises(MoEEpConfigError, match="finite positive"):
        ActivationSpec("swiglu", -1.0)
