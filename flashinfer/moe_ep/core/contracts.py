"""Named model contracts: the MoE geometries the demo, the benchmarks and the tuner speak of.

Wherever a command takes ``--contract``, it takes a name of ``CONTRACTS`` or a geometry written
``h<hidden>-i<intermediate>-e<experts>-k<top_k>[-<activation>][-limit<L>]`` (``get_contract``), e.g.
``h2048-i1024-e128-k8`` or ``h2688-i1856-e128-k6-relu2``: the activation defaults to swiglu, and the spec is
the contract's name, so the tables and CSVs that print it can be fed back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import MoEEpConfigError
from .activations import ActivationSpec, fc1_rows, validate_activation


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


GEOMETRY_FORM = "h<hidden>-i<intermediate>-e<experts>-k<top_k>[-<activation>][-limit<L>]"
_GEOMETRY = re.compile(r"h(\d+)-i(\d+)-e(\d+)-k(\d+)(?:-((?!limit)[a-z][a-z0-9_]*))?(?:-limit(\d+(?:\.\d*)?))?")


def parse_geometry(spec: str) -> ModelContract:
    """The contract a geometry spec (``GEOMETRY_FORM``) writes, named by the spec itself."""
    m = _GEOMETRY.fullmatch(spec)
    if m is None:
        raise MoEEpConfigError(f"{spec!r} is not a geometry {GEOMETRY_FORM} (e.g. h2048-i768-e128-k8)")
    hidden, inter, experts, top_k = (int(g) for g in m.groups()[:4])
    activation = m.group(5) or "swiglu"
    limit = float(m.group(6)) if m.group(6) else None
    try:
        validate_activation(activation, limit)  # the name, and whether it takes that limit
    except MoEEpConfigError as exc:
        raise MoEEpConfigError(f"{spec!r}: {exc}") from None
    if min(hidden, inter, experts, top_k) < 1:
        raise MoEEpConfigError(f"{spec!r}: hidden, intermediate, experts and top_k must be >= 1")
    if top_k > experts:
        raise MoEEpConfigError(f"{spec!r}: top_k={top_k} exceeds experts={experts}")
    return ModelContract(spec, hidden, inter, experts, top_k, activation, limit, note="a geometry spec")


def get_contract(name: str) -> ModelContract:
    """The named contract, or the geometry ``name`` writes (``GEOMETRY_FORM``)."""
    if name in CONTRACTS:
        return CONTRACTS[name]
    if name[:1] == "h" and name[1:2].isdigit():  # a geometry, or a near miss: its own error
        return parse_geometry(name)
    raise MoEEpConfigError(
        f"unknown contract {name!r}; known: {', '.join(CONTRACTS)}; or a geometry {GEOMETRY_FORM} "
        "(e.g. h2048-i768-e128-k8)"
    )


__all__ = ["CONTRACTS", "GEOMETRY_FORM", "ModelContract", "get_contract", "parse_geometry"]
