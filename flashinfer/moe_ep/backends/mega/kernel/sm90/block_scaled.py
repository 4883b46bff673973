"""What the SM90 MXFP8 and NVFP4 backends share: config fields, weight checks and packing, launch.

The per-format packages (``mxfp8_mxfp8_bf16_cutedsl``, ``nvfp4_nvfp4_bf16_cutedsl``) only name their
format and the drop frontend. Semantics: ``flashinfer.moe_ep.core.reference_quant`` (activations
quantized along H by the kernel, FC1 on the dequantized operands, the activation requantized to the
FC2 input format, bf16 y, ordered combine); NVFP4 activation global scales are static config fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from .....config import MegaKernelConfig, MoEEpTensors, MoEWeightPack
from .....core.validation import is_positive_finite
from .....errors import MoEEpConfigError
from ...base import MegaKernelBackend
from .runtime import (
    SIZE_ALIGNMENT,
    acquire_pooled_workspace,
    check_kernel_config,
    load_kernel,
    make_geometry,
    pool_owner,
    release_pooled_workspace,
    sm90_requirements,
    warmup_forward,
)


@dataclass(frozen=True)
class Sm90BlockScaledConfig(MegaKernelConfig):
    """Base of the SM90 block-scaled configs.

    ``knobs``: ``None`` (defaults: the widest N tiles; per token bucket, measured on the H200,
    TUNING.md, ``BUCKETS``: the swap-AB GEMMs with a token tile growing with the tokens per expert,
    16 to 128; where they cannot tile the shape, 64-row M tiles up to 32 tokens per expert and 128-row
    ones above) or a mapping of compile-time knobs for every T (``tile_m`` 64/128, or 16/32/64/128 with
    ``swap_ab``, ``swap_wg`` 1/2/4, ``swap_atoms`` 1/2/4 (4 warpgroups with 1 or 2 atoms),
    ``swap_stagger`` 0-8 and, at world size 1, ``gather_in_fc1``, ``swap_tma_store`` (FC2's epilogue through shared
    memory and TMA stores) and the GEMV (``gemv``, 8-token tiles; its pair chain
    ``pair_blocks`` / ``pair_combine``, at most ``num_experts / top_k`` tokens); ``fc1_tile_n``,
    ``fc2_tile_n``, ``fc1_stages``, ``fc2_stages``, ``num_sms``; at ``world_size > 1`` also
    ``dispatch``, ``"pull"`` (default) or ``"push"``). Hidden and intermediate sizes must be
    multiples of 64.

    At ``world_size > 1`` the layer runs the in-kernel EP protocol of the BF16 kernel around the
    block-scaled GEMMs (``block_scaled_ep.py``): each rank quantizes its tokens once and the
    dispatch moves their exact BF16 values; the combine wire is ``combine_dtype`` (bf16, or mxfp8).

    ``prequantized_input``: the layer takes activations already in the weight format, as codes in
    ``MoEEpTensors.hidden_states`` and block scales in ``MoEEpTensors.scales`` (MXFP8: float8_e4m3fn
    [T, H] and uint8 UE8M0 [T, H/32]; NVFP4: uint8 E2M1 pairs [T, H/2], element 2i in the low nibble,
    and float8_e4m3fn [T, H/16], with the global scale ``input_global_scale``). The kernel dequantizes
    them exactly in its gather and does not requantize, so the FC1 input is the given values whatever
    rule chose the scales. Default False: bf16 hidden_states, quantized by the kernel.
    """

    prequantized_input: bool = field(default=False, kw_only=True)

    @property
    def input_format(self) -> str:
        return self.weight_format if self.prequantized_input else "bf16"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.prequantized_input, bool):
            raise MoEEpConfigError(f"prequantized_input must be a bool, got {self.prequantized_input!r}")
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        check_kernel_config(self, [f.name for f in fields(drop.QuantKnobs)] + list(EP_KNOBS))


def _positive_scale(owner: str, name: str, value: object) -> None:
    if not is_positive_finite(value):
        raise MoEEpConfigError(f"{owner}.{name} must be a finite float > 0, got {value!r}")


@dataclass(frozen=True)
class Sm90Nvfp4ConfigFields(Sm90BlockScaledConfig):
    """NVFP4 adds the static activation global scales (what ModelOpt checkpoints ship as
    ``input_scale``): the dequantization multipliers of the FC1 and FC2 inputs. The kernel has no
    dynamic (whole-tensor amax) mode: that would need a device-wide reduction between FC1 and FC2."""

    input_global_scale: float = field(default=1.0, kw_only=True)
    fc2_input_global_scale: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("input_global_scale", "fc2_input_global_scale"):
            _positive_scale(type(self).__name__, name, getattr(self, name))


#: knobs of the block-scaled configs that only the expert-parallel kernel takes
EP_KNOBS = ("dispatch",)


class Sm90BlockScaledBackend(MegaKernelBackend):
    """Weights: ``MoEWeightPack`` in the layout of ``core.reference_quant``. World size 1 here; at
    ``world_size > 1`` construction returns the EP backend (``block_scaled_ep.Sm90BlockScaledEpBackend``)."""

    hidden_alignment: ClassVar[int] = SIZE_ALIGNMENT
    intermediate_alignment: ClassVar[int] = SIZE_ALIGNMENT

    @classmethod
    def runtime_requirements(cls, device: torch.device) -> list[str]:
        return sm90_requirements(device)

    #: True on the expert-parallel subclasses
    expert_parallel: ClassVar[bool] = False

    def __new__(cls, config: Any, bootstrap: Any, *args: Any, **kwargs: Any) -> Sm90BlockScaledBackend:
        if getattr(bootstrap, "world_size", 1) > 1 and not cls.expert_parallel:
            return super().__new__(cls.ep_backend())  # the in-kernel EP protocol (a subclass of cls)
        return super().__new__(cls)

    @classmethod
    def ep_backend(cls) -> type[Sm90BlockScaledBackend]:
        """The format's expert-parallel subclass (``block_scaled_ep.Sm90BlockScaledEpBackend``)."""
        raise NotImplementedError(f"{cls.__name__} has no expert-parallel backend")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One frontend per token bucket (one weight layout: the tiles differ, not the packing), chosen
        # per forward from the host-side T; one workspace serves all of them.
        self.frontends = bucket_frontends(self.config, self.num_local_experts)
        check_launch_limits(self.config, self.frontends, self.num_local_experts, self.fleet.max_tokens_per_rank)
        self.frontend = self.frontends[BUCKETS[-1].name]  # the weight layout (every bucket packs alike)
        self.weights: Any = None
        self.workspace: dict[str, torch.Tensor] = {}
        self.act_gscale: torch.Tensor | None = None

    @property
    def fmt(self) -> str:
        return self.config.weight_format

    def preprocess_weights(self, weights: MoEWeightPack) -> None:
        c = self.config
        q = self.check_quantized_weights(weights, self.fmt)
        q.reject_nan_codes()  # the kernel would turn NaN codes into numbers
        q.reject_negative_scales()  # the kernel's NVFP4 scale bytes have no sign
        self.weights = self.frontend.prepare_weights(
            q.w13, q.w13_scale, q.w2, q.w2_scale, q.w13_global_scale, q.w2_global_scale
        )
        scales = [c.input_global_scale, c.fc2_input_global_scale] if self.fmt == "nvfp4" else [1.0, 1.0]
        self.act_gscale = torch.tensor(scales, dtype=torch.float32, device=self.device)
        self.no_scales = torch.zeros(1, dtype=torch.uint8, device=self.device)

    def allocate_workspace(self) -> None:
        """The pooled workspace (``runtime.acquire_pooled_workspace``), shared by every token bucket."""
        frontends = list(dict.fromkeys(self.frontends.values()))
        self._workspace_key, ws_of = acquire_pooled_workspace(
            frontends, self.fleet.max_tokens_per_rank, self.device, pool_owner(self)
        )
        self.workspace = {name: ws_of[id(fe)] for name, fe in self.frontends.items()}

    def warmup(self) -> None:
        for fe in self.frontends.values():
            load_kernel(fe)
        warmup_forward(self)

    def _bucket(self, tokens: int) -> str:
        """The token bucket of a forward of ``tokens`` rows (host-side shapes: no device sync)."""
        c = self.config
        return token_bucket(tokens, c.top_k, self.num_local_experts, c.weight_format, self.frontends, c.hidden_size)

    def frontend_for(self, tokens: int) -> Any:
        """The drop frontend (kernel and knobs) that serves a forward of ``tokens`` rows: its token
        bucket's (``scripts/drop_ab.py --bucket-overrides`` starts from its knobs)."""
        return self.frontends[self._bucket(tokens)]

    def compute(self, staged: MoEEpTensors, output: torch.Tensor) -> torch.Tensor:
        t = staged.hidden_states.shape[0]
        if t == 0:
            return output
        bucket = self._bucket(t)
        frontend = self.frontends[bucket]
        load_kernel(frontend)
        assert self.act_gscale is not None
        x, x_scale = staged.hidden_states, staged.scales
        if x_scale is None:  # bf16 input: the scale argument is not read
            x_scale = self.no_scales
        else:  # codes and scales as the kernel reads them (byte tensors; views, no copy)
            x, x_scale = x.view(torch.uint8), x_scale.view(torch.uint8)
        return frontend.launch(
            x,
            x_scale,
            staged.topk_ids,
            staged.topk_weights,
            self.weights,
            self.act_gscale,
            output,
            self.workspace[bucket],
        )

    def destroy(self) -> None:
        self.weights = None
        if self.workspace:
            release_pooled_workspace(self._workspace_key)
        self.workspace = {}


@dataclass(frozen=True)
class TokenBucket:
    """One token bucket of the block-scaled backends: the T it serves (up to ``max_pairs_per_expert`` =
    T * top_k / experts, the average rows of an expert's GEMMs), the knobs it sets over the defaults, and
    the bucket whose knobs serve it where the swap-AB GEMMs cannot tile the shape (``fallback``), and per
    weight format the knobs that differ from ``knobs`` (``format_knobs``) and the bound where it differs
    from ``max_pairs_per_expert`` (``format_max_pairs``), and per format the knobs that hold only where a cluster
    holds a token's pairs (``cluster_knobs``: ``gemv_pair_cluster`` and what goes with it; where top_k is larger
    the bucket runs without them), and the knobs that hold only where the layer's activations arrive as BF16
    (``bf16_input_knobs``: ``gemv_row_tma``; a ``prequantized_input`` layer's bucket runs without them). In the
    formats of ``one_wave`` the bucket
    serves only while its swap-AB FC1 fits one wave of its grid when every pair has an expert of its own
    (``min(T * top_k, experts)`` busy experts, of which a rank holds its share; one CTA tile per block
    of rows each), ``fc1_parts`` CTAs per tile (its split K); a bucket of more than one part serves only
    where that split runs: never without its frontend, with a fallback one, or where FC1's K is too
    short to split (``QuantFrontend.fc1_splits_into``). ``many_waves`` (per format: pairs per expert p0,
    H h0): past p0 pairs per expert the format's bucket serves (up to its bound) whatever its FC1 waves,
    but only where H >= h0 (a long K: its smaller CTAs' fixed cost is paid back) and its swap-AB frontend
    runs the split. ``min_pairs_per_expert``: the bucket serves only past that many pairs per expert (a window
    between the buckets before it and the ones after)."""

    name: str
    knobs: dict[str, Any]
    max_pairs_per_expert: float | None = None
    fallback: str | None = None
    format_knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_max_pairs: dict[str, float] = field(default_factory=dict)
    cluster_knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    bf16_input_knobs: dict[str, Any] = field(default_factory=dict)
    one_wave: tuple[str, ...] = ()
    fc1_parts: int = 1
    formats: tuple[str, ...] | None = None
    max_hidden: int | None = None
    many_waves: dict[str, tuple[float, int]] = field(default_factory=dict)
    min_pairs_per_expert: float | None = None

    def serves(
        self,
        t: int,
        top_k: int,
        num_experts: int,
        fmt: str | None = None,
        frontend: Any = None,
        hidden: int | None = None,
    ) -> bool:
        """Whether the bucket serves ``t`` tokens; ``frontend`` (this bucket's) for the ``one_wave`` rule,
        which without it does not apply; ``hidden`` (H) for ``max_hidden`` and ``many_waves`` (a bucket with a
        bound on H or a list of ``formats`` serves nothing where H or the format is not given, nor does
        ``many_waves`` past its p0 without H or the frontend)."""
        if not self.applies_to(fmt, hidden):
            return False
        if self.min_pairs_per_expert is not None and t * top_k <= self.min_pairs_per_expert * num_experts:
            return False
        bound = self.format_max_pairs.get(fmt, self.max_pairs_per_expert)  # fmt None: the shared bound
        if bound is not None and t * top_k > bound * num_experts:
            return False
        from_pairs, min_hidden = self.many_waves.get(fmt, (None, None))
        if from_pairs is not None and t * top_k > from_pairs * num_experts:
            # whatever the FC1 waves, where K is long and the swap-AB frontend (not a fallback) takes the split
            return (
                hidden is not None
                and hidden >= min_hidden
                and frontend is not None
                and frontend.fc1_cta_tiles(1) is not None
                and (self.fc1_parts == 1 or frontend.fc1_splits_into(self.fc1_parts))
            )
        if fmt not in self.one_wave or frontend is None:
            return self.fc1_parts == 1
        busy = math.ceil(min(t * top_k, num_experts) * frontend.local_experts / num_experts)
        tiles = frontend.fc1_cta_tiles(busy)
        # a fallback frontend (no swap-AB), or an FC1 whose K is too short to split: the pairs decide
        if tiles is None or (self.fc1_parts > 1 and not frontend.fc1_splits_into(self.fc1_parts)):
            return self.fc1_parts == 1
        return tiles * self.fc1_parts <= frontend.knobs.grid

    def applies_to(self, fmt: str | None, hidden: int | None) -> bool:
        """Whether the bucket can serve a layer of weight format ``fmt`` and H = ``hidden`` at all
        (``formats``, ``max_hidden``)."""
        if self.formats is not None and fmt not in self.formats:
            return False
        return self.max_hidden is None or (hidden is not None and hidden <= self.max_hidden)

    def knobs_for(self, fmt: str, top_k: int | None = None, prequantized: bool = False) -> dict[str, Any]:
        """The knobs this bucket sets for weight format ``fmt``: with its ``cluster_knobs`` unless ``top_k`` (the
        layer's, where given) is more than a cluster holds (``drop.PAIR_CLUSTER_MAX``: the bucket's GEMV then
        combines through its counters, as before drop v56, with the format's knobs of that chain), and with its
        ``bf16_input_knobs`` unless the layer's activations arrive ``prequantized`` (codes and scales)."""
        from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

        knobs = {**self.knobs, **self.format_knobs.get(fmt, {})}
        if top_k is None or top_k <= drop.PAIR_CLUSTER_MAX:
            knobs.update(self.cluster_knobs.get(fmt, {}))
        if not prequantized:
            knobs.update(self.bf16_input_knobs)
        return knobs


#: Token buckets, in order. Measured on the H200 (TUNING.md; qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3,
#: MXFP8 and NVFP4):
#: - ``split16``: ``sparse16`` with split K (``swap_split_k=2``: a CTA tile's K halves on CTAs of their
#:   own, the last one summing them; drop v31: parts of 16 K tiles at least, so qwen3-30b-a3b's FC2, 12
#:   K tiles, runs whole), while twice its FC1 tiles over the busy experts fit one wave and FC1's K
#:   splits (H >= 2048: parts of 16 K tiles; ``fc1_parts``;
#:   qwen3-30b-a3b T = 1: 96 of 132; not T = 2, nor T = 1 on the larger contracts, where the split
#:   kernel, not splitting, ran 0-5 % behind ``sparse16`` in one call). Session 20 run 7 (drop v31, CUDA
#:   graphs of 8 layers, twice): qwen3-30b-a3b T = 1 24.7-24.8 against 27.9-28.2 us (NVFP4), 25.5
#:   against 27.7-27.9 us (MXFP8); Nsight Compute (v30) FC1 19.4 -> 16.7 us, 17.1 -> 14.3 us. Not the
#:   2x a halved K loop would give: each CTA spends ~6 us outside its K loop.
#: - ``sparse16``: at most half a pair per expert on average (most experts idle: T = 1, and up to T = 8
#:   on qwen3 and 16 on deepseek-v3): 16-token tiles with 2 WGMMA atoms (128 weight rows) per
#:   warpgroup, so the few busy experts' weights are converted by twice the warpgroups (CTAs of 256
#:   rows over two warpgroups instead of 512). Session 15, CUDA graphs of 8 layers: against ``swap1``
#:   (one warpgroup of 4 atoms, session 6) at T = 1 equal to 13 % faster on all three contracts in both
#:   formats; against ``swap16`` at T = 2-8 up to 38 % faster (qwen3-30b-a3b T = 2), 1-5 % slower at
#:   T = 2 on qwen3-235b-a22b and deepseek-v3, even at 16 on deepseek-v3 (half a pair per expert).
#:   NVFP4 only up to 1/8 pair per expert and in one FC1 wave (below), since its ``swap16``
#:   has four warpgroups: session 18 (interleaved A/B, outputs bitwise equal), ``sparse16`` 16-28 % ahead
#:   at qwen3-30b-a3b T = 2 and 18-31 % at T = 1, ``swap16`` 7-10 % ahead at qwen3-30b-a3b T = 3-4 and
#:   2-13 % from 1/4 pair per expert on; it also wins qwen3-235b-a22b T = 2 and deepseek-v3 T = 2
#:   and 4 (12 %), which a bound by pairs per expert cannot tell from qwen3-30b-a3b T = 2. What tells
#:   them apart is the FC1 wave (``one_wave``): ``sparse16`` wins while its 256-row FC1 tiles fit in
#:   one wave of 132 CTAs (T = 1: 48 / 96 / 128 tiles on the three contracts; qwen3-30b-a3b T = 2: 96)
#:   and loses from two waves on (qwen3-30b-a3b T = 3-4: 144 / 192; qwen3-235b-a22b T = 2: 192;
#:   deepseek-v3 T = 2 / 4: 256 / 512), where ``swap16`` needs half the CTAs (512 rows, 16 warps each).
#:   Session 19 (interleaved A/B, outputs bitwise equal): the moved points 11-13 % faster, the kept ones
#:   16-28 % ahead of ``swap16``; NVFP4 ``sparse16`` now serves T = 1-2 on qwen3-30b-a3b, T = 1 on the
#:   others. MXFP8's ``sparse16`` wins at two waves too (its ``swap16`` has two warpgroups): pairs only.
#: - ``swap16`` ... ``swap128``: swap-AB (weights dequantized in registers, tokens as WGMMA N) with
#:   two warpgroups and the token tile that wins at that many pairs per expert. Session 6: 16-token
#:   tiles beat 32 up to T = 128 on qwen3 (8 pairs per expert). Session 7 run 2 (T = 256 to 16384):
#:   32-token tiles win at 16 pairs per expert, 64-token tiles at 32 (MXFP8 qwen3 T = 512: 1.32 / 1.44x
#:   BF16 against 1.10 / 1.24 with 32; deepseek-v3 T = 1024: 1.60 against 1.30 with 128 and 1.36 with
#:   64-row tiles), 128-token tiles from 64 up (every contract, both formats, within 3 % where another
#:   won) and at every T >= 2048 by 4-45 % over 128-row tiles. ``swap16`` staggers its two consumer
#:   warpgroups by 4 K tiles (session 16, interleaved A/B, outputs bitwise equal: NVFP4 on drop v25 0-5 %
#:   faster at T = 16 and 128 on all three contracts; MXFP8 within 1.5 % either way on the drop's first
#:   candidate); not ``swap32`` / ``swap64`` (NVFP4 on v25 -1 to +3 %), ``swap128`` (1-2 % slower at
#:   T >= 1024) nor ``sparse16`` (-3 to +2 %). ``swap32`` ... ``swap128`` prepare each token's row once
#:   and let FC1 gather its token columns (``gather_in_fc1``, drop v27, session 17, interleaved A/B,
#:   outputs bitwise equal: NVFP4 0.5-11 % faster at T = 256-1024 on all three contracts, within
#:   -0.6 / +1.4 % at T >= 4096; MXFP8 2-3.4 % faster at ``swap32``, -1.3 to +3.4 % at ``swap128``, but 2-4 %
#:   slower at ``swap64`` on qwen3-235b-a22b and deepseek-v3 in two runs, so MXFP8's ``swap64`` keeps
#:   the per-pair gather); not ``sparse16`` / ``swap16``, where it costs up to 5 % (one more dependent
#:   load before FC1's first token tile, no traffic to save). NVFP4's ``swap16`` gives each CTA four
#:   consumer warpgroups of 2 atoms (``swap_wg=4``, drop v28: 16 converting warps on an SM instead of
#:   8, 112 registers each): session 18, 7-13 % faster at T = 16 and 128 on all three contracts; MXFP8,
#:   which streams at the DRAM rate there, within +-2 %, so it keeps two warpgroups with the stagger
#:   (which only two-warpgroup CTAs apply).
#: - ``swap32`` / ``swap64`` run a tile's narrowest WGMMA that holds its real tokens (``swap_narrow``, drop v49,
#:   session 36, H200, interleaved A/B, outputs bitwise equal): NVFP4 0.89-0.97x of the full tile's time at
#:   T = 192-512 on qwen3 and deepseek-v3 T = 512 / 1024 0.975 / 0.949x; MXFP8 0.97-1.005x (deepseek-v3 T = 1024
#:   0.954x). Not ``swap128`` (H100, T = 1024-16384: 0.99-1.04x, slower at every T >= 4096): its tiles are
#:   mostly full, and the per-tile branch costs more than the columns it saves. Measured at world size 1;
#:   the EP kernels take the same bucket knobs (their GEMMs are the same code), not measured there.
#: - NVFP4's ``swap128`` writes FC2 through shared memory and TMA stores (``swap_tma_store``, drop v50; session 38,
#:   interleaved A/B, outputs bitwise equal to the register stores): H200 qwen3-30b-a3b / qwen3-235b-a22b
#:   T = 4096 and 16384 0.961-0.967x of the register stores' time (one sample); H100, two samples, 0.96-0.995x but
#:   qwen3-235b-a22b T = 4096 1.009 / 1.042x, deepseek-v3 0.996 / 0.974x. Not MXFP8 (H200 0.984-1.022x, H100
#:   0.977-1.017x).
#: - ``decode`` / ``prefill``: 64 / 128-row M tiles (shared-memory dequantization), for the shapes the
#:   swap-AB GEMMs cannot tile (sizes not multiples of 128, or gate/up not interleaved per 256).
#: - Early weight loads (drop v34, session 23, interleaved A/B in CUDA graphs, outputs bitwise equal):
#:   every swap-AB bucket's FC2 issues its first weight loads before it waits for FC1
#:   (``fc2_early_weights``: 0-7 % faster at T = 1 to 128 on the three contracts, both formats, within
#:   +-1 % at 4096); ``split16`` and ``sparse16`` also FC1 before it waits for the gather
#:   (``fc1_early_weights``: up to 4 % more at T = 1-2, e.g. MXFP8 qwen3-30b-a3b T = 1 0.955 against
#:   0.991 with FC2's alone; at ``swap16`` it cost 1-2 %, so not there). Drop v35 (session 23): every
#:   bucket's activation gather loads and quantizes its first items before it waits for the routing
#:   (``gather_early_rows``: 0-4 % faster at T = 1 to 128, one row of 36 at 1.001).
#: - ``gemv8`` (drop v36, session 24): FC1 and FC2 as the expert GEMV (``gemv``: every warp streams its
#:   weight rows through a 2-deep ``cp.async`` ring, ``mma.sync``, 8-token M blocks, K over 4 warps per
#:   CTA) where it measured faster than the swap-AB buckets (interleaved A/B in CUDA graphs, TUNING.md
#:   "Session 24"): T = 1 (1/16 pair per expert) on H <= 2048, qwen3-30b-a3b: NVFP4 0.88x, MXFP8 0.86x
#:   of ``split16``'s time. Not elsewhere: on qwen3-235b-a22b it was 2-10 % slower than ``sparse16`` /
#:   ``swap16`` at T = 1-8 but for T = 4 (equal), on qwen3-30b-a3b T = 2-8 within -4 / +2 % of the swap-AB
#:   buckets, on deepseek-v3 10-21 % slower at every T (run 5). Since drop v46 (session 32, H100, interleaved
#:   A/B in CUDA graphs, outputs bitwise equal to the routed GEMV chain) with the pair chain (``pair_blocks`` +
#:   ``pair_combine``: FC1 prepares its token's row, FC2 combines; two launches instead of five): qwen3-30b-a3b
#:   T = 1 MXFP8 0.835x, NVFP4 0.935x of the routed GEMV's time; at T = 2 MXFP8 0.925x of ``split16``'s (so
#:   MXFP8 up to 1/8 pair per expert), NVFP4 1.000x; at T = 4 0.997x / 1.154x (not moved). Not on
#:   qwen3-235b-a22b / deepseek-v3 T = 1 (NVFP4 1.046x / 1.255x of ``sparse16``). Session 33 (H200): the pair
#:   chain 0.851x (MXFP8) / 0.935x (NVFP4) of the routed GEMV's time at T = 1; NVFP4 at qwen3-30b-a3b T = 2
#:   0.953-0.956x of ``sparse16``'s time (three runs), so both formats up to 1/8 pair per expert. Drop v52's
#:   bulk L2 prefetches (``gemv_l2_prefetch``) are off: in session 39's A/B (H100, interleaved, CUDA graphs,
#:   outputs bitwise equal) they made the pair chain 8-14 % *slower* at T = 1-2 (the candidate's time over the
#:   default's: MXFP8 1.084-1.092, NVFP4 1.075-1.141), and the pair chain with them was slower than the default
#:   buckets at T = 4-16 (1.13-1.66x MXFP8, 1.21-1.79x NVFP4 their time). Session 39 read those ratios the wrong
#:   way round and put both into ``gemv8`` (up to one pair per expert); session 40's decode bench in graphs of 8
#:   layers showed the loss (H100, T = 16: MXFP8 263 us, NVFP4 170 us a layer) and restored this bucket.
#: - ``gemv8k8``: ``gemv8`` with FC1 over 8 GEMV warps per CTA (``gemv_fc1_k_warps``, drop v53; FC2 keeps 4) at
#:   1/16 pair per expert (qwen3-30b-a3b T = 1). At T = 1 FC1's GEMV is a chain of memory round trips (session 40's
#:   kernel timeline: 13.5 us for NVFP4's 14 MB and MXFP8's 26 MB alike); twice the warps halve each warp's K units.
#:   Session 40, H100, the decode bench in CUDA graphs of 8 layers, three runs: NVFP4 T = 1 20.45-20.61 -> 18.57-18.63
#:   us a layer (9-10 % faster), MXFP8 24.66-24.90 -> 23.76-23.84 us (3-5 %); at T = 2 1-2 % slower in both formats,
#:   so not in ``gemv8``. (A one-layer-graph ``drop_ab`` gave NVFP4 2.7 % faster, MXFP8 5.6 % slower at T = 1; the
#:   bench's graphs of 8 layers on distinct weights are how an engine decodes.) FC1 over 16 warps: 13-34 % slower.
#:   Session 41 (H100, the same bench, four runs in two calls): MXFP8's FC2 over 8 warps too (``gemv_k_warps`` 8: each
#:   warp 1-2 of FC2's 12 K units instead of 3, so one DRAM round trip after FC1 instead of two) 22.2-22.9 -> 20.0-20.4
#:   us a layer (8-13 % faster); NVFP4's (6 K units) 13-16 % slower (its bigger FC2 CTAs start later beside FC1's), so
#:   MXFP8 only. At T = 2 (``gemv8``) MXFP8's FC2 over 8 warps was 4-5 % slower.
#: - ``gemv_early_ring`` (drop v54: FC2's GEMV copies its whole ring's weights before its wait) is on in MXFP8's
#:   ``gemv8``: the same bench, T = 2, two runs each: H200 (session 41) 4-5 % faster, H100 (session 42) 2 %; at
#:   T = 1 and for NVFP4 unchanged or up to 3 % slower (session 41), so not there. Its kernel passed the GPU tests
#:   in session 42.
#: - ``gemv8r`` (session 42, MXFP8 only): the routed GEMV (routing, gather and combine kernels around it, one
#:   8-token M block per busy expert instead of a block per pair) with FC1 over 8 warps and FC2's early ring, from
#:   1/8 to 1 pair per expert where H <= 2048 (qwen3-30b-a3b T = 3-16). The same bench on an H100, four runs
#:   in two calls, its time over the default buckets' (``split16`` / ``sparse16`` / ``swap16``): T = 3
#:   0.93-0.94, 4 0.96-0.99, 5 0.96-0.98, 6 1.00-1.02, 8 0.96-0.98, 12 0.92-0.97, 16 0.98-1.00. With FC1's
#:   early weights too: within 1.5 % of it either way. NVFP4's routed GEMV: 1.20-1.35x the default's time at
#:   T = 4 and 8 (the swap-AB GEMMs' four converting warpgroups win there), so not NVFP4.
#: - NVFP4's ``split16`` past 1/8 pair per expert (``many_waves``, session 42) where H >= 4096: the bench in graphs
#:   of 8 layers (deepseek-v3: 4) on an H100, its time over ``swap16``'s, session 41 / session 42: qwen3-235b-a22b
#:   T = 3 0.861 / 0.861, T = 4 0.916 / 0.916, T = 6 0.991 / 0.988, T = 8 0.909 / 0.915; deepseek-v3 T = 8 0.994 /
#:   1.001, T = 16 0.957 / 0.964. Not at H = 2048 (qwen3-30b-a3b T = 3-12: 0.95-1.11, a loss at T = 3-5 and 12) nor
#:   at 1/8 pair where the one-wave rule says no (qwen3-235b-a22b T = 2: 1.12-1.20; deepseek-v3 T = 4 would
#:   gain 4 %, not taken).
#: - NVFP4's ``gemv8`` (session 43) runs FC2 over 2 GEMV warps and both GEMVs' rings 3 deep (FC1 keeps 4 warps):
#:   at qwen3-30b-a3b T = 2 FC2's 512 CTAs of 4 warps (66 KiB of shared memory each, three an SM) were 1.3 waves
#:   (Nsight Compute, session 43); of 2 warps (46 KiB with 3 stages) they fit one, each warp's 3 K units in flight at
#:   once. The bench in graphs of 8 layers on an H100, its time over the 4-warp, 2-stage knobs': 0.851, 0.837,
#:   0.844, 0.835 (four runs in two calls); FC2 over 2 warps with 2 stages 0.904-0.917. Not at T = 1 (``gemv8k8``:
#:   1.09-1.15, its 256 FC2 CTAs fit one wave already) nor for MXFP8 at T = 2 (12 K units: 1.03; 3 stages with 4
#:   warps 1.10).
#: - NVFP4's ``gemv8k8`` combines each token's pairs in a cluster of its top_k FC2 CTAs (``gemv_pair_cluster``, drop
#:   v56; where top_k <= 8, ``knobs_for``): no y rows, counter, fence or atomic after FC2's epilogue. Session 45, H100,
#:   the bench in graphs of 8 layers, qwen3-30b-a3b T = 1, six runs in three calls: 0.916-0.922 of the counters'
#:   time (18.6 -> 17.1 us a layer) and once 0.958. Not for MXFP8 at T = 1 (its 8-warp FC2 CTAs of 112 KiB: 1.11-1.12;
#:   over 4 warps with the cluster 1.007-1.009 of the 8 warps without) nor at T = 2 (``gemv8``: MXFP8 1.095, NVFP4
#:   1.075-1.079).
#: - MXFP8's ``gemv8k8`` combines in clusters too since session 46, with FC2 over 4 warps (56 KiB CTAs) copying its
#:   whole 2-deep ring before its wait (``gemv_early_ring``): the same bench on an H100, four rounds in one call,
#:   0.981-0.983 of the 8-warp FC2's time (21.67-21.80 -> 21.26-21.44 us a layer); the same without the early ring
#:   0.992-1.002, the early ring without the cluster 1.077-1.086. FC2 over 4 warps 3 deep (every unit before the
#:   wait; a candidate drop's ``gemv_fc1_stages``, not recorded) matched 8 warps alone but lost 17-20 % with the
#:   cluster (80 KiB CTAs). Where top_k > 8 (no cluster) MXFP8 keeps FC2 over 8 warps (``cluster_knobs``).
#: - The pair chain's FC1 (``gemv8k8``, ``gemv8``) requests its token's BF16 row with one bulk copy right after its
#:   wait (``gemv_row_tma``, drop v57; ``bf16_input_knobs``: not where the layer takes codes and scales), so the
#:   row's bytes do not queue behind the SM's first weight copies (session 44's stamps). Session 47, H100, the bench
#:   in graphs of 8 layers, qwen3-30b-a3b, six rounds in two calls, its time over the buckets' without it: NVFP4
#:   T = 1 0.953-0.977, T = 2 0.939-0.965 (every round faster); MXFP8 T = 1 0.948-0.955 in three rounds and
#:   0.998-1.006 in three, T = 2 0.981-1.000.
#: - NVFP4's ``gemv8k2`` (session 51): the pair chain with FC1 and FC2 over 2 GEMV warps each and 2-deep rings
#:   (``gemv_shared_bytes``: 28 KiB / 24 KiB CTAs, seven / nine an SM), past ``gemv8`` up to 3/16 pair per expert
#:   where H <= 2048 (qwen3-30b-a3b T = 3). There ``gemv8``'s 576 FC1 CTAs of 72 KiB (three an SM) and 768 FC2 CTAs
#:   of 46 KiB (four an SM) no longer fit one wave, as T = 2's 384 and 512 did (arithmetic from the shared memory,
#:   not counted). The bench in graphs of 8 layers on an H100, its time over the default's (``swap16``, 40.8-41.2 us
#:   a layer) at T = 3: 0.944, 0.941, 0.936, 0.936 (four rounds in two calls); the same with FC2's early ring
#:   0.926-0.968; ``gemv8``'s knobs 0.974-0.990, ``gemv8k8``'s 0.984-1.013. Not from T = 4 (1.09-1.10 at T = 4,
#:   0.99-1.01 at T = 5, 1.11-1.12 at T = 6, 0.99-1.01 at T = 8) nor for MXFP8 (the same knobs at T = 3 1.007-1.016
#:   of ``gemv8r``'s). Not yet measured on the H200.
#: - NVFP4's ``gemv8r2`` (session 51): the routed GEMV (as ``gemv8r``) with FC1 over 4 GEMV warps and FC2 over 2,
#:   FC2's early ring, from 3/8 (exclusive) to 9/16 pair per expert where H <= 2048 (qwen3-30b-a3b T = 7-9). There
#:   ``swap16``'s FC1 (three 512-row CTA tiles per busy expert) passes one wave of 132: 137 / 152 / 166 tiles at
#:   T = 7 / 8 / 9 over the expected busy experts (arithmetic, not counted), and its time jumps from 58 us at T = 6
#:   to 75.5 at T = 7. The bench in graphs of 8 layers on an H100, its time over ``swap16``'s, two rounds in each of
#:   two calls (T = 6, 8, 12) or in one: T = 6 1.022 / 1.029 / 1.041 / 1.036, T = 7 0.825 / 0.826, T = 8 0.894 /
#:   0.885 / 0.884 / 0.883, T = 9 0.970 / 0.967, T = 10 0.990 / 0.999, T = 11 1.018 / 1.038, T = 12 0.993 / 0.995 /
#:   1.008 / 0.998, T = 16 1.136 / 1.133; with FC1 over 2 warps too 0.86-0.91 at T = 7-8 and 1.08-1.10 at T = 6.
#:   Not yet measured on the H200.
_EARLY = {"fc2_early_weights": True, "gather_early_rows": True}
_GATHER = {"swap_ab": True, "gather_in_fc1": True, **_EARLY}
_NARROW = {"swap_narrow": True}
_SPARSE16 = {"tile_m": 16, "swap_ab": True, "swap_atoms": 2, **_EARLY, "fc1_early_weights": True}
_GEMV8 = {
    "tile_m": 8,
    "swap_ab": True,
    "gemv": True,
    "gemv_k_warps": 4,
    "gemv_stages": 2,
    "fc2_early_weights": True,
    "pair_blocks": True,
    "pair_combine": True,
}
#: the pair chain's FC1 bulk-copies its token's BF16 row (drop v57; not for codes and scales)
_ROW_TMA = {"gemv_row_tma": True}
#: the routed GEMV (routing, gather and combine kernels around it: no pair chain), FC1 over 8 warps, FC2's early ring
_GEMV8R = {
    "tile_m": 8,
    "swap_ab": True,
    "gemv": True,
    "gemv_k_warps": 4,
    "gemv_fc1_k_warps": 8,
    "gemv_stages": 2,
    "fc2_early_weights": True,
    "gather_early_rows": True,
    "gemv_early_ring": True,
}
BUCKETS = (
    TokenBucket(
        "gemv8k8",
        {**_GEMV8, "gemv_fc1_k_warps": 8},
        max_pairs_per_expert=0.0625,
        fallback="decode",
        format_knobs={"mxfp8": {"gemv_k_warps": 8}},
        cluster_knobs={
            "mxfp8": {"gemv_k_warps": 4, "gemv_early_ring": True, "gemv_pair_cluster": True},
            "nvfp4": {"gemv_pair_cluster": True},
        },
        bf16_input_knobs=_ROW_TMA,
        formats=("mxfp8", "nvfp4"),
        max_hidden=2048,
    ),
    TokenBucket(
        "gemv8",
        _GEMV8,
        max_pairs_per_expert=0.125,
        fallback="decode",
        format_knobs={
            "mxfp8": {"gemv_early_ring": True},
            "nvfp4": {"gemv_k_warps": 2, "gemv_fc1_k_warps": 4, "gemv_stages": 3},
        },
        bf16_input_knobs=_ROW_TMA,
        formats=("mxfp8", "nvfp4"),
        max_hidden=2048,
    ),
    TokenBucket(
        "gemv8k2",
        {**_GEMV8, "gemv_k_warps": 2, "gemv_fc1_k_warps": 2},
        max_pairs_per_expert=0.1875,
        fallback="decode",
        bf16_input_knobs=_ROW_TMA,
        formats=("nvfp4",),
        max_hidden=2048,
    ),
    TokenBucket(
        "gemv8r",
        _GEMV8R,
        max_pairs_per_expert=1.0,
        fallback="decode",
        formats=("mxfp8",),
        max_hidden=2048,
    ),
    TokenBucket(
        "gemv8r2",
        {**_GEMV8R, "gemv_k_warps": 2, "gemv_fc1_k_warps": 4},
        max_pairs_per_expert=0.5625,
        min_pairs_per_expert=0.375,
        fallback="decode",
        formats=("nvfp4",),
        max_hidden=2048,
    ),
    TokenBucket(
        "split16",
        {**_SPARSE16, "swap_split_k": 2},
        max_pairs_per_expert=0.5,
        fallback="decode",
        one_wave=("mxfp8", "nvfp4"),
        fc1_parts=2,
        many_waves={"nvfp4": (0.125, 4096)},
    ),
    TokenBucket(
        "sparse16",
        _SPARSE16,
        max_pairs_per_expert=0.5,
        fallback="decode",
        format_max_pairs={"nvfp4": 0.125},
        one_wave=("nvfp4",),
    ),
    TokenBucket(
        "swap16",
        {"tile_m": 16, "swap_ab": True, "swap_stagger": 4, **_EARLY},
        max_pairs_per_expert=8,
        fallback="decode",
        format_knobs={"nvfp4": {"swap_wg": 4, "swap_atoms": 2}},
    ),
    TokenBucket("swap32", {"tile_m": 32, **_GATHER, **_NARROW}, max_pairs_per_expert=16, fallback="decode"),
    TokenBucket(
        "swap64",
        {"tile_m": 64, **_GATHER, **_NARROW},
        32,
        "decode",
        format_knobs={"mxfp8": {"gather_in_fc1": False}},
    ),
    TokenBucket(
        "swap128",
        {"tile_m": 128, **_GATHER},
        fallback="prefill",
        format_knobs={"nvfp4": {"swap_tma_store": True}},
    ),
)
#: bucket knobs of the world-size-1 kernel only (the EP kernels' dispatch moves prepared rows already)
WORLD1_KNOBS = (
    "gather_in_fc1",
    "swap_split_k",
    "fc2_early_weights",
    "fc1_early_weights",
    "gather_early_rows",
    "gemv",
    "gemv_k_warps",
    "gemv_stages",
    "gemv_l2_prefetch",
    "gemv_fc1_k_warps",
    "gemv_early_ring",
    "gemv_pair_cluster",
    "gemv_row_tma",
    "pair_blocks",
    "pair_combine",
    "swap_tma_store",
    "gemv_fused",
)
#: the knobs of the fallback buckets (over the defaults)
FALLBACKS = {"decode": {"tile_m": 64}, "prefill": {}}


def token_bucket(
    t: int,
    top_k: int,
    num_experts: int,
    fmt: str | None = None,
    frontends: dict[str, Any] | None = None,
    hidden: int | None = None,
) -> str:
    """The bucket serving ``t`` tokens routed ``top_k`` ways over ``num_experts`` (host-side shapes), for
    weight format ``fmt`` (None: the bounds every format shares); ``frontends`` (``bucket_frontends``)
    for the rules that depend on the kernels' tiles (``TokenBucket.one_wave``); ``hidden`` (H) for the
    buckets bounded by it (``TokenBucket.max_hidden``: without it they serve nothing)."""
    fes = frontends or {}
    return next(b.name for b in BUCKETS if b.serves(t, top_k, num_experts, fmt, fes.get(b.name), hidden))


#: the drop frontend of each weight format (world size 1, and expert parallel)
FRONTENDS = {"mxfp8": "Mxfp8Frontend", "nvfp4": "Nvfp4Frontend"}
EP_FRONTENDS = {"mxfp8": "Mxfp8EpFrontend", "nvfp4": "Nvfp4EpFrontend"}


def bucket_frontends(
    config: Sm90BlockScaledConfig, num_local_experts: int, ep: EpPlacement | None = None
) -> dict[str, Any]:
    """One frontend per bucket of ``BUCKETS`` (with ``ep``: per bucket a forward of this world size can
    reach, ``ep_buckets``); explicit knobs serve every T with one frontend. Where the swap-AB GEMMs
    cannot serve the geometry (``QuantFrontend.check``: sizes not multiples of 128, gate/up not
    interleaved per 256), the bucket's fallback frontend (64 or 128-row M tiles) does."""
    buckets = BUCKETS if ep is None else ep_buckets(ep.world_size)
    # buckets that never serve this layer (its format or H) get no frontend (no kernel to build or load)
    fmt, hidden = config.weight_format, config.hidden_size
    buckets = tuple(b for b in buckets if b.applies_to(fmt, hidden))
    tiles = {k: v for k, v in (config.knobs or {}).items() if k not in EP_KNOBS}
    if tiles:
        one = make_frontend(config, num_local_experts, None, ep)
        return {b.name: one for b in buckets}
    fallbacks: dict[str, Any] = {}
    fronts: dict[str, Any] = {}
    for b in buckets:
        try:
            knobs = b.knobs_for(config.weight_format, config.top_k, config.prequantized_input)
            fronts[b.name] = make_frontend(config, num_local_experts, knobs, ep)
        except MoEEpConfigError:
            if b.fallback not in fallbacks:
                fallbacks[b.fallback] = make_frontend(config, num_local_experts, FALLBACKS[b.fallback] or None, ep)
            fronts[b.name] = fallbacks[b.fallback]
    return fronts


def check_launch_limits(
    config: Sm90BlockScaledConfig, frontends: dict[str, Any], num_local_experts: int, max_tokens: int
) -> None:
    """Raise ``MoEEpConfigError`` at construction where a bucket's knobs take fewer tokens per launch
    (``launch_token_limit``: ``pair_blocks``) than the bucket reaches in a layer of ``max_tokens`` tokens
    (explicit knobs serve every T)."""
    explicit = any(k not in EP_KNOBS for k in (config.knobs or {}))
    for b in BUCKETS:
        fe = frontends.get(b.name)
        limit = None if fe is None else fe.launch_token_limit
        if limit is None:
            continue
        bound = None if explicit else b.format_max_pairs.get(config.weight_format, b.max_pairs_per_expert)
        reach = max_tokens if bound is None else min(max_tokens, math.floor(bound * num_local_experts / config.top_k))
        if reach > limit[0]:
            most, knob, rule = limit
            where = "these knobs serve every T" if explicit else f"token bucket {b.name!r} reaches T={reach}"
            raise MoEEpConfigError(
                f"{config.kernel_name}: {knob} serves at most {most} tokens per launch ({rule}, top_k={config.top_k}), "
                f"but {where} (max_tokens_per_rank={max_tokens}): give it other knobs or a smaller token capacity"
            )


@dataclass(frozen=True)
class EpPlacement:
    """Where an expert-parallel layer's kernel runs: ``world_size`` ranks, ``ranks_per_gpu`` of them
    on each GPU (R with loopback ranks, else 1), the layer's ``dispatch``."""

    world_size: int
    ranks_per_gpu: int = 1
    dispatch: str = "pull"


def ep_buckets(world_size: int) -> tuple[TokenBucket, ...]:
    """The buckets an EP forward of ``world_size`` ranks can reach (``ep_token_bucket``: the bucket of the
    global ``world_size * T``): every one bounded by pairs per expert (session 15 replaced ``swap1``,
    the one bucket of T = 1, so no token count below the world size is left out), but not those that
    only add a split K (``fc1_parts``): the EP kernels have no split-K workspace (``swap_split_k`` is a
    world-size-1 knob), so there they would repeat their base bucket."""
    return tuple(b for b in BUCKETS if b.fc1_parts == 1 and not b.knobs.get("gemv"))


def ep_token_bucket(
    rows: int,
    world_size: int,
    top_k: int,
    num_experts: int,
    fmt: str | None = None,
    frontends: dict[str, Any] | None = None,
) -> str:
    """The bucket of an EP forward with ``rows`` rows on this rank: the world-size-1 rule at the
    global token count ``world_size * rows`` over the GLOBAL experts (the rows per expert the owners'
    GEMMs see; the FC1 wave of ``one_wave`` over this rank's experts and grid). Ranks may sit in
    different buckets; the dispatch is the layer's, so they interoperate."""
    buckets, fes = ep_buckets(world_size), frontends or {}
    return next(b.name for b in buckets if b.serves(world_size * rows, top_k, num_experts, fmt, fes.get(b.name)))


def make_frontend(
    config: Sm90BlockScaledConfig, num_local_experts: int, overrides: dict | None = None, ep: EpPlacement | None = None
) -> Any:
    """The drop frontend of ``config``'s weight format (explicit knobs, or the defaults with ``overrides``);
    with ``ep`` the expert-parallel one (its geometry has the GLOBAL expert count)."""
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    ep_only = sorted(set(config.knobs or {}) & set(EP_KNOBS))
    if ep is None and ep_only:
        raise MoEEpConfigError(f"{config.kernel_name}: knob(s) {', '.join(ep_only)} apply at world_size > 1 only")
    # the config's tile knobs over the bucket's (a config with tile knobs has one frontend: no overrides)
    chosen = {**(overrides or {}), **{k: v for k, v in (config.knobs or {}).items() if k not in EP_KNOBS}}
    if ep is None:
        geometry = make_geometry(config, num_local_experts)
        base = drop.default_quant_knobs(geometry)
        knobs = drop.QuantKnobs(**{**base.__dict__, **chosen}) if chosen else None
        frontend = getattr(drop, FRONTENDS[config.weight_format])(geometry, knobs)
    else:
        bucket = {k: v for k, v in (overrides or {}).items() if k not in WORLD1_KNOBS}
        chosen = {**bucket, **{k: v for k, v in (config.knobs or {}).items() if k not in EP_KNOBS}}
        geometry = make_geometry(config, num_local_experts * ep.world_size)
        base = drop.default_quant_knobs(geometry)
        placement = {"world_size": ep.world_size, "ranks_per_gpu": ep.ranks_per_gpu, "dispatch": ep.dispatch}
        knobs = drop.QuantEpKnobs(**{**base.__dict__, **chosen, **placement})  # the placement's dispatch
        frontend = getattr(drop, EP_FRONTENDS[config.weight_format])(geometry, knobs)
    try:
        frontend.check()
    except (TypeError, ValueError) as exc:
        raise MoEEpConfigError(f"{config.kernel_name}: {exc}") from None
    return frontend


__all__ = [
    "BUCKETS",
    "EP_FRONTENDS",
    "EP_KNOBS",
    "EpPlacement",
    "check_launch_limits",
    "ep_buckets",
    "ep_token_bucket",
    "FALLBACKS",
    "FRONTENDS",
    "Sm90BlockScaledBackend",
    "Sm90BlockScaledConfig",
    "Sm90Nvfp4ConfigFields",
    "TokenBucket",
    "bucket_frontends",
    "make_frontend",
    "token_bucket",
]
