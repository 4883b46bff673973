"""Token buckets, knob cache and collective autotune of the SM90 BF16 expert-parallel kernel.

Token buckets: ``drop.tuner.EP_TOKEN_BUCKETS`` over the GLOBAL token count ``world_size * T`` (the rows per
expert that the owners' GEMMs see scale with it, as T does at world size 1), chosen per forward from
this rank's ``T`` (a host shape; under a CUDA graph the captured rows). Each bucket has one knob set:
``tile_m``, ``fc1_tile_n``, ``fc2_tile_n``, ``cluster_m``, ``dispatch``; the FC1 tile is the weight layout,
and ranks of one forward may sit in different buckets, so every bucket takes the largest bucket's FC1
tile and dispatch (``bucket_frontends``). Every bucket's kernel shares the rank's one EP state (buffers sized
for all). Defaults per bucket: ``drop.EP_BUCKET_DEFAULTS`` (the world-size-1 defaults; measured
against the EP autotune winners on two H200s, TUNING.md).

Autotune (``knobs="auto"`` at ``warmup()``, or the ``tune`` command): per bucket, largest first, at one
T per rank (``bucket_plan``), ``drop.autotune`` over ``drop.ep_candidates`` (every valid tile
combination; the bucket's current knobs are the incumbent), every rank in lockstep, a candidate
failing anywhere dropped everywhere. The EP specifics:

- per candidate every rank builds (loads) its kernel and its weights in that candidate's layout; the
  EP rank state is one per rank for the whole run (a symmetric allocation, collective, sized for every
  candidate at the first one), resynchronized between candidates as after a failed forward (a fresh
  state per candidate ran the free GPU memory down on two H200s until a bucket failed: TUNING.md);
- the timed launch is the collective forward, host-timed with each launch synchronized; an expired
  cross-rank wait fails the candidate (every rank's abort word is read after its timings; the other
  ranks' waits expire too);
- with loopback ranks (one process, one GPU) one call tunes every rank of the group: a candidate's
  launch runs all ranks' forwards on their streams. Those timings say nothing about real EP (all ranks
  share one GPU): they are recorded under the device name + ``LOOPBACK_SUFFIX``, so they never serve a
  layer over NVSHMEM.

Knob cache: family ``drop.EP_KNOB_FAMILY``, the bucket name, the GLOBAL geometry, the world size and
device name of the context. ``knobs=None`` reads it (exact match per bucket, else the defaults); no
compile and no collective on the serving path (over NVSHMEM rank 0's knobs are broadcast at
construction, so every rank sizes the same symmetric buffers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ......core.inputs import make_hidden_states, make_topk
from ......errors import MoEEpBackendUnavailableError
from .tuning import DEFAULT_MARGIN, _drop, tune_context_named

#: appended to the device name of loopback tunings (see the module docstring)
LOOPBACK_SUFFIX = " (loopback)"


def ep_context(device: torch.device, world_size: int, loopback: bool) -> Any:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return tune_context_named(name + (LOOPBACK_SUFFIX if loopback else ""), world_size)


def ep_buckets(world_size: int, max_tokens: int) -> tuple[Any, ...]:
    """The token buckets a layer of per-rank capacity ``max_tokens`` reaches (global T), smallest first."""
    tuner = _drop().tuner
    return tuner.buckets_for(world_size * max(1, max_tokens), tuner.EP_TOKEN_BUCKETS)


def bucket_of(world_size: int, tokens: int) -> str:
    """The bucket of a forward with ``tokens`` rows on this rank."""
    tuner = _drop().tuner
    return tuner.bucket_of(world_size * tokens, tuner.EP_TOKEN_BUCKETS)


def bucket_plan(world_size: int, max_tokens: int) -> list[tuple[Any, int]]:
    """(bucket, T per rank to tune it at), largest bucket first; ``world_size * T`` stays in the bucket."""
    tuner = _drop().tuner
    plan = []
    for b in reversed(ep_buckets(world_size, max_tokens)):
        t = tuner.tune_tokens(b, world_size * max(1, max_tokens)) // world_size
        plan.append((b, max(1, min(max_tokens, t))))
    return plan


def autotune_candidates(geometry: Any, world_size: int, ranks_per_gpu: int, max_tokens: int) -> dict[str, list[Any]]:
    """Bucket name -> the knobs ``knobs="auto"`` tries for it (its defaults first), for every bucket a
    layer of per-rank capacity ``max_tokens`` reaches: what the autotune runs and the build prepares."""
    drop = _drop()
    plan = bucket_plan(world_size, max_tokens)
    dispatch = drop.default_bf16_ep_knobs(geometry, world_size, ranks_per_gpu, bucket=plan[0][0].name).dispatch
    out = {}
    for bk, _ in plan:  # the layer's dispatch (the largest bucket's) in every bucket
        cands = drop.ep_candidates(geometry, world_size, ranks_per_gpu, bk.name)
        out[bk.name] = list(dict.fromkeys(replace(k, dispatch=dispatch) for k in cands))
    return out


def bucket_frontends(
    geometry: Any, world_size: int, ranks_per_gpu: int, buckets: Sequence[Any], tiles: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The kernel of every bucket: bucket name -> checked ``Bf16EpFrontend`` of ``tiles[name]`` over the
    bucket's defaults (equal knobs share one frontend). Raises ValueError on invalid knobs, or when the
    buckets disagree on the FC1 tile (the weight layout, one per layer).

    The dispatch is the layer's, not the bucket's: every bucket takes the largest bucket's. Ranks pick
    their bucket from their own rows, so two ranks of one forward may be in different buckets (one
    prefilling, one decoding), and a pull owner never waits for pushes while a push source never
    fills ``x_sym``: mixed dispatches would read stale rows and time out."""
    drop = _drop()
    by_knobs: dict[Any, Any] = {}
    out: dict[str, Any] = {}
    dispatch: str | None = None
    for bucket in reversed(buckets):
        knobs = drop.default_bf16_ep_knobs(geometry, world_size, ranks_per_gpu, tiles[bucket.name], bucket.name)
        dispatch = dispatch or knobs.dispatch
        knobs = replace(knobs, dispatch=dispatch)
        if knobs not in by_knobs:
            by_knobs[knobs] = drop.Bf16EpFrontend(geometry, knobs)
            by_knobs[knobs].check()
        out[bucket.name] = by_knobs[knobs]
    out = {b.name: out[b.name] for b in buckets}
    layouts = {fe.knobs.fc1_tile_n for fe in out.values()}
    if len(layouts) != 1:
        raise ValueError(f"every token bucket needs one fc1_tile_n (the weight layout), got {sorted(layouts)}")
    return out


def layer_tiles(
    geometry: Any, context: Any, world_size: int, ranks_per_gpu: int, buckets: Sequence[Any], knobs: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The tile knobs of every bucket of an EP layer and where each came from: an explicit dict of
    ``knobs`` (every bucket, "config"), else the knob cache of ``context`` ("knob cache"; an entry of
    another FC1 tile than the largest bucket's, the weight layout, is not used), else the bucket's
    defaults ("defaults"). ``bucket_frontends`` makes the kernels of them."""
    tiles: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    layout: int | None = None  # the largest bucket's FC1 tile: the weight layout of every bucket
    for bucket in reversed(buckets):
        if isinstance(knobs, dict):
            tiles[bucket.name], sources[bucket.name] = dict(knobs), "config"
            continue
        cached = cached_ep_knobs(geometry, context, bucket.name)
        if cached is not None and layout is not None and cached["fc1_tile_n"] != layout:
            cached = None  # another weight layout than the largest bucket's: not usable here
        tiles[bucket.name] = cached or {}
        sources[bucket.name] = "knob cache" if cached else "defaults"
        if layout is None:
            layout = _drop().default_bf16_ep_knobs(geometry, world_size, ranks_per_gpu, cached, bucket=bucket.name)
            layout = layout.fc1_tile_n
    return tiles, sources


def cached_ep_knobs(geometry: Any, context: Any, bucket: str, path: Path | None = None) -> dict[str, int | str] | None:
    """The recorded tile knobs of ``geometry`` in ``context`` and ``bucket``, or None (a miss, the cache
    off, an entry of other knobs)."""
    drop = _drop()
    key = drop.knob_cache.KnobKey.make(drop.EP_KNOB_FAMILY, geometry, bucket, context)
    entry = drop.knob_cache.lookup(key, path)
    if entry is None or set(entry.knobs) != set(drop.EP_KNOBS):
        return None
    return {k: v if isinstance(v, str) else int(v) for k, v in entry.knobs.items()}


def describe_ep_knobs(knobs: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in _drop().ep_knob_dict(knobs).items())


def record_ep_knobs(
    geometry: Any, context: Any, bucket: str, knobs: Any, ms: float, tokens: int, path: Path | None = None
) -> None:
    drop = _drop()
    key = drop.knob_cache.KnobKey.make(drop.EP_KNOB_FAMILY, geometry, bucket, context)
    drop.knob_cache.record(key, drop.ep_knob_dict(knobs), path, source="autotune", ms=ms, tokens=tokens)


class _Candidate:
    """One rank's resources for one candidate: kernel, weights in its layout, the run's EP rank state
    (``state``: one per rank for the whole autotune, sized for every candidate), random inputs of
    ``tokens`` rows."""

    def __init__(
        self, backend: Any, knobs: Any, tokens: int, weights: tuple[torch.Tensor, torch.Tensor], state: Any
    ) -> None:
        drop = _drop()
        self.frontend = drop.Bf16EpFrontend(backend.frontend.geometry, knobs)
        self.frontend.check()
        self.fn = self.frontend.load()  # the kernel cache (or a compile where CuTe DSL is installed)
        self.w13, self.w2 = weights  # in this candidate's layout (``autotune_ep`` prepares each layout once)
        self.state = state
        c = backend.config
        gen = torch.Generator().manual_seed(4321 + backend.bootstrap.rank)
        self.x = make_hidden_states(tokens, c.hidden_size, generator=gen, device=backend.device)
        self.ids, self.w = make_topk(tokens, c.num_experts, c.top_k, generator=gen, device=backend.device)
        self.out = torch.empty(tokens, c.hidden_size, dtype=torch.bfloat16, device=backend.device)
        self.timeout_ns = int(backend.bootstrap.transport_timeout_s * 1e9)

    def launch(self) -> None:
        self.state.launch(self.fn, (self.x, self.ids, self.w, self.w13, self.w2), self.out, self.timeout_ns)

    def check(self) -> None:
        """Raise when a cross-rank wait of the launches so far expired (reads the abort word)."""
        hit = self.state.poll_abort(wait=True)
        if hit is not None:
            raise RuntimeError(f"cross-rank wait {self.state.describe_stage(hit[0])} on rank {hit[1]} expired")


def _timer(checks: Callable[[], None]) -> Callable[[Callable[[], Any], int], list[float]]:
    """Host-timed launches (each one synchronized: a collective forward, so every rank is in step),
    then ``checks`` (the abort words): an expired wait fails the candidate."""

    def timer(launch: Callable[[], Any], iters: int) -> list[float]:
        for _ in range(2):
            launch()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            launch()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        checks()
        return times

    return timer


def autotune_ep(
    backends: Sequence[Any],
    *,
    group: Any = None,
    iters: int = 10,
    margin: float = DEFAULT_MARGIN,
    progress: bool = True,
) -> dict[str, Any]:
    """Tune every bucket of the EP layers in ``backends``: one backend per process (NVSHMEM, ``group`` =
    the EP group, every rank calls this) or every rank of one loopback group (one call). Returns bucket
    -> (``AutotuneResult``, T per rank it was tuned at): the same winners everywhere; the caller
    applies them."""
    drop = _drop()
    first = backends[0]
    b = first.bootstrap
    loopback = first.mode == "loopback"
    current: list[list[_Candidate]] = [[]]
    prepared: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # FC1 layout -> every rank's weights
    streams = [torch.cuda.Stream(be.device) for be in backends] if loopback else []

    def weights_for(knobs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's weights in the layout of ``knobs``, prepared once per layout (one kept)."""
        if knobs.fc1_tile_n not in prepared:
            prepared.clear()  # free the previous layout first
            fe = drop.Bf16EpFrontend(first.frontend.geometry, knobs)
            prepared[knobs.fc1_tile_n] = [fe.prepare_weights(*be.natural_weights()) for be in backends]
        return prepared[knobs.fc1_tile_n]

    states: list[Any] = []  # every rank's one EP state of the run: with a fresh one per candidate (each
    # freed before the next) the free GPU memory fell from candidate to candidate on two H200s until the
    # third bucket ran out (TUNING.md)

    def state_for_next() -> list[Any]:
        """The run's states, allocated at the first candidate (collective), then resynchronized: every
        rank idle, the largest epoch any rank reached, the next reuse wait skipped (as after a failed
        forward, so a candidate that aborted leaves nothing behind)."""
        if not states:
            for be in backends:  # in rank order: the loopback provider pairs the ranks' allocations
                with torch.cuda.device(be.device):
                    states.append(drop.EpRankState(sizing[0], be.make_provider(), be.bootstrap.rank,
                                                   be.fleet.max_tokens_per_rank, be.device, sizing[1:],
                                                   be.ep_group()))  # fmt: skip
            return states
        drop.resync_states(states, None if loopback else group)
        return states

    def release() -> None:
        current[0] = []
        torch.cuda.synchronize()

    def checks() -> None:
        for c in current[0]:
            c.check()

    plan = bucket_plan(b.world_size, first.fleet.max_tokens_per_rank)
    geometry, rpg = first.frontend.geometry, first.ranks_per_gpu
    candidates = autotune_candidates(geometry, b.world_size, rpg, first.fleet.max_tokens_per_rank)
    every = {first.by_bucket[bk.name].knobs for bk, _ in plan} | {k for ks in candidates.values() for k in ks}
    sizing = tuple(drop.Bf16EpFrontend(geometry, k) for k in sorted(every, key=repr))
    results: dict[str, Any] = {}
    pinned_fc1: int | None = None
    try:
        for bucket, tokens in plan:

            def run_candidate(knobs: Any, tokens: int = tokens) -> Callable[[], None]:
                release()
                weights = weights_for(knobs)
                ranks = zip(backends, weights, state_for_next(), strict=True)
                current[0] = [_Candidate(be, knobs, tokens, w, st) for be, w, st in ranks]
                torch.cuda.synchronize()  # flags zeroed before any rank signals (autotune's barrier follows)
                if not loopback:
                    return current[0][0].launch

                def launch_all() -> None:
                    main = torch.cuda.current_stream()
                    for c, s in zip(current[0], streams, strict=True):
                        s.wait_stream(main)
                        with torch.cuda.stream(s):
                            c.launch()
                    for s in streams:
                        main.wait_stream(s)

                return launch_all

            incumbent = first.by_bucket[bucket.name].knobs
            if pinned_fc1 is not None:  # the weight layout is the largest bucket's
                tiles = {**drop.ep_knob_dict(incumbent), "fc1_tile_n": pinned_fc1}
                incumbent = drop.default_bf16_ep_knobs(geometry, b.world_size, rpg, tiles)
            # the dispatch is the layer's (``bucket_frontends``): every candidate takes the incumbent's
            pinned = [replace(k, dispatch=incumbent.dispatch) for k in candidates[bucket.name]]
            cands = [incumbent] + [
                k
                for k in dict.fromkeys(pinned)
                if k != incumbent and (pinned_fc1 is None or k.fc1_tile_n == pinned_fc1)
            ]
            label = f"autotune {first.config.kernel_name} world {b.world_size} {bucket.name} T={tokens}/rank" + (
                " (loopback)" if loopback else ""
            )
            try:
                result = drop.autotune.autotune(
                    cands,
                    run_candidate,
                    group=None if loopback else group,
                    rank=0 if loopback else b.rank,
                    world_size=1 if loopback else b.world_size,
                    timer=_timer(checks),
                    iters=iters,
                    progress=progress,
                    label=label,
                    incumbent=incumbent,
                    margin=margin,
                )
            except drop.autotune.AutotuneError as exc:
                raise MoEEpBackendUnavailableError(str(exc)) from None
            finally:
                release()
            results[bucket.name] = (result, tokens)
            if pinned_fc1 is None:
                pinned_fc1 = result.winner.fc1_tile_n
    finally:
        prepared.clear()
        for st in states:  # in rank order (collective: every rank gets here, also on an error)
            st.release()
    return results


__all__ = [
    "LOOPBACK_SUFFIX",
    "autotune_candidates",
    "autotune_ep",
    "bucket_of",
    "bucket_frontends",
    "bucket_plan",
    "cached_ep_knobs",
    "describe_ep_knobs",
    "ep_buckets",
    "ep_context",
    "layer_tiles",
    "record_ep_knobs",
]
