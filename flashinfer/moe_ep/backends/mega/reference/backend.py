"""Reference backend: the core reference math, with a real all-to-all dispatch/combine for EP."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ....config import MoEEpTensors, MoEWeightPack
from ....core.reference import combine_topk, expert_outputs
from ....errors import MoEEpConfigError
from ..base import MegaKernelBackend
from .config import ReferenceMegaMoeConfig


class ReferenceMegaMoeBackend(MegaKernelBackend):
    config_cls = ReferenceMegaMoeConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = None
        if self.world_size > 1:
            self.group = self._ep_group()
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

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

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        self.check_unquantized_weights(weights, (torch.bfloat16, torch.float16, torch.float32))
        self.w13, self.w2 = weights.w13, weights.w2

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        x, ids, w = staged.hidden_states, staged.topk_ids, staged.topk_weights
        t, k = ids.shape
        flat = ids.reshape(-1).long()
        x_pairs = x.repeat_interleave(k, dim=0)
        if self.world_size == 1:
            y = expert_outputs(x_pairs, flat, self.w13, self.w2, self.config.activation_spec)
        else:
            y = self._ep_expert_outputs(x_pairs, flat)
        output.copy_(combine_topk(y.view(t, k, self.config.hidden_size), w))
        return output

    def _ep_expert_outputs(self, x_pairs: torch.Tensor, flat_ids: torch.Tensor) -> torch.Tensor:
        """Send each (token, k) row to the rank owning its expert, compute there, send the result back."""
        e_local, h = self.num_local_experts, self.config.hidden_size
        dest = flat_ids // e_local
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        n_recv = sum(recv_split)

        # bf16 rows travel bit-exactly as bytes (gloo's all-to-all takes neither bf16 nor int16).
        x_send = x_pairs[order].view(torch.uint8)
        x_recv = torch.empty(n_recv, 2 * h, dtype=torch.uint8, device=x_pairs.device)
        dist.all_to_all_single(x_recv, x_send, recv_split, send_split, group=self.group)
        ids_recv = torch.empty(n_recv, dtype=torch.int64, device=x_pairs.device)
        dist.all_to_all_single(ids_recv, flat_ids[order].contiguous(), recv_split, send_split, group=self.group)

        local_ids = ids_recv - self.bootstrap.rank * e_local
        y_recv = expert_outputs(x_recv.view(torch.bfloat16), local_ids, self.w13, self.w2, self.config.activation_spec)

        y_back = torch.empty(x_pairs.shape[0], 2 * h, dtype=torch.uint8, device=x_pairs.device)
        dist.all_to_all_single(y_back, y_recv.view(torch.uint8), send_split, recv_split, group=self.group)
        y = torch.empty_like(y_back)
        y[order] = y_back
        return y.view(torch.bfloat16)

    def destroy(self) -> None:
        self.w13 = self.w2 = None


__all__ = ["ReferenceMegaMoeBackend"]
