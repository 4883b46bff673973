"""Token-bucket profiles and autotune of the SM90 BF16 backend (used by the layer and the ``tune`` command).

A layer holds one frontend per token bucket its capacity reaches (``drop.tuner.TOKEN_BUCKETS``) and
picks one per forward from the live T, a host-side shape. The knobs of each bucket come from, in order:
explicit ``knobs`` in the config (one set for every bucket), else the knob cache on an exact key match,
else the bucket's defaults. ``knobs="auto"`` starts from the same and re-tunes at ``warmup``.
Layout knobs (``fc1_tile_n``: the w13 interleave) are the largest bucket's for every bucket, so the
weights are stored once; all buckets share one workspace (``drop.allocate_shared_workspace``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ......core.inputs import make_hidden_states, make_topk
from ......errors import MoEEpBackendUnavailableError, MoEEpConfigError
from ..runtime import make_geometry
from .config import Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig

AUTO = "auto"
#: a candidate must beat a bucket's defaults by more than this to replace them: the run-to-run spread
#: of the layer's median time measured on the H200 (about 4 %, TUNING.md "Autotune and cold start").
DEFAULT_MARGIN = 0.04


def _drop() -> Any:
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe

    return cutedsl_megamoe


def tune_context(device: torch.device, world_size: int) -> Any:
    """The knob-cache context of ``device`` (its marketing name: one H200 tunes for every H200)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return tune_context_named(name, world_size)


def tune_context_named(device_name: str, world_size: int = 1) -> Any:
    """The knob-cache context of a GPU by name (to build its kernels on another machine)."""
    return _drop().knob_cache.TuneContext(device_name=device_name, world_size=world_size)


def distinct(frontends: Any) -> list[Any]:
    """Each frontend once (by identity: buckets with equal knobs share one), in order."""
    out: list[Any] = []
    for fe in frontends:
        if all(fe is not o for o in out):
            out.append(fe)
    return out


@dataclass
class Profiles:
    """The frontend of each bucket (identical knobs share one frontend), largest bucket last."""

    buckets: tuple[Any, ...]
    frontends: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def primary(self) -> Any:
        """The largest bucket's frontend: its layout knobs are the layer's weight layout."""
        return self.frontends[self.buckets[-1].name]

    def distinct(self) -> list[Any]:
        return distinct(self.frontends.values())

    def describe(self) -> str:
        return "; ".join(
            f"{b.name}: {describe_knobs(self.frontends[b.name].knobs)} ({self.sources.get(b.name, '?')})"
            for b in self.buckets
        )


def layer_profiles(
    config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig,
    num_local_experts: int,
    max_tokens: int,
    context: Any,
    *,
    chosen: Mapping[str, Any] | None = None,
    cache_path: Path | None = None,
) -> Profiles:
    """The per-bucket frontends of a layer of capacity ``max_tokens``. ``chosen``: bucket -> knobs
    that win over everything (autotune winners). No compile and no collective."""
    drop = _drop()
    tuner = drop.tuner
    geometry = make_geometry(config, num_local_experts)
    buckets = tuner.buckets_for(max_tokens)
    explicit = config.knobs is not None and config.knobs != AUTO
    if explicit and not isinstance(config.knobs, (Mapping, drop.Bf16Knobs)):
        raise MoEEpConfigError(
            f"{config.kernel_name}: knobs must be None, {AUTO!r}, a mapping or Bf16Knobs; got {config.knobs!r}"
        )
    by_knobs: dict[Any, Any] = {}
    frontends: dict[str, Any] = {}
    sources: dict[str, str] = {}
    pinned: dict[str, Any] | None = None
    for b in reversed(buckets):  # largest first: it fixes the layout knobs
        if chosen and b.name in chosen:
            knobs, source = tuner.pin(_as_knobs(config, geometry, chosen[b.name]), pinned), "autotune"
        elif explicit:
            knobs, source = _as_knobs(config, geometry, config.knobs), "config"
        else:
            knobs, source = tuner.resolve_knobs(geometry, b, context, path=cache_path, pinned=pinned)
        if pinned is None:
            pinned = tuner.layout_of(knobs)
        ok, why = tuner.is_valid(geometry, knobs)
        if not ok:
            raise MoEEpConfigError(f"{config.kernel_name}: {why}")
        if knobs not in by_knobs:
            by_knobs[knobs] = drop.Bf16Frontend(geometry, knobs)
        reach = max_tokens if b.max_tokens is None else min(b.max_tokens, max_tokens)
        limit = by_knobs[knobs].launch_token_limit
        if limit is not None and reach > limit[0]:
            most, knob, rule = limit
            raise MoEEpConfigError(
                f"{config.kernel_name}: {knob} serves at most {most} tokens per launch ({rule}, top_k="
                f"{geometry.top_k}), but token bucket {b.name!r} reaches T={reach}: give it other knobs or a "
                "smaller token capacity"
            )
        frontends[b.name], sources[b.name] = by_knobs[knobs], source
    return Profiles(buckets, {b.name: frontends[b.name] for b in buckets}, sources)


def _as_knobs(config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig, geometry: Any, knobs: Any) -> Any:
    """``Bf16Knobs`` as given; a mapping as overrides of the geometry's base defaults."""
    drop = _drop()
    if isinstance(knobs, drop.Bf16Knobs):
        return knobs
    try:
        return drop.tuner.with_overrides(geometry, knobs)
    except TypeError as exc:
        raise MoEEpConfigError(f"bad knobs for {config.kernel_name}: {exc}") from None


def autotune_profiles(
    config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig,
    num_local_experts: int,
    tokens: Sequence[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    device: torch.device,
    *,
    context: Any,
    group: Any = None,
    rank: int = 0,
    world_size: int = 1,
    allow_nondeterministic: bool = False,
    record: bool = True,
    cache_path: Path | None = None,
    kernel_cache_root: Path | None = None,
    progress: bool = True,
    iters: int = 10,
    margin: float = DEFAULT_MARGIN,
) -> dict[str, Any]:
    """Autotune one T per bucket (``tokens``), largest first (its winner fixes the layout knobs of the
    rest), every rank in lockstep. ``w13``/``w2``: this rank's weights in natural layouts, on
    ``device``. Records each winner in the knob cache (rank 0) when ``record``. Returns bucket ->
    ``AutotuneResult``. A candidate replaces a bucket's defaults only when it is faster by more than
    ``margin``, in the sweep and again timed head to head against them, interleaved (the defaults are the
    incumbent, see ``drop.autotune.autotune``)."""
    drop = _drop()
    tuner = drop.tuner
    geometry = make_geometry(config, num_local_experts)
    per_bucket: dict[str, int] = {}
    for t in tokens:
        name = tuner.bucket_of(t)
        if name in per_bucket:
            raise MoEEpConfigError(f"T={per_bucket[name]} and T={t} both fall in token bucket {name!r}; give one")
        per_bucket[name] = t
    order = [b for b in reversed(tuner.TOKEN_BUCKETS) if b.name in per_bucket]
    gen = torch.Generator().manual_seed(1234 + rank)
    prepared: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # layout -> weights (one at a time)
    results: dict[str, Any] = {}
    pinned: dict[str, Any] | None = None
    for b in order:
        t = per_bucket[b.name]
        x = make_hidden_states(t, config.hidden_size, generator=gen, device=device)
        ids, weights = make_topk(t, num_local_experts, config.top_k, generator=gen, device=device)
        out = torch.empty(t, config.hidden_size, dtype=torch.bfloat16, device=device)

        def run_candidate(knobs: Any, t: int = t, x: Any = x, ids: Any = ids, weights: Any = weights, out: Any = out):
            fe = drop.Bf16Frontend(geometry, knobs)
            fe.load(kernel_cache_root)  # compile or load (from the kernel cache)
            layout = tuple(sorted(tuner.layout_of(knobs).items()))
            if layout not in prepared:
                prepared.clear()  # free the previous layout first
                prepared[layout] = fe.prepare_weights(w13, w2)
            pw13, pw2 = prepared[layout]
            ws = fe.allocate_workspace(t, device)
            return lambda: fe.launch(x, ids, weights, pw13, pw2, out, ws)

        cands = tuner.candidates(geometry, t, pinned=pinned, allow_nondeterministic=allow_nondeterministic)
        incumbent = tuner.default_knobs(geometry, t, pinned=pinned)  # in ``cands`` (tuner.candidates)
        try:
            result = drop.autotune.autotune(
                cands,
                run_candidate,
                group=group,
                rank=rank,
                world_size=world_size,
                iters=iters,
                progress=progress,
                label=f"autotune {config.kernel_name} {b.name} T={t}",
                incumbent=incumbent,
                margin=margin,
                confirm=True,  # each launch holds its own weights and workspace: two can run side by side
            )
        except drop.autotune.AutotuneError as exc:
            raise MoEEpBackendUnavailableError(str(exc)) from None
        results[b.name] = result
        if pinned is None:
            pinned = tuner.layout_of(result.winner)
        if record and rank == 0:
            key = drop.knob_cache.KnobKey.make(tuner.BF16, geometry, b.name, context)
            drop.knob_cache.record(
                key, tuner.knobs_dict(result.winner), cache_path, source="autotune", ms=result.winner_ms, tokens=t
            )
    prepared.clear()
    return results


def build_winners(
    config: Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig,
    num_local_experts: int,
    results: Mapping[str, Any],
    root: Path | None = None,
) -> dict[str, Path]:
    """Build each bucket's winner into the kernel cache (a no-op when already there): bucket -> library."""
    drop = _drop()
    geometry = make_geometry(config, num_local_experts)
    return {name: drop.Bf16Frontend(geometry, r.winner).build(root) for name, r in results.items()}


def knob_cache_file(path: Path | None = None) -> Path | None:
    """Where winners are recorded: ``path``, else the knob cache's default (None when ``off``)."""
    return path if path is not None else _drop().knob_cache.cache_path()


def describe_knobs(knobs: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in _drop().tuner.knobs_dict(knobs).items())


__all__ = [
    "AUTO",
    "Profiles",
    "autotune_profiles",
    "build_winners",
    "tune_context_named",
    "describe_knobs",
    "distinct",
    "knob_cache_file",
    "layer_profiles",
    "make_geometry",
    "tune_context",
]
