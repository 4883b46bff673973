"""``bench``: the mega layer against the ``torch._grouped_mm`` pipeline, on one GPU, in one run.

Per contract and T: median latency over rotating input sets (CUDA events), TFLOP/s, touched-weight
GB/s, the roofline floor from ceilings measured in the same run (bf16 matmul, device copy), the ratio
to the baseline, and the error against the fp32 reference. Writes CSV (and a PNG plot when matplotlib
is installed); prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..backends.mega.kernel.sm90.runtime import prequantized_inputs
from ..config import BootstrapConfig, FleetParams, MegaConfig, MoEEpTensors, MoEWeightPack
from ..core.baselines import grouped_mm_moe
from ..core.contracts import CONTRACTS, GEOMETRY_FORM, get_contract
from ..core.inputs import make_contract_weights, make_hidden_states, make_token_inputs, relative_errors, rounding_ulps
from ..core.reference import moe_reference
from ..core.reference_quant import moe_reference_quantized, nvfp4_static_scales, quantize_expert_weights
from ..errors import MoEEpConfigError
from ..layer import MoEEpLayer
from .backends import choose_backend
from .clocks import ClockSampler, ClockWindow, nvidia_smi_id, timed_window

DEFAULT_TOKENS = (1, 16, 128, 1024, 4096, 16384)
DEFAULT_CONTRACTS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
#: bytes per weight element as stored (NVFP4: 4 bits + an E4M3 scale per 16).
BYTES_PER_WEIGHT = {"bf16": 2.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmark the mega layer against torch._grouped_mm (GPU)")
    p.add_argument(
        "--contract",
        nargs="+",
        default=list(DEFAULT_CONTRACTS),
        help=f"contracts ({', '.join(CONTRACTS)}) or geometries ({GEOMETRY_FORM}); "
        f"default: {' '.join(DEFAULT_CONTRACTS)}",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS))
    p.add_argument(
        "--backend",
        nargs="+",
        default=["auto"],
        help="one or more backends, timed on the same inputs (ratios to the first)",
    )
    p.add_argument(
        "--knobs",
        default=None,
        help="JSON knobs: one object for every backend, or a list with one entry (object or null for the "
        "defaults) per --backend entry, so one backend can be timed with several knob sets in one run",
    )
    p.add_argument("--sets", type=int, default=4, help="rotating input sets")
    p.add_argument("--iters", type=int, default=20, help="timed launches per size")
    p.add_argument("--out", default="bench-out", help="directory for CSV and plot")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check per size")
    p.add_argument(
        "--prequantized",
        action="store_true",
        help="MXFP8 / NVFP4 backends take activations already quantized (prequantized_input=True; the codes are "
        "made from the same bf16 inputs outside the timed region)",
    )
    p.add_argument(
        "--graph-max-tokens",
        type=int,
        default=128,
        help="also time the layer replayed from CUDA graphs (one per input set, as engines run decode) up "
        "to this T; 0 = never",
    )
    p.add_argument(
        "--graph-layers",
        type=int,
        default=1,
        help="capture that many layers of the backend (distinct weights, the same inputs) into each CUDA graph and "
        "report the graph time per layer, as an engine's decode graph holds every layer (the graph launch cost "
        "amortized); at every T also the per-layer time of those layers run eagerly back to back (column 'L ms': "
        "the host's path to the first launch, which a single timed call holds, paid once per L layers); reduced "
        "per contract to what fits --graph-memory-gb of extra weights",
    )
    p.add_argument("--graph-memory-gb", type=float, default=48.0, help="weight memory of the extra --graph-layers")
    p.add_argument(
        "--sustained-s",
        type=float,
        default=1.0,
        help="also measure the matmul ceiling back to back for this many seconds (the rate under the card's "
        "power limit, which long timings reach; 0 = skip); the floor and %%floor keep the short-burst ceiling",
    )
    p.add_argument(
        "--no-clocks",
        action="store_true",
        help="do not sample the SM clock and power with nvidia-smi during the timings (columns 'MHz' and 'cap')",
    )
    p.set_defaults(func=run)


def launch_times_ms(fn: Any, iters: int, sets: int, before: Any = None) -> list[float]:
    """Per-launch ms of ``iters`` launches cycling through ``sets`` input sets, after one warm-up launch
    per set (loads, allocator, caches of the first touch). ``before()`` runs ahead of every timed launch,
    outside the timed region (e.g. a barrier). CUDA events on a GPU, the host clock without one."""
    cuda = torch.cuda.is_available()
    for i in range(sets):
        fn(i)
    if cuda:
        torch.cuda.synchronize()
    times = []
    for i in range(iters):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i % sets)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i % sets)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _time_ms(fn: Any, iters: int, sets: int) -> float:
    """Median per-launch ms over ``iters`` launches cycling through ``sets`` input sets."""
    return statistics.median(launch_times_ms(fn, iters, sets))


def graph_replays(fns: list[Any], sets: int) -> Any:
    """The calls ``fns`` (one per layer, in order) on input set i captured into one CUDA graph per set,
    after warm-up eager calls (as a layer needs): a function ``i -> replay graph i``."""
    for i in range(sets):
        for fn in fns:
            fn(i)
    torch.cuda.synchronize()
    graphs = []
    for i in range(sets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                fn(i)
        graphs.append(g)
    return lambda i: graphs[i].replay()


def _graph_time_ms(fns: list[Any], iters: int, sets: int) -> float:
    """Like ``_time_ms`` for the calls ``fns`` (one per layer, in order) replayed from CUDA graphs
    (``graph_replays``: no host launch overhead inside the timed region), per layer: the replay time
    over ``len(fns)``."""
    return _time_ms(graph_replays(fns, sets), iters, sets) / len(fns)


def _eager_layers_time_ms(fns: list[Any], iters: int, sets: int) -> float:
    """Like ``_time_ms`` for the calls ``fns`` (one per layer, in order) run eagerly back to back between the
    two events, per layer: what an engine without CUDA graphs sees per layer once its host runs ahead of the
    GPU. A single timed call (``_time_ms``) starts on an idle GPU, so it also holds the host's path to the
    first kernel launch; here that is paid once per ``len(fns)`` layers."""
    return _time_ms(lambda i: [fn(i) for fn in fns], iters, sets) / len(fns)


def graph_layer_count(c: Any, fmt: str, wanted: int, memory_gb: float) -> int:
    """How many layers of contract ``c`` in format ``fmt`` one graph holds: ``wanted``, at most what fits
    ``memory_gb`` of extra weights (each extra layer holds its own weights; twice that while it is made)."""
    per_layer = c.num_experts * c.weight_bytes_per_expert(BYTES_PER_WEIGHT[fmt])
    return max(1, min(wanted, 1 + int(memory_gb * 1e9 // (2 * per_layer))))


def back_to_back_ms(fn: Any, sets: int, seconds: float) -> float:
    """Mean ms per launch of launches queued back to back (cycling through ``sets`` input sets) for about
    ``seconds``, one event pair around them all: the GPU never idles, so it runs at the clock its power
    limit allows under sustained load."""
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    n = 0
    start.record()
    while time.perf_counter() - t0 < seconds:
        fn(n % sets)
        n += 1
        if n % 64 == 0:  # keep the launch queue short: one host round trip per 64 launches
            torch.cuda.current_stream().synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def measure_ceilings(sustained_s: float = 0.0, clocks: ClockSampler | None = None) -> dict[str, Any]:
    """bf16 matmul TFLOP/s and device copy TB/s, on random data, on this GPU now: the matmul as ten
    launches one at a time (a short burst, at the card's top clock), and with ``sustained_s`` also back to
    back for that long (``matmul_sustained_tflops``: at the clock the power limit allows). With
    ``clocks``, what it sampled during each matmul timing (``matmul_clocks``, ``matmul_sustained_clocks``)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, win = timed_window(clocks, lambda: _time_ms(lambda i: a @ b, 10, 1))
    out: dict[str, Any] = {"matmul_clocks": win}
    if sustained_s > 0:
        time.sleep(0.2)  # the burst's samples stay out of the next window
        ms_b2b, win = timed_window(clocks, lambda: back_to_back_ms(lambda i: a @ b, 1, sustained_s))
        out.update(matmul_sustained_tflops=2 * n**3 / ms_b2b / 1e9, matmul_sustained_clocks=win)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda i: dst.copy_(src), 10, 1)
    return {"matmul_tflops": 2 * n**3 / ms / 1e9, "copy_tbs": 2 * src.numel() * 2 / copy_ms / 1e9, **out}


def _quantized_pack(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> tuple[Any, MoEWeightPack]:
    q = quantize_expert_weights(w13, w2, fmt)
    return q, MoEWeightPack(q.w13, q.w2, q.w13_scale, q.w2_scale, q.w13_global_scale, q.w2_global_scale)


def make_bench_layer(
    c: Any,
    entry: Any,
    w13: torch.Tensor,
    w2: torch.Tensor,
    knobs: Any,
    max_tokens: int,
    gen: torch.Generator,
    prequantized: bool = False,
) -> tuple[MoEEpLayer, Any, dict[str, Any]]:
    """The warmed-up world-size-1 layer of ``entry`` for contract ``c`` on BF16 weights (quantized for
    MXFP8 / NVFP4; NVFP4 with static activation scales calibrated on a batch drawn from ``gen``;
    ``prequantized``: a quantized layer takes pre-quantized activations). Returns (layer, quantized
    weights or None, the config's extra fields)."""
    dev = w13.device
    fmt = entry.weight_format if entry.weight_format in ("mxfp8", "nvfp4") else "bf16"
    extra: dict[str, Any] = {}
    q = None
    if fmt == "bf16":
        pack = MoEWeightPack(w13, w2)
    else:
        q, pack = _quantized_pack(w13, w2, fmt)
        if fmt == "nvfp4":
            calib = make_hidden_states(256, c.hidden_size, generator=gen).to(dev)
            gs1, gs2 = nvfp4_static_scales(calib, q, c.activation, c.activation_limit)
            extra = {"input_global_scale": gs1, "fc2_input_global_scale": gs2}
    fields = {**extra, **({"prequantized_input": True} if prequantized and fmt != "bf16" else {})}
    config = entry.load_config_class()(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit, knobs, **fields
    )
    layer = MoEEpLayer(
        BootstrapConfig(device=dev),
        FleetParams(c.num_experts, max_tokens, c.hidden_size),
        pack,
        backend=MegaConfig(config),
        check_values=False,
    )
    layer.warmup()
    return layer, q, extra


def _check_fits(c: Any, fmt: str) -> bool:
    """The quantized reference dequantizes every weight to fp32: skip it when that exceeds 16 GB."""
    return fmt == "bf16" or c.num_experts * c.weight_bytes_per_expert() * 2 <= 16e9


def norm_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius), the usual end-to-end error of a quantized layer."""
    o, r = out.double(), ref.double()
    den = r.norm().item()
    return (o - r).norm().item() / den if den else (o - r).norm().item()


def _describe_errors(row: dict[str, Any]) -> str:
    if math.isnan(row["e2e_mean_err"]):  # T = 0 or --no-check
        return "error not checked"
    text = f"e2e err mean {row['e2e_mean_err']:.1e} norm {row['e2e_norm_err']:.1e}"
    if math.isnan(row["mean_err"]):  # a quantized reference too large to build
        return text
    return f"err mean {row['mean_err']:.1e} max {row['max_err']:.1e}, " + text


def bench_contract(
    name: str,
    tokens: list[int],
    entries: list[Any],
    knobs: list[Any],
    sets: int,
    iters: int,
    check: bool,
    ceilings: dict[str, float],
    graph_max_tokens: int = 0,
    prequantized: bool = False,
    graph_layers: int = 1,
    graph_memory_gb: float = 48.0,
    clocks: ClockSampler | None = None,
) -> list[dict[str, Any]]:
    """Every backend of ``entries`` (with ``knobs[i]``) on the same inputs, one after the other (one layer
    alive at a time); the ``torch._grouped_mm`` baseline once per T. Quantized backends get the BF16 weights quantized
    (NVFP4 with static activation scales calibrated on a batch of the same distribution). With ``clocks``,
    each row holds the median SM clock sampled while ``ms`` was timed and whether the power limit held
    it down (``sm_mhz``, ``power_capped``; NaN / empty when no sample fell in that window)."""
    c = get_contract(name)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1234)  # the NVFP4 calibration batch (the same whatever --tokens lists)
    w13, w2 = make_contract_weights(c, seed=1234, device=dev)  # drawn on the GPU (deepseek-v3: 22.5 GB)
    inputs_of = {  # each T's own inputs: a T's routing is the same in runs with other --tokens lists
        t: [MoEEpTensors(*s) for s in make_token_inputs(t, c.hidden_size, c.num_experts, c.top_k, sets, seed=1234,
                                                         device=dev)]
        for t in tokens
    }  # fmt: skip
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    base_ms: dict[int, float] = {}
    first_ms: dict[int, float] = {}
    rows = []
    labels = [_label(e, k) for e, k in zip(entries, knobs, strict=True)]
    graph_tokens = [t for t in tokens if 0 < t <= graph_max_tokens]
    for entry, entry_knobs, label in zip(entries, knobs, labels, strict=True):
        fmt = entry.weight_format if entry.weight_format in ("mxfp8", "nvfp4") else "bf16"
        layer, q, extra = make_bench_layer(c, entry, w13, w2, entry_knobs, max(tokens), gen, prequantized)
        # --graph-layers: more layers of this backend on other weights (the experts rolled: other memory, so
        # nothing of one layer's weights is in L2 for the next), for the CUDA-graph timings only
        n_layers = graph_layer_count(c, fmt, graph_layers, graph_memory_gb)
        more_layers = []
        extra_gen = torch.Generator().manual_seed(4321)  # NVFP4 calibration of the extra layers
        for i in range(1, n_layers):
            w13_i, w2_i = w13.roll(i, 0), w2.roll(i, 0)
            more_layers.append(make_bench_layer(c, entry, w13_i, w2_i, entry_knobs, max(tokens), extra_gen,
                                                prequantized)[0])  # fmt: skip
            del w13_i, w2_i
        for t in tokens:
            inputs = inputs_of[t]
            # what the layer takes: the bf16 inputs, or their codes quantized before timing
            feed = [prequantized_tensors(s, layer.config) for s in inputs]
            outs = [torch.empty(t, c.hidden_size, dtype=torch.bfloat16, device=dev) for _ in range(sets)]

            def ours_fn(
                i: int, feed: list[MoEEpTensors] = feed, outs: list[torch.Tensor] = outs, layer: Any = layer
            ) -> Any:
                return layer.forward(feed[i], output=outs[i])

            def base_fn(i: int, inputs: list[MoEEpTensors] = inputs) -> Any:
                s = inputs[i]
                return grouped_mm_moe(
                    s.hidden_states, s.topk_ids, s.topk_weights, w13_t, w2_t, c.activation, c.activation_limit
                )

            ours, win = timed_window(clocks, lambda ours_fn=ours_fn: _time_ms(ours_fn, iters, sets))
            graph_ms = eager_layers_ms = float("nan")
            fns = [ours_fn] + [
                lambda i, lay=lay, feed=feed, outs=outs: lay.forward(feed[i], output=outs[i]) for lay in more_layers
            ]
            if more_layers:
                eager_layers_ms = _eager_layers_time_ms(fns, iters, sets)
            if t in graph_tokens:
                graph_ms = _graph_time_ms(fns, iters, sets)
            if t not in base_ms:
                base_ms[t] = _time_ms(base_fn, iters, sets)
            base = base_ms[t]
            first_ms.setdefault(t, ours)
            touched = sum(int(torch.unique(s.topk_ids).numel()) for s in inputs) / sets
            weight_bytes = touched * c.weight_bytes_per_expert() * BYTES_PER_WEIGHT[fmt] / 2
            flops = c.flops(t)
            floor_ms = max(flops / (ceilings["matmul_tflops"] * 1e9), weight_bytes / (ceilings["copy_tbs"] * 1e9))
            row = {
                "contract": name,
                "backend": entry.kernel_name,
                "knobs": "" if entry_knobs is None else json.dumps(entry_knobs, sort_keys=True),
                "tokens": t,
                "ms": ours,
                "graph_ms": graph_ms,
                "eager_layers_ms": eager_layers_ms,
                "graph_layers": n_layers,
                "baseline_ms": base,
                "tflops": flops / ours / 1e9,
                "weight_gbs": weight_bytes / ours / 1e6,
                "floor_ms": floor_ms,
                "pct_floor": 100 * floor_ms / ours,
                "speedup": base / ours,
                "vs_first": first_ms[t] / ours,
                "sm_mhz": win.sm_mhz_median if win else float("nan"),
                "power_capped": "" if win is None else ("yes" if win.power_capped else "no"),
                "mean_err": float("nan"),
                "max_err": float("nan"),
                "ulps": float("nan"),
                "e2e_mean_err": float("nan"),
                "e2e_norm_err": float("nan"),
            }
            if check and t:
                outs[0].fill_(float("nan"))
                layer.forward(feed[0], output=outs[0])
                s = inputs[0]  # the bf16 activations (pre-quantized inputs are their codes)
                # end to end: against the fp32 reference on the unquantized (BF16) weights
                dense, scale = moe_reference(s.hidden_states, s.topk_ids, s.topk_weights, w13, w2, c.activation,
                                             c.activation_limit, return_term_scale=True)  # fmt: skip
                row["e2e_mean_err"] = relative_errors(outs[0], dense)[0]
                row["e2e_norm_err"] = norm_relative_error(outs[0], dense)
                if q is None:
                    row["ulps"] = rounding_ulps(outs[0], dense, scale)
                    row["mean_err"], row["max_err"] = relative_errors(outs[0], dense)
                elif _check_fits(c, fmt):  # against the format-aware reference
                    ref = moe_reference_quantized(s.hidden_states, s.topk_ids, s.topk_weights, q, c.activation,
                                                  c.activation_limit, fmt=fmt, **extra)  # fmt: skip
                    row["mean_err"], row["max_err"] = relative_errors(outs[0], ref)
                del dense, scale
            rows.append(row)
            print(
                f"  {name} {label} T={t}: {ours:.3f} ms"
                + (
                    ""
                    if math.isnan(eager_layers_ms)
                    else f" ({eager_layers_ms:.3f} ms per layer of {n_layers} eager back to back"
                    + ("" if math.isnan(graph_ms) else f", {graph_ms:.3f} in a CUDA graph")
                    + ")"
                )
                + f" ({row['tflops']:.0f} TFLOP/s, "
                f"{row['pct_floor']:.0f}% of floor), baseline {base:.3f} ms, x{row['speedup']:.2f}, "
                f"x{row['vs_first']:.2f} vs {labels[0]}, "
                + _describe_errors(row)
                + ("" if win is None else f", {_clock_text(win)}"),
                flush=True,
            )
        layer.destroy()
        for lay in more_layers:
            lay.destroy()
        del q, more_layers
        torch.cuda.empty_cache()
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def prequantized_tensors(s: MoEEpTensors, config: Any) -> MoEEpTensors:
    """``s`` as a layer of ``config`` takes it: its bf16 hidden_states replaced by their codes and block
    scales where the config takes pre-quantized activations (``runtime.prequantized_inputs``)."""
    codes, scales = prequantized_inputs(config, s.hidden_states)
    return MoEEpTensors(codes, s.topk_ids, s.topk_weights, scales=scales)


def _label(entry: Any, knobs: Any) -> str:
    return entry.kernel_name if knobs is None else f"{entry.kernel_name}{json.dumps(knobs, sort_keys=True)}"


def parse_knobs(text: str | None, n: int) -> list[Any]:
    """``--knobs``: None, one JSON object for all ``n`` backends, or a list of ``n`` objects / nulls."""
    knobs = json.loads(text) if text else None
    if isinstance(knobs, list):
        if len(knobs) != n:
            raise MoEEpConfigError(f"--knobs lists {len(knobs)} entries for {n} backends")
        return knobs
    return [knobs] * n


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["contract"] for r in rows):
        rs = [r for r in rows if r["contract"] == name]
        ax.plot([r["tokens"] for r in rs], [r["pct_floor"] for r in rs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("% of roofline floor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def _clock_text(win: ClockWindow | None) -> str:
    if win is None:
        return "no clock sample"
    return f"SM {win.sm_mhz_median:.0f} MHz" + (", power-capped" if win.power_capped else "")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise MoEEpConfigError("bench needs a CUDA GPU (run it on the H200 machine; see SKILL.md)")
    dev = torch.device("cuda")
    entries = []
    for name in args.backend:
        entry, note = choose_backend(name, dev)
        if note:
            print(f"note: {note}")
        entries.append(entry)
    knobs = parse_knobs(args.knobs, len(entries))
    with contextlib.ExitStack() as stack:
        clocks = None
        if not args.no_clocks:
            clocks = stack.enter_context(ClockSampler(nvidia_smi_id(dev.index or 0), period_ms=10))
            if clocks.error:
                print(f"note: no clock samples ({clocks.error})")
                clocks = None
        ceilings = measure_ceilings(args.sustained_s, clocks)
        sustained = ""
        if "matmul_sustained_tflops" in ceilings:
            sustained = f" ({ceilings['matmul_sustained_tflops']:.0f} back to back for {args.sustained_s:g} s"
            sustained += f": {_clock_text(ceilings['matmul_sustained_clocks'])})"
        print(
            f"bench on {torch.cuda.get_device_name()}: ceilings {ceilings['matmul_tflops']:.0f} TFLOP/s bf16 matmul "
            f"({_clock_text(ceilings['matmul_clocks'])}){sustained}, {ceilings['copy_tbs']:.2f} TB/s copy; "
            f"backends {', '.join(e.kernel_name for e in entries)}",
            flush=True,
        )
        rows = []
        for name in args.contract:
            rows += bench_contract(
                name,
                args.tokens,
                entries,
                knobs,
                args.sets,
                args.iters,
                not args.no_check,
                ceilings,
                args.graph_max_tokens,
                args.prequantized,
                args.graph_layers,
                args.graph_memory_gb,
                clocks,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plotted = _plot(rows, out / "bench.png")
    print(f"\nwrote {out / 'bench.csv'}" + (f" and {out / 'bench.png'}" if plotted else " (no matplotlib: no plot)"))
    cw = max([16, *(len(r["contract"]) for r in rows)])  # geometry specs may be longer than the names
    print(
        f"\n{'contract':<{cw}} {'backend':<30} {'T':>6} {'ms':>8} {'L ms':>8} {'graph ms':>8} {'L':>2} {'TFLOP/s':>8} "
        f"{'GB/s w':>8} "
        f"{'%floor':>7} "
        f"{'base ms':>8} {'x base':>6} {'x 1st':>6} {'mean err':>8} {'max err':>8} {'e2e mean':>8} {'e2e norm':>8} "
        f"{'MHz':>5} {'cap':>3}"
    )
    for r in rows:
        print(
            f"{r['contract']:<{cw}} {r['backend']:<30} {r['tokens']:>6} {r['ms']:>8.3f} "
            + "".join(f"{'-':>8} " if math.isnan(r[k]) else f"{r[k]:>8.3f} " for k in ("eager_layers_ms", "graph_ms"))
            + f"{r['graph_layers']:>2}"
            + f" {r['tflops']:>8.0f} "
            f"{r['weight_gbs']:>8.0f} {r['pct_floor']:>6.0f}% {r['baseline_ms']:>8.3f} {r['speedup']:>6.2f} "
            f"{r['vs_first']:>6.2f} "
            + (f"{'-':>8} {'-':>8}" if math.isnan(r["mean_err"]) else f"{r['mean_err']:>8.1e} {r['max_err']:>8.1e}")
            + (
                f" {'-':>8} {'-':>8}"
                if math.isnan(r["e2e_mean_err"])
                else f" {r['e2e_mean_err']:>8.1e} {r['e2e_norm_err']:>8.1e}"
            )
            + (f" {'-':>5}" if math.isnan(r["sm_mhz"]) else f" {r['sm_mhz']:>5.0f}")
            + f" {r['power_capped'] or '-':>3}"
        )
    sys.stdout.flush()
    return 0


__all__ = ["add_parser", "measure_ceilings", "run"]
