"""Named model contracts: the MoE geometries the demo, the benchmarks and the tuner speak of."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MoEEpConfigError
from .activations import ActivationSpec, fc1_rows


@dataclass(frozen=True)
class ModelContract:
    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    activation_limit: float | None = None
    note: str = ""

    @property
    def activation_spec(self) -> ActivationSpec:
        return ActivationSpec(self.activation, self.activation_limit)

    def flops(self, tokens: int) -> int:
        """Useful FLOPs of one forward: 2*T*k*(FC1 rows + I)*H (3*H*I per pair when gated)."""
        rows = fc1_rows(self.activation, self.intermediate_size) + self.intermediate_size
        return 2 * tokens * self.top_k * rows * self.hidden_size

    def weight_bytes_per_expert(self, bytes_per_weight: float = 2.0) -> float:
        rows = fc1_rows(self.activation, self.intermediate_size) + self.intermediate_size
        return rows * self.hidden_size * bytes_per_weight

    def with_experts(self, num_experts: int) -> ModelContract:
        from dataclasses import replace

        if num_experts < self.top_k:
            raise MoEEpConfigError(f"--experts {num_experts} is below top_k={self.top_k}")
        return replace(self, num_experts=num_experts, name=f"{self.name}[E={num_experts}]")


CONTRACTS: dict[str, ModelContract] = {
    c.name: c
    for c in (
        ModelContract("tiny", 256, 128, 16, 4, note="small CPU smoke contract"),
        ModelContract("qwen3-30b-a3b", 2048, 768, 128, 8),
        ModelContract("qwen3-235b-a22b", 4096, 1536, 128, 8),
        ModelContract("deepseek-v3", 7168, 2048, 256, 8),
        ModelContract("gpt-oss-120b", 2880, 2880, 128, 4, activation="swiglu_oai"),
        ModelContract(
            "nemotron-relu2", 2688, 1856, 128, 6, activation="relu2", note="Nemotron-H style non-gated ReLU^2"
        ),
    )
}


def get_contract(name: str) -> ModelContract:
    try:
        return CONTRACTS[name]
    except KeyError:
        raise MoEEpConfigError(f"unknown contract {name!r}; known: {', '.join(CONTRACTS)}") from None


__all__ = ["CONTRACTS", "ModelContract", "get_contract"]
