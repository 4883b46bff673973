"""``Sm90MegaMoEBf16EpKernel``: the expert-parallel BF16 MoE forward of one rank as one traced host
function (DRAFT). The protocol and the kernel chain are described in ``ep_kernels``; the buffers
in ``ep_workspace``. ``EpProtocol`` holds what every EP kernel shares (the protocol knobs and the
three protocol phases: route, dispatch, combine); a kernel adds its expert GEMMs between dispatch
and combine (``moe_quant_glu.ep_kernel`` is the block-scaled one).

``rank`` and ``timeout_ns`` are RUNTIME scalars: one compiled library serves every rank of a world
size (``world_size`` is compile-time: it sizes the flag array and the pointer tables). T is symbolic
as in the world-1 kernel. Nothing that changes between forwards is a launch argument: the epoch is in
the device-side ``ep_state`` and the live token count in the ``live_tokens`` device scalar, so a CUDA
graph of one forward replays correctly with any live count up to the rows of its buffers.

Buffer-reuse guards (which wait protects which overwrite), for epoch e on rank r:

- owner buffers read by peers in epoch e-1: ``a_buf`` (y rows, read by every source's combine)
  and ``row_base`` (read by every source's combine). Kernel 5 waits ``finished[s] >= e-1``
  for every s before it writes ``row_base`` and before the gather (kernel 6) writes ``a_buf``.
- source buffers read by owners in epoch e-1: ``x_sym``, ``send_list``, ``expert_cnt``,
  ``expert_start`` (read by every owner's scan and gather). They are rewritten by kernels 1-3 of
  epoch e, which this stream orders after kernel 9 of epoch e-1, whose wait ``done[d] >= e-1``
  for every d proves every owner finished its gather (done is signalled after FC2).
- flags are single-writer monotonic words: never reset.

The reuse wait is skipped (target 0) on the first forward and on the first one after the host
rewrote ``ep_state`` in a recovery (every rank was idle then).

Loopback co-residency rule (``ranks_per_gpu = R`` logical ranks on one GPU): the routing and GEMM
grids have ``G = num_sms // ranks_per_gpu`` CTAs, so the R ranks' concurrent kernels fit on the GPU
together. Every spin-wait is in a single-CTA kernel (kernels 5 and 9), so at most R CTAs ever spin
and the kernels they wait for always find free SMs. The gather and combine grids are
``AUX_CTAS_PER_SM * G``: they never wait, so CTAs queued behind them only start later (more warps
in flight hide the latency of their peer loads over NVLink). The EP kernels never use PDL (a
PDL-launched grid would sit resident while its predecessor spins); ``use_pdl`` applies only to
FC1 and FC2, which never wait on another rank.
"""

import cutlass
import cutlass.cute as cute

from ..common import constants
from . import ep_kernels as K
from .grouped_gemm import EPI_PLAIN, GroupedGemmSm90

#: gather/combine CTAs per GEMM CTA (the copies over NVLink need many loads in flight)
AUX_CTAS_PER_SM = 4


class EpProtocol:
    """The EP protocol of one rank: knobs and the phases every EP kernel runs in this order,

    1. ``route`` (kernels 0-3): epoch, local routing, the send list (source role);
    2. ``dispatch`` (kernels 4-6): ready signal, the owner's row plan, the rows into ``a_buf``
       (pull: owners read ``x_sym``; push: sources write their rows of ``rows_src``);
    3. the kernel's expert GEMMs ``a_buf -> h_buf -> a_buf`` (no cross-rank access);
    4. ``combine`` (kernels 9-11): done signal and wait, the weighted top-k sum from the owners' y,
       finished signal.

    Plain methods called from the subclass's traced ``__call__`` (straight-line launches only).

    :param world_size: number of EP ranks R (experts split evenly: E_local = E / R).
    :param ranks_per_gpu: logical ranks sharing one GPU (1 for NVSHMEM, R for loopback); every
        grid has ``num_sms // ranks_per_gpu`` CTAs.
    :param cluster_m: 1, or 2 for GEMM clusters of two CTAs along M (the owner scan closes an odd
        block count with a phantom block). The grid must be even.
    :param dispatch: ``"pull"`` or ``"push"`` (see ``ep_kernels``). Every rank of a forward must use
        the same dispatch: a pull owner never waits for pushes and a push source never fills ``x_sym``.
    :param combine_dtype: the combine wire, ``"bf16"`` or ``"mxfp8"`` (``ep_kernels.WIRES``; every rank
        of a forward must use the same one).
    """

    def __init__(
        self,
        activation: str,
        tile_m: int,
        num_sms: int,
        world_size: int,
        ranks_per_gpu: int,
        cluster_m: int,
        dispatch: str,
        use_pdl: bool,
        combine_dtype: str = K.WIRE_BF16,
    ) -> None:
        if activation not in constants.ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}")
        if not 1 <= world_size <= 32:
            raise ValueError(f"world_size must be in [1, 32], got {world_size}")
        if ranks_per_gpu < 1 or num_sms // ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu={ranks_per_gpu} leaves no SM per rank")
        self.activation = activation
        self.tile_m = tile_m
        self.num_sms = num_sms
        self.world_size = world_size
        self.ranks_per_gpu = ranks_per_gpu
        self.grid = num_sms // ranks_per_gpu
        if cluster_m not in (1, 2) or self.grid % cluster_m:
            raise ValueError(f"cluster_m must be 1 or 2 and divide the grid ({self.grid} CTAs), got {cluster_m}")
        self.cluster_m = cluster_m
        if dispatch not in ("pull", "push"):
            raise ValueError(f"dispatch must be 'pull' or 'push', got {dispatch!r}")
        self.push = dispatch == "push"
        if combine_dtype not in K.WIRES:
            raise ValueError(f"combine_dtype must be one of {', '.join(K.WIRES)}, got {combine_dtype!r}")
        self.combine_dtype = combine_dtype
        self.aux_grid = self.grid * AUX_CTAS_PER_SM
        self.aux_threads = 256
        self.aux_vpt = 1  # the EP gather/combine move one 16-byte vector per thread item (check_problem reads it)
        self.use_pdl = use_pdl

    @staticmethod
    def _expert_major_view(w: cute.Tensor) -> cute.Tensor:
        return cute.make_tensor(w.iterator, cute.select(w.layout, mode=[1, 2, 0]))

    def route(self, x, topk_ids, live_tokens, x_sym, cta_cnt, pair_pos, send_list, expert_cnt, expert_start,
              ep_state, abort, num_experts: int, copy_x: bool, stream) -> None:  # fmt: skip
        """Kernels 0-3. ``copy_x``: kernel 1 copies the live rows of ``x`` into ``x_sym`` (BF16 pull)."""
        g = self.grid
        aux = [self.aux_threads, 1, 1]
        # 0: epoch += 1, abort word cleared
        K.ep_begin_kernel(ep_state, abort).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)
        # 1-3: local routing, send list sorted by global expert (source role)
        K.ep_route_count_kernel(x, topk_ids, live_tokens, x_sym, cta_cnt, abort, num_experts, copy_x).launch(
            grid=[g, 1, 1], block=aux, stream=stream
        )
        K.ep_route_scan_kernel(cta_cnt, expert_cnt, expert_start, abort, num_experts, g).launch(
            grid=[1, 1, 1], block=[constants.ROUTING_THREADS, 1, 1], stream=stream
        )
        K.ep_route_place_kernel(
            topk_ids, live_tokens, cta_cnt, expert_start, send_list, pair_pos, abort, num_experts
        ).launch(grid=[g, 1, 1], block=[32, 1, 1], stream=stream)

    def dispatch(self, rows_src, live_tokens, flags, x_sym, send_list, expert_start, row_base, a_buf,
                 flags_tab, x_tab, send_tab, cnt_tab, start_tab, row_base_tab, y_tab, src_meta, m_block_expert,
                 meta, ep_state, abort, rank, timeout_ns, local_experts: int, top_k: int, stream) -> None:  # fmt: skip
        """Kernels 4-6. ``rows_src`` ([T, H] bf16): the rows a push source writes (``x``, or the
        prepared rows in ``x_sym``); pull owners read ``x_sym``."""
        world = self.world_size
        one = [1, 1, 1]
        sig = [K.SIGNAL_THREADS, 1, 1]
        aux = [self.aux_threads, 1, 1]
        # 4: ready[rank] = epoch everywhere
        K.ep_signal_kernel(flags_tab, rank, ep_state, abort, K.FLAG_READY, world).launch(
            grid=one, block=sig, stream=stream
        )
        # 5: owner waits (ready of this epoch, finished of the previous one), plans rows
        K.ep_owner_scan_kernel(
            flags, cnt_tab, start_tab, row_base, m_block_expert, meta, src_meta,
            rank, ep_state, timeout_ns, abort, world, local_experts, self.tile_m, self.cluster_m,
        ).launch(grid=one, block=[constants.ROUTING_THREADS, 1, 1], stream=stream)  # fmt: skip
        if self.push:
            # 6a-e: every owner planned its rows -> push this rank's rows -> every source pushed
            K.ep_signal_kernel(flags_tab, rank, ep_state, abort, K.FLAG_PLANNED, world).launch(
                grid=one, block=sig, stream=stream
            )
            K.ep_wait_all_kernel(
                flags, meta, ep_state, timeout_ns, abort, K.FLAG_PLANNED, K.STAGE_SOURCE_PLANNED, world, False
            ).launch(grid=one, block=sig, stream=stream)
            K.ep_push_kernel(
                rows_src, live_tokens, send_list, expert_start, row_base_tab, y_tab, rank, abort, local_experts, top_k
            ).launch(grid=[self.aux_grid, 1, 1], block=aux, stream=stream)
            K.ep_signal_kernel(flags_tab, rank, ep_state, abort, K.FLAG_PUSHED, world).launch(
                grid=one, block=sig, stream=stream
            )
            K.ep_wait_all_kernel(
                flags, meta, ep_state, timeout_ns, abort, K.FLAG_PUSHED, K.STAGE_OWNER_PUSHED, world, True
            ).launch(grid=one, block=sig, stream=stream)
        else:
            # 6: pull x rows from the sources
            K.ep_gather_kernel(
                x_sym, x_tab, send_tab, start_tab, row_base, src_meta, meta, a_buf, rank, abort,
                world, local_experts, top_k,
            ).launch(grid=[self.aux_grid, 1, 1], block=aux, stream=stream)  # fmt: skip

    def combine(self, topk_ids, topk_weights, live_tokens, pair_pos, flags, flags_tab, row_base_tab, y_tab, out,
                a_buf, meta, ep_state, abort, rank, timeout_ns, local_experts: int, stream) -> None:  # fmt: skip
        """Kernels 8b (mxfp8 wire) and 9-11."""
        world = self.world_size
        sig = [K.SIGNAL_THREADS, 1, 1]
        if self.combine_dtype == K.WIRE_MXFP8:
            # 8b: this rank's y rows in their wire form, before it tells the sources they are ready
            a_words = cute.recast_tensor(a_buf, cutlass.Uint32)
            a_bytes = cute.recast_tensor(a_buf, cutlass.Uint8)
            K.ep_wire_quant_kernel(a_buf, a_words, a_bytes, meta, abort).launch(
                grid=[self.aux_grid, 1, 1], block=[self.aux_threads, 1, 1], stream=stream
            )
        # 9: done[rank] = epoch everywhere, then wait for every owner
        K.ep_done_and_wait_kernel(flags, flags_tab, rank, ep_state, timeout_ns, abort, world).launch(
            grid=[1, 1, 1], block=sig, stream=stream
        )
        # 10: combine from the owners' y
        K.ep_combine_kernel(
            topk_ids, topk_weights, live_tokens, pair_pos, row_base_tab, y_tab, out, rank, abort,
            world, local_experts, topk_ids.shape[1], self.combine_dtype,
        ).launch(grid=[self.aux_grid, 1, 1], block=[self.aux_threads, 1, 1], stream=stream)  # fmt: skip
        # 11: finished[rank] = epoch everywhere (this rank no longer reads any peer buffer)
        K.ep_signal_kernel(flags_tab, rank, ep_state, abort, K.FLAG_FINISHED, world).launch(
            grid=[1, 1, 1], block=sig, stream=stream
        )


class Sm90MegaMoEBf16EpKernel(EpProtocol):
    """Compile-time knobs of the EP BF16 MoE kernel.

    Same knobs as ``Sm90MegaMoEBf16Kernel`` (activation, limit, tile_m, fc1/fc2_tile_n, num_sms,
    fc1/fc2_stages, use_pdl (GEMMs only), epi_direct, stage_mask) plus those of ``EpProtocol``
    (world_size, ranks_per_gpu, cluster_m: GEMM clusters of two CTAs along M that share each weight
    tile when both blocks belong to one expert; dispatch; combine_dtype).

    :param stage_mask: accepted for signature parity; only 0b11111 is supported here.

    ``epi_direct`` defaults to False here as in the world-1 kernel (TMA-store epilogues, measured
    faster on H200).
    """

    def __init__(
        self,
        activation: str = constants.ACT_SWIGLU,
        limit: float | None = None,
        tile_m: int = 128,
        fc1_tile_n: int = 128,
        fc2_tile_n: int = 128,
        num_sms: int = constants.DEFAULT_NUM_SMS,
        fc1_stages: int | None = None,
        fc2_stages: int | None = None,
        use_pdl: bool = True,
        epi_direct: bool = False,
        stage_mask: int = 0b11111,
        world_size: int = 1,
        ranks_per_gpu: int = 1,
        cluster_m: int = 1,
        dispatch: str = "pull",
        combine_dtype: str = "bf16",
    ) -> None:
        super().__init__(
            activation, tile_m, num_sms, world_size, ranks_per_gpu, cluster_m, dispatch, use_pdl, combine_dtype
        )
        if stage_mask != 0b11111:
            raise ValueError("the EP kernel runs every stage (stage_mask must be 0b11111)")
        self.limit = limit
        self.stage_mask = stage_mask
        self.fc1 = GroupedGemmSm90(tile_m, fc1_tile_n, activation, limit, self.grid, fc1_stages, epi_direct, cluster_m)
        self.fc2 = GroupedGemmSm90(tile_m, fc2_tile_n, EPI_PLAIN, None, self.grid, fc2_stages, epi_direct, cluster_m)

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,  # [T, H] bf16
        topk_ids: cute.Tensor,  # [T, K] int32, GLOBAL expert ids
        topk_weights: cute.Tensor,  # [T, K] fp32
        w13: cute.Tensor,  # [E_loc, N1, H] bf16 (this rank's experts, prepared as world 1)
        w2: cute.Tensor,  # [E_loc, H, I] bf16
        out: cute.Tensor,  # [T, H] bf16 (rows >= the live count are left untouched)
        live_tokens: cute.Tensor,  # [1] int32: rows of x/topk_*/out that are live (clamped to T)
        # symmetric buffers: this rank's views
        flags: cute.Tensor,  # [NUM_FLAG_KINDS, R] int32 (zeroed once at allocation)
        x_sym: cute.Tensor,  # [T_cap, H] bf16
        send_list: cute.Tensor,  # [T_cap*K, 2] int32
        expert_cnt: cute.Tensor,  # [E] int32
        expert_start: cute.Tensor,  # [E] int32
        row_base: cute.Tensor,  # [R, E_loc] int32
        a_buf: cute.Tensor,  # [M_cap, H] bf16 (gathered rows, then y)
        # peer pointer tables, int64 [R]
        flags_tab: cute.Tensor,
        x_tab: cute.Tensor,
        send_tab: cute.Tensor,
        cnt_tab: cute.Tensor,
        start_tab: cute.Tensor,
        row_base_tab: cute.Tensor,
        y_tab: cute.Tensor,
        # local workspace
        cta_cnt: cute.Tensor,  # [G, E] int32
        pair_pos: cute.Tensor,  # [T_cap*K] int32
        src_meta: cute.Tensor,  # [R, 4] int32
        m_block_expert: cute.Tensor,  # [M_cap/tile_m] int32 (M_cap a multiple of tile_m * cluster_m)
        meta: cute.Tensor,  # [4] int32
        h_buf: cute.Tensor,  # [M_cap, I] bf16
        ep_state: cute.Tensor,  # [4] int32: device-side epoch state (zeroed at allocation)
        abort: cute.Tensor,  # [4] int32: (aborted, stage, peer, epoch); kernel 0 clears it
        rank: cutlass.Int32,
        timeout_ns: cutlass.Int64,
        stream,
    ):
        local_experts = w13.shape[0]
        top_k = topk_ids.shape[1]
        self.route(x, topk_ids, live_tokens, x_sym, cta_cnt, pair_pos, send_list, expert_cnt, expert_start,
                   ep_state, abort, local_experts * self.world_size, not self.push, stream)  # fmt: skip
        self.dispatch(x, live_tokens, flags, x_sym, send_list, expert_start, row_base, a_buf,
                      flags_tab, x_tab, send_tab, cnt_tab, start_tab, row_base_tab, y_tab, src_meta, m_block_expert,
                      meta, ep_state, abort, rank, timeout_ns, local_experts, top_k, stream)  # fmt: skip
        # 7-8: expert GEMMs, as the world-1 kernel (meta[0] = 0 after an abort: no tiles)
        pdl = self.use_pdl
        self.fc1.launch(a_buf, self._expert_major_view(w13), h_buf, m_block_expert, meta, stream, pdl)
        self.fc2.launch(h_buf, self._expert_major_view(w2), a_buf, m_block_expert, meta, stream, pdl)
        self.combine(topk_ids, topk_weights, live_tokens, pair_pos, flags, flags_tab, row_base_tab, y_tab, out,
                     a_buf, meta, ep_state, abort, rank, timeout_ns, local_experts, stream)  # fmt: skip
