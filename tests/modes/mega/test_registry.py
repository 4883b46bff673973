from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.backends.mega.base import MegaKernelBackend
from flashinfer.moe_ep.errors import MoEEpBackendUnavailableError, MoEEpConfigError
from flashinfer.moe_ep.modes.mega import registry


@dataclass(frozen=True)
class _TestConfig(moe.MegaKernelConfig):
    kernel_name: ClassVar[str] = "test-aligned"


class _AlignedBackend(MegaKernelBackend):
    config_cls = _TestConfig
    hidden_alignment = 64

    def preprocess_weights(self, weights):
        self.w = weights

    def compute(self, staged, output):
        return output.fill_(1.0)


class _UnavailableBackend(_AlignedBackend):
    @classmethod
    def runtime_requirements(cls, device):
        return ["an imaginary accelerator"]


@pytest.fixture
def restore_registry():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def _build(config, h=64):
    return moe.MoEEpLayer(
        moe.BootstrapConfig(device="cpu"),
        moe.FleetParams(4, 8, h),
        moe.MoEWeightPack(torch.ones(1), torch.ones(1)),
        backend=moe.MegaConfig(config),
    )


def test_register_create_and_hooks(restore_registry) -> None:
    moe.register_mega_kernel("test-aligned", _AlignedBackend)
    assert "test-aligned" in moe.registered_mega_kernels()
    layer = _build(_TestConfig(64, 32, 4, 2))
    x = torch.randn(3, 64).bfloat16()
    out = layer.forward(moe.MoEEpTensors(x, torch.tensor([[0, 1]] * 3, dtype=torch.int32), torch.ones(3, 2)))
    assert torch.equal(out, torch.ones(3, 64, dtype=torch.bfloat16))
    with pytest.raises(MoEEpConfigError, match="hidden_size to be a multiple of 64"):
        _build(_TestConfig(96, 32, 4, 2), h=96)
    with pytest.raises(MoEEpConfigError, match="already registered"):
        moe.register_mega_kernel("test-aligned", _AlignedBackend)
    moe.register_mega_kernel("test-aligned", _UnavailableBackend, replace=True)
    with pytest.raises(MoEEpBackendUnavailableError, match="imaginary accelerator"):
        _build(_TestConfig(64, 32, 4, 2))


def test_unknown_and_bad_registrations(restore_registry) -> None:
    with pytest.raises(MoEEpConfigError, match="no mega kernel named"):
        registry.get_mega_backend_class("nope")
    with pytest.raises(MoEEpConfigError, match="MegaKernelBackend subclass"):
        moe.register_mega_kernel("x", object)


def test_builtins_resolve_lazily() -> None:
    assert registry.get_mega_backend_class("reference").__name__ == "ReferenceMegaMoeBackend"
