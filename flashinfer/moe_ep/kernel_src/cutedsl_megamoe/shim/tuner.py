"""The tuning surface of the drop's kernels: knob taxonomy, value sets, validity, candidates, token
buckets and per-bucket defaults. Pure Python: no cutlass, no GPU.

Taxonomy. A knob is either

- ``performance``: output-neutral (tile shapes, stage counts, persistent grid size). Any valid value
  computes the same result; autotune may pick any of them.
- ``correctness``: changes a code path or the output (e.g. a future atomic combine, whose
  accumulation order varies from run to run). Values listed in ``KnobSpec.nondeterministic`` are never
  a candidate unless the caller allows nondeterminism.

A ``layout`` knob also changes the prepared weight layout; a layer stores its weights once, so every
token bucket of one layer shares its layout knobs (``pin``).

Validity is ``KnobSpec.values`` (the value set) plus the frontend's own ``check()`` (the geometry
rules): ``is_valid`` calls it instead of restating it. ``candidates`` is a small, deterministic,
pruned list of valid knob sets; ``default_knobs`` reads the measured per-bucket profiles.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import kernel_helpers as kh
from . import knob_cache
from .bf16 import Bf16Frontend, Bf16Knobs, default_bf16_knobs, mma_overlap_pays, split_fc1_pays
from .frontend import Geometry, KernelFrontend

PERFORMANCE = "performance"
CORRECTNESS = "correctness"


# -- token buckets ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenBucket:
    """Token counts ``<= max_tokens`` (``None``: no upper bound) not taken by an earlier bucket."""

    name: str
    max_tokens: int | None
    tune_tokens: int  # T that autotune measures this bucket at (clipped to the layer's capacity)


#: One token, decode steps and small batches, mid-size batches, prefill chunks. The decode/mid boundary
#: is measured (H200, drop v4, TUNING.md): the 64-row decode profile beat the 128-row one on all three
#: bench contracts at every T from 192 to 768 and lost on both qwen3 contracts at 1024; the mid/prefill
#: boundary is design data. ``single`` (T <= 1) exists for the FC1 split (``BF16_PROFILES``), which
#: pays at T = 1 only (drop v20, TUNING.md "Session 13").
TOKEN_BUCKETS: tuple[TokenBucket, ...] = (
    TokenBucket("single", 1, 1),
    TokenBucket("decode", 768, 256),
    TokenBucket("mid", 2047, 1024),
    TokenBucket("prefill", None, 4096),
)
#: The expert-parallel kernel's buckets (over the global T): no ``single``, as the EP kernel has no FC1
#: split and a global T of 1 only occurs at world size 1.
EP_TOKEN_BUCKETS: tuple[TokenBucket, ...] = TOKEN_BUCKETS[1:]


def bucket_of(tokens: int, buckets: tuple[TokenBucket, ...] = TOKEN_BUCKETS) -> str:
    """The bucket serving a forward of ``tokens`` rows (a host-side shape: no device sync)."""
    for b in buckets:
        if b.max_tokens is None or tokens <= b.max_tokens:
            return b.name
    raise ValueError(f"no token bucket takes T={tokens}; the last bucket must be unbounded")


def buckets_for(max_tokens: int, buckets: tuple[TokenBucket, ...] = TOKEN_BUCKETS) -> tuple[TokenBucket, ...]:
    """The buckets a layer of capacity ``max_tokens`` can see, smallest first."""
    last = bucket_of(max(1, max_tokens), buckets)
    names = [b.name for b in buckets]
    return buckets[: names.index(last) + 1]


def tune_tokens(bucket: TokenBucket, max_tokens: int) -> int:
    """T to measure ``bucket`` at for a layer of capacity ``max_tokens`` (stays inside the bucket)."""
    return max(1, min(bucket.tune_tokens, max_tokens))


# -- knob taxonomy ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KnobSpec:
    name: str
    kind: str  # PERFORMANCE or CORRECTNESS
    values: Collection[Any] | Callable[[], Collection[Any]]  # every value is_valid accepts (lazy: no src import)
    search: tuple[Any, ...] | None  # values candidates() tries; None: only the default's value
    layout: bool = False  # changes the prepared weight layout (one value per layer)
    nondeterministic: tuple[Any, ...] = ()  # values whose output varies run to run
    # A row tile: values above the sweep's T are pruned (one expert gets at most T rows, so such a
    # tile is mostly padding); the smallest value always stays.
    row_tile: bool = False
    why: str = ""

    def value_set(self) -> Collection[Any]:
        return self.values() if callable(self.values) else self.values

    def describe_values(self) -> str:
        v = self.value_set()
        if isinstance(v, range):
            return f"{v.start}..{v.stop - 1}"
        return "{" + ", ".join(map(repr, v)) + "}"


_STAGES = (None, 2, 3, 4, 5, 6, 7, 8)
_TILE_N = (64, 128, 192, 256)  # what the drop's GroupedGemmSm90 accepts

BF16_KNOBS: tuple[KnobSpec, ...] = (
    KnobSpec("fc1_tile_n", PERFORMANCE, _TILE_N, (64, 128, 256), layout=True,
             why="FC1 N tile; w13 is gate/up interleaved per tile, so the layer's weights depend on it"),
    KnobSpec("fc1_tiled", PERFORMANCE, (False, True), None, layout=True,
             why="w13 stored as contiguous weight tiles (one run of memory per TMA load); measured, not searched"),
    KnobSpec("tile_m", PERFORMANCE, (64, 128, 256), (64, 128), row_tile=True,
             why="rows per M tile; each expert's rows pad to it (the workspace depends on it)"),
    KnobSpec("cluster_m", PERFORMANCE, (1, 2), (1, 2),
             why="CTAs per cluster along M sharing each weight tile within an expert (prefill default)"),
    KnobSpec("fc2_tile_n", PERFORMANCE, _TILE_N, (64, 128, 256), why="FC2 N tile over H"),
    KnobSpec("gather_in_fc1", PERFORMANCE, (False, True), None,
             why="FC1 loads its rows from x (no gathered copy); measured, not searched"),
    KnobSpec("fc1_split_n", PERFORMANCE, (False, True), None,
             why="FC1 tiles of 128 over the 256 layout (T = 1, the single bucket's rule); measured, not searched"),
    KnobSpec("fc2_early_weights", PERFORMANCE, (False, True), None,
             why="FC2's first weight loads before its wait for FC1 (with cluster_m 1); measured, not searched"),
    KnobSpec("mma_overlap", PERFORMANCE, (False, True), None,
             why="one WGMMA batch in flight while the next is issued (off: drops <= v46's effective wait); measured"),
    KnobSpec("decode_fused", PERFORMANCE, (False, True), None,
             why="the whole layer in one launch for a few tokens (T * top_k <= 256); the bucket's rule"),
    KnobSpec("decode_warps", PERFORMANCE, (8, 16), None, why="warps per CTA of the fused decode kernel"),
    KnobSpec("decode_stages", PERFORMANCE, range(2, 9), None, why="ring depth per warp of the fused decode kernel"),
    KnobSpec("decode_k_warps", PERFORMANCE, (None, 1, 2, 4, 8, 16), None,
             why="warps per FC1 unit of the fused decode kernel (None: all of the CTA's)"),
    KnobSpec("pair_blocks", PERFORMANCE, (False, True), None,
             why="the chain without a routing kernel, one M block per pair (T * top_k <= num_experts)"),
    KnobSpec("pair_combine", PERFORMANCE, (False, True), None,
             why="with pair_blocks, FC2 combines the pairs itself (no combine kernel)"),
    # None = as many stages as shared memory allows; an explicit depth can overflow shared memory,
    # which only the compiler detects, so candidates keep None and explicit depths are for hand tuning.
    KnobSpec("fc1_stages", PERFORMANCE, _STAGES, None, why="FC1 TMA pipeline depth"),
    KnobSpec("fc2_stages", PERFORMANCE, _STAGES, None, why="FC2 TMA pipeline depth"),
    # Above the device's SM count a persistent grid is no longer co-resident.
    KnobSpec("num_sms", PERFORMANCE, lambda: range(1, kh.constants.DEFAULT_NUM_SMS + 1), None,
             why="persistent grid size (SMs left to other work when smaller)"),
)  # fmt: skip


# -- per-bucket default profiles ----------------------------------------------------------------------
#: Bucket -> overrides of ``default_bf16_knobs`` (128-row M tiles, widest N tiles), from the H200
#: sweeps in TUNING.md: 64-row M tiles with 128-wide FC2 tiles won at T <= 768 on all three bench
#: contracts; at T >= 4096 clusters of two CTAs sharing weight tiles (drop v4: no extra padding) won on
#: five of six points (deepseek-v3 16384: 21.7 vs 29.0 ms; qwen3-30b-a3b 16384 lost 4 %); ``mid``
#: keeps the base defaults (cluster_m=2 was even or slower at T = 1024).
BF16_PROFILES: dict[str, dict[str, Any]] = {
    "single": {"tile_m": 64, "fc2_tile_n": 128},  # + fc1_split_n where it pays, pair_blocks + pair_combine
    "decode": {"tile_m": 64, "fc2_tile_n": 128},
    "mid": {},
    "prefill": {"cluster_m": 2},
}
BF16_PROFILES_SOURCE = (
    "H200 sweeps 2026-11-29 (TUNING.md): decode = tile_m 64 / fc2_tile_n 128; mid = defaults; "
    "prefill = cluster_m 2 (drop v4; the cluster pair table of drops v6-v7); single = decode + the FC1 "
    "split where twice FC1's CTAs fit the grid (drop v20, session 12 run 13) + pair_blocks (drop v43, "
    "session 29: 0.94-0.98x the chain's time at T = 1 on the three bench contracts, outputs bitwise equal) + "
    "pair_combine (drop v44, session 30: the layer without it 1.00-1.06x slower at T = 1, outputs bitwise equal)"
)


def bf16_refine(geometry: Geometry, bucket: str, knobs: Bf16Knobs) -> Bf16Knobs:
    """The geometry-dependent part of a BF16 profile: in ``single``, the FC1 split where it is valid
    (``is_valid``: gated, the 256 layout, no cluster) and pays (``bf16.split_fc1_pays``), and the chain
    without its routing kernel (``pair_blocks``) and its combine kernel (``pair_combine``) where valid (FC1
    gathers, no cluster, top_k <= num_experts); in ``prefill``, each WGMMA batch waited for where keeping
    one in flight does not pay (``bf16.mma_overlap_pays``)."""
    if bucket == "prefill" and not mma_overlap_pays(geometry):
        return dataclasses.replace(knobs, mma_overlap=False)
    if bucket != "single":
        return knobs
    if split_fc1_pays(geometry, knobs):
        split = dataclasses.replace(knobs, fc1_split_n=True)
        knobs = split if is_valid(geometry, split)[0] else knobs
    pairs = dataclasses.replace(knobs, pair_blocks=True, pair_combine=True)
    return pairs if is_valid(geometry, pairs)[0] else knobs


@dataclass(frozen=True)
class KernelFamily:
    name: str
    knobs_cls: type
    frontend_cls: type[KernelFrontend]
    specs: tuple[KnobSpec, ...]
    base_defaults: Callable[[Geometry], Any]
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    profiles_source: str = ""
    # (geometry, bucket name, knobs) -> knobs: what a static profile cannot say (a rule of the geometry)
    refine: Callable[[Geometry, str, Any], Any] | None = None

    def spec(self, name: str) -> KnobSpec:
        return next(s for s in self.specs if s.name == name)

    @property
    def layout_knobs(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.layout)

    @property
    def deterministic(self) -> bool:
        """Every value of every knob is run-to-run deterministic."""
        return not any(s.nondeterministic for s in self.specs)


BF16 = "moe_bf16_glu"
FAMILIES: dict[str, KernelFamily] = {
    BF16: KernelFamily(
        BF16, Bf16Knobs, Bf16Frontend, BF16_KNOBS, default_bf16_knobs, BF16_PROFILES, BF16_PROFILES_SOURCE, bf16_refine
    ),
}


def family(name: str = BF16) -> KernelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(FAMILIES)}") from None


def as_knobs(knobs: Any, name: str = BF16) -> Any:
    """A mapping (overrides of the base defaults need a geometry: use ``with_overrides``) or the
    family's knob dataclass -> the dataclass. Raises TypeError on unknown knob names."""
    fam = family(name)
    if isinstance(knobs, fam.knobs_cls):
        return knobs
    return fam.knobs_cls(**dict(knobs))


def with_overrides(geometry: Geometry, overrides: Mapping[str, Any], name: str = BF16) -> Any:
    """The base defaults of ``geometry`` with ``overrides`` applied (TypeError on unknown names)."""
    base = family(name).base_defaults(geometry)
    return dataclasses.replace(base, **dict(overrides))


def knobs_dict(knobs: Any) -> dict[str, Any]:
    return dataclasses.asdict(knobs) if dataclasses.is_dataclass(knobs) else dict(knobs)


def is_valid(geometry: Geometry, knobs: Any, *, name: str = BF16) -> tuple[bool, str]:
    """(True, "") when ``knobs`` can be compiled for ``geometry``, else (False, the reason).

    The value sets come from the taxonomy; the geometry rules are the frontend's ``check()``.
    """
    fam = family(name)
    try:
        k = as_knobs(knobs, name)
    except TypeError as exc:
        return False, f"not a {fam.knobs_cls.__name__}: {exc}"
    for spec in fam.specs:
        value = getattr(k, spec.name)
        if value not in spec.value_set():
            return False, f"{spec.name}={value!r} is not in {spec.describe_values()}"
    try:
        fam.frontend_cls(geometry, k).check()
    except ValueError as exc:
        return False, str(exc)
    return True, ""


def pin(knobs: Any, pinned: Mapping[str, Any] | None) -> Any:
    """``knobs`` with the ``pinned`` values (the layer's layout knobs) forced."""
    return dataclasses.replace(knobs, **dict(pinned)) if pinned else knobs


def layout_of(knobs: Any, name: str = BF16) -> dict[str, Any]:
    """The layout knobs of ``knobs`` (what a layer's buckets must share)."""
    return {n: getattr(knobs, n) for n in family(name).layout_knobs}


def default_knobs(geometry: Geometry, tokens: int, *, name: str = BF16, pinned: Mapping[str, Any] | None = None) -> Any:
    """The profile of ``bucket_of(tokens)`` over the base defaults (see ``BF16_PROFILES_SOURCE``), with
    the ``pinned`` knobs (the layer's layout) forced before the family's geometry rule (``refine``).

    A profile entry that is invalid for ``geometry`` (a tile that does not divide) falls back to the
    base defaults, which are valid for every geometry the frontend serves (refined the same way: the rule
    keeps only what stays valid).
    """
    fam = family(name)
    bucket = bucket_of(tokens)

    def refined(knobs: Any) -> Any:
        return knobs if fam.refine is None else fam.refine(geometry, bucket, knobs)

    knobs = refined(pin(with_overrides(geometry, fam.profiles.get(bucket, {}), name), pinned))
    return knobs if is_valid(geometry, knobs, name=name)[0] else refined(pin(fam.base_defaults(geometry), pinned))


def candidates(
    geometry: Geometry,
    tokens: int,
    *,
    name: str = BF16,
    pinned: Mapping[str, Any] | None = None,
    allow_nondeterministic: bool = False,
) -> list[Any]:
    """Valid knob sets to time at ``tokens`` rows, deterministic order (layout knobs outermost, so a
    sweep re-lays the weights only when the layout changes).

    Pruned: knobs without a search set stay at the default's value; ``pinned`` knobs are fixed;
    nondeterministic values are left out unless allowed; row tiles above ``tokens`` are left out
    (``KnobSpec.row_tile``).
    The default for ``tokens`` is always in the list. In the ``single`` bucket (BF16) the default with
    ``decode_fused`` is one more candidate.
    """
    fam = family(name)
    base = default_knobs(geometry, tokens, name=name, pinned=pinned)
    pinned = dict(pinned or {})
    axes: list[tuple[str, tuple[Any, ...]]] = []
    for spec in sorted(fam.specs, key=lambda s: not s.layout):  # stable: layout knobs first
        if spec.name in pinned:
            values: tuple[Any, ...] = (pinned[spec.name],)
        elif spec.search is None:
            values = (getattr(base, spec.name),)
        else:
            values = spec.search
        if not allow_nondeterministic:
            values = tuple(v for v in values if v not in spec.nondeterministic)
        if spec.row_tile:
            small = tuple(v for v in values if v <= tokens)
            values = small or values[:1]
        axes.append((spec.name, values))
    out: list[Any] = []
    for combo in itertools.product(*(v for _, v in axes)):
        knobs = dataclasses.replace(base, **dict(zip((n for n, _ in axes), combo, strict=True)))
        if knobs not in out and is_valid(geometry, knobs, name=name)[0]:
            out.append(knobs)
    if base not in out and is_valid(geometry, base, name=name)[0]:
        out.insert(0, base)
    if name == BF16 and bucket_of(tokens) == "single" and "decode_fused" not in pinned:
        # the whole layer in one launch against the chain of kernels (issue #3: keep both, let the tuner
        # choose); only the single bucket, the one its pair limit covers in every layer
        fused = dataclasses.replace(base, decode_fused=True, pair_blocks=False, pair_combine=False)  # chain's knobs
        if fused not in out and is_valid(geometry, fused, name=name)[0]:
            out.append(fused)
    return out


def resolve_knobs(
    geometry: Geometry,
    bucket: TokenBucket,
    context: knob_cache.TuneContext,
    *,
    name: str = BF16,
    path: Path | None = None,
    pinned: Mapping[str, Any] | None = None,
) -> tuple[Any, str]:
    """The serving knobs of ``bucket``: the knob cache on an exact hit, else the bucket's defaults
    (the lookup rule of ``knob_cache``). Returns (knobs, source); ``pinned`` (the layer's layout
    knobs) is forced on either. No compile, no collective."""
    key = knob_cache.KnobKey.make(name, geometry, bucket.name, context)
    entry = knob_cache.lookup(key, path)
    if entry is not None:
        try:
            knobs = pin(with_overrides(geometry, entry.knobs, name), pinned)
        except TypeError:  # a knob this family no longer has
            knobs = None
        if knobs is not None and is_valid(geometry, knobs, name=name)[0]:
            return knobs, "knob cache"
    return default_knobs(geometry, bucket.tune_tokens, name=name, pinned=pinned), "defaults"


__all__ = [
    "BF16",
    "BF16_KNOBS",
    "BF16_PROFILES",
    "BF16_PROFILES_SOURCE",
    "CORRECTNESS",
    "FAMILIES",
    "PERFORMANCE",
    "EP_TOKEN_BUCKETS",
    "TOKEN_BUCKETS",
    "KernelFamily",
    "KnobSpec",
    "TokenBucket",
    "as_knobs",
    "bf16_refine",
    "bucket_of",
    "buckets_for",
    "candidates",
    "default_knobs",
    "family",
    "is_valid",
    "knobs_dict",
    "layout_of",
    "pin",
    "resolve_knobs",
    "tune_tokens",
    "with_overrides",
]
