"""Reference backend: the core reference math, with a real all-to-all dispatch/combine for EP.

``weight_format`` ``bf16`` runs ``core.reference``; ``mxfp8`` / ``nvfp4`` run ``core.reference_quant``.
In every format the all-to-all moves bf16 hidden rows; the quantized formats quantize them on the rank
that owns the expert. That equals quantizing on the source rank: with the global scale fixed (MXFP8 has
none; NVFP4's is static or all-reduced over the group before dispatch) quantization is per row along H.
The dynamic NVFP4 FC2-input scale is all-reduced likewise, so the EP result equals
``moe_reference_quantized`` on the concatenated inputs (up to fp32 accumulation order).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ....config import MoEEpTensors, MoEWeightPack
from ....core.reference import combine_topk, combine_wire, expert_outputs
from ....core.reference_quant import (
    QuantizedExpertWeights,
    fake_quantize_activation,
    nvfp4_global_scale_of_amax,
    quantized_fc1,
    quantized_fc2,
)
from ....errors import MoEEpConfigError, MoEEpTransportError
from ..base import MegaKernelBackend
from .config import ReferenceMegaMoeConfig


class ReferenceMegaMoeBackend(MegaKernelBackend):
    config_cls = ReferenceMegaMoeConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None
        if self.world_size > 1:
            self.group = self._ep_group()
        self.w13: torch.Tensor | None = None  # bf16 path: as given; quantized: dequantized fp32 (exact)
        self.w2: torch.Tensor | None = None
        self.qweights: QuantizedExpertWeights | None = None

    def _ep_group(self) -> Any:
        b = self.bootstrap
        if not dist.is_available() or not dist.is_initialized():
            raise MoEEpConfigError(
                f"world_size={b.world_size} needs torch.distributed initialized (torchrun, or "
                "dist.init_process_group, or bootstrap_moe_ep_runtime) before building the layer"
            )
        group = b.process_group if b.process_group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (b.world_size, b.rank):
            raise MoEEpConfigError(
                f"BootstrapConfig says rank {b.rank} of {b.world_size}, "
                f"but the EP process group is rank {rank} of {size}"
            )
        backend = dist.get_backend(group)
        if self.device.type == "cpu" and backend != "gloo":
            raise MoEEpConfigError(f"the reference EP path on CPU needs a gloo process group, got {backend!r}")
        return group

    @property
    def weight_format(self) -> str:
        return self.config.weight_format

    def _collective(self, stage: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``collective(*args, group, async_op=True)`` waited for at most ``transport_timeout_s``: a rank that
        never joins (it rejected its inputs, stopped, or runs another forward) costs the others that
        long, then a MoEEpTransportError naming the stage. Over NCCL a wait with a deadline holds the host
        until the collective completes (torch's ``Work.wait``): fine for an oracle, not a serving path."""
        work = collective(*args, group=self.group, async_op=True, **kwargs)
        timeout = self.bootstrap.transport_timeout_s
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            b = self.bootstrap
            raise MoEEpTransportError(
                f"rank {b.rank} of {b.world_size}: the reference backend's {stage} failed or did not complete within "
                f"transport_timeout_s={timeout} s (another rank rejected its inputs, stopped, or is behind: every "
                f"rank must call forward with valid inputs); the process group is then out of step: rebuild it "
                f"and the layer ({exc})"
            ) from exc

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        fmt = self.weight_format
        if fmt == "bf16":
            self.check_unquantized_weights(weights, (torch.bfloat16, torch.float16, torch.float32))
            self.w13, self.w2 = weights.w13, weights.w2
            return
        q = self.check_quantized_weights(weights, fmt)
        self.w13, self.w2 = q.dequantize()  # also rejects NaN element codes and the UE8M0 NaN scale
        self.qweights = q

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        x, ids, w = staged.hidden_states, staged.topk_ids, staged.topk_weights
        t, k = ids.shape
        flat = ids.reshape(-1).long()
        if self.weight_format == "bf16":
            x_pairs = x.repeat_interleave(k, dim=0)
            if self.world_size == 1:
                y = expert_outputs(x_pairs, flat, self.w13, self.w2, self.config.activation_spec)
            else:
                y = self._ep_expert_outputs(x_pairs, flat)
        else:
            y = self._quantized_expert_outputs(staged, flat)
        y = combine_wire(y, self.config.combine_dtype)  # the wire format's rounding, at every world size
        output.copy_(combine_topk(y.view(t, k, self.config.hidden_size), w))
        return output

    # -- the quantized formats --------------------------------------------------------------------
    def _group_amax(self, local: torch.Tensor) -> torch.Tensor:
        """amax over the whole EP group (max is exact and order-free: every rank gets the same value)."""
        amax = local.abs().amax() if local.numel() else torch.zeros((), device=local.device)
        amax = amax.float().reshape(1).clone()
        if self.world_size > 1:
            self._collective("activation amax all-reduce", dist.all_reduce, amax, op=dist.ReduceOp.MAX)
        return amax.reshape(())

    def _activation_global_scale(self, given: float | None, local: torch.Tensor) -> torch.Tensor | None:
        """NVFP4: the static scale, or the dynamic one of the group's whole tensor; MXFP8: None."""
        if self.weight_format != "nvfp4":
            return None
        if given is not None:
            return torch.tensor(given, dtype=torch.float32, device=local.device)
        return nvfp4_global_scale_of_amax(self._group_amax(local))

    def _quantized_expert_outputs(self, staged: MoEEpTensors, flat_ids: torch.Tensor) -> torch.Tensor:
        c, fmt = self.config, self.weight_format
        x = staged.hidden_states
        k = c.top_k
        # Collective in EP (every rank calls it, in the same order): the FC1-input global scale.
        gs1 = self._activation_global_scale(c.input_global_scale, x)

        def experts(x_rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            # Quantized on the owner: per row along H once gs1 is fixed, so equal to the source's bits.
            xq, _ = fake_quantize_activation(x_rows, fmt, gs1)
            a = quantized_fc1(xq, local_ids, self.w13, c.activation_spec)
            gs2 = self._activation_global_scale(c.fc2_input_global_scale, a)  # collective in EP
            aq, _ = fake_quantize_activation(a, fmt, gs2)
            return quantized_fc2(aq, local_ids, self.w2)

        x_pairs = x.repeat_interleave(k, dim=0)
        if self.world_size == 1:
            return experts(x_pairs, flat_ids)
        return self._ep_expert_outputs(x_pairs, flat_ids, experts)

    # -- EP ---------------------------------------------------------------------------------------
    def _ep_expert_outputs(
        self,
        x_pairs: torch.Tensor,
        flat_ids: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Send each (token, k) row to the rank owning its expert, compute there, send the result back.

        ``experts(x_rows bf16 [n, H], local_ids [n]) -> bf16 [n, H]`` (default: the BF16 expert MLPs).
        """
        e_local, h = self.num_local_experts, self.config.hidden_size
        dest = flat_ids // e_local
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        self._collective("dispatch count exchange", dist.all_to_all_single, recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        n_recv = sum(recv_split)

        # bf16 rows travel bit-exactly as bytes (gloo's all-to-all takes neither bf16 nor int16).
        x_send = x_pairs[order].view(torch.uint8)
        x_recv = torch.empty(n_recv, 2 * h, dtype=torch.uint8, device=x_pairs.device)
        self._collective("dispatch of rows", dist.all_to_all_single, x_recv, x_send, recv_split, send_split)
        ids_recv = torch.empty(n_recv, dtype=torch.int64, device=x_pairs.device)
        ids_send = flat_ids[order].contiguous()
        self._collective("dispatch of expert ids", dist.all_to_all_single, ids_recv, ids_send, recv_split, send_split)

        local_ids = ids_recv - self.bootstrap.rank * e_local
        if experts is None:
            y_recv = expert_outputs(
                x_recv.view(torch.bfloat16), local_ids, self.w13, self.w2, self.config.activation_spec
            )
        else:
            y_recv = experts(x_recv.view(torch.bfloat16), local_ids)

        y_back = torch.empty(x_pairs.shape[0], 2 * h, dtype=torch.uint8, device=x_pairs.device)
        y_send = y_recv.view(torch.uint8)
        self._collective("combine", dist.all_to_all_single, y_back, y_send, send_split, recv_split)
        y = torch.empty_like(y_back)
        y[order] = y_back
        return y.view(torch.bfloat16)

    def recover_transport(self) -> None:
        if self.world_size > 1:
            raise MoEEpTransportError(
                "the reference backend cannot bring a torch.distributed group back in step after a timed-out "
                "exchange: destroy the layer, rebuild the process group, and build the layer again"
            )

    def destroy(self) -> None:
        self.w13 = self.w2 = None
        self.qweights = None


__all__ = ["ReferenceMegaMoeBackend"]
