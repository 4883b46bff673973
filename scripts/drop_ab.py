#!/usr/bin/env python3
"""A layer on this drop against the same layer on another drop's kernels or with other knobs, in one run.

For a kernel maintainer's new drop: are its kernels faster, and (for a change meant to be exact) are
its outputs bit for bit those of the drop before? Two layers are built alike (same contract, backend,
weights, NVFP4 calibration, knobs); the second one loads, for every kernel it needs, the library of
``--other`` (a kernel cache built from another drop checkout) whose key equals this drop's key in all
but the drop version and source digest. ``--other-knobs`` instead (or as well) gives the second layer
other knobs (a knob A/B on one drop: every knob is output-neutral, so the outputs must stay bitwise
equal; several ``--other-knobs`` build one layer each, all timed against the first in the same
rounds). A drop that changes the packed weight layout needs ``--other-src`` as well: the other drop's
``src/`` directory, whose weight packing then prepares the second layer's weights, so each layer runs
on its own layout (and an exact change still gives bitwise equal outputs). Then, per T: both outputs
on the same inputs (``bitwise`` or the largest difference), and the median ms of each, timed
interleaved in rounds over rotating inputs so that clock drift reaches both alike (``--graph``: each
call replayed from a CUDA graph, the GPU's time without the host's launch path). World size 1;
random weights and inputs, never zeros. The table's ``other/ours`` is the other layer's time over ours: above 1
the other is slower. ``--graph`` replays one layer a graph, so part of its weights can stay in L2 from one replay
to the next; for a decode decision confirm with the bench's graphs of 8 layers on distinct weights, one backend
twice in one run (``bench --backend X X --knobs '[null, {...}]' --graph-layers 8``): in session 40 the two
disagreed once (MXFP8 qwen3-30b-a3b T = 1). GPU machine:

    here:  git worktree add /tmp/old <rev> && (cd /tmp/old && CUTE_DSL_ARCH=sm_90a python -m flashinfer.moe_ep
           build --backend ... --contract ... --cache /work/main/.kcache-old)   (and this drop's cache)
    there: source .gpu/env.sh && FLASHINFER_MOE_EP_KERNEL_CACHE=.kcache python scripts/drop_ab.py \\
           --other .kcache-old --contract qwen3-30b-a3b --backend sm90_nvfp4_nvfp4_bf16_cutedsl --tokens 4096
    or:    ... python scripts/drop_ab.py --other-knobs '{"tile_m": 16, "swap_ab": true, "swap_atoms": 2}' ...
    or, per token bucket: ``--bucket-overrides '{"swap_wg": 4, "swap_atoms": 1}'``: at each T, the knobs
           that serve T (``frontend_for``) against the same knobs with these changed (explicit knobs, a
           layer per bucket and change); build them here first with ``python -m flashinfer.moe_ep build
           ... --bucket-overrides <the same JSON>``
    layout: mkdir .drop-old && git archive <rev> flashinfer/moe_ep/kernel_src/cutedsl_megamoe/src | tar -x
           -C .drop-old --strip-components 4, then add --other-src .drop-old/src (carry it to the GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.cli.backends import choose_backend
from flashinfer.moe_ep.cli.bench import graph_replays, launch_times_ms, make_bench_layer
from flashinfer.moe_ep.core.contracts import get_contract
from flashinfer.moe_ep.core.inputs import make_contract_weights, make_token_inputs
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.shim import frontend, kernel_cache
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.shim import kernel_helpers as kh


class OtherDropLoader:
    """While active, every frontend loads its kernel from the other drop's cache (no compile) and, with
    ``pack`` (``other_packer``), the shim packs block-scaled weights with the other drop's function."""

    def __init__(self, other: dict[str, tuple[Path, str]], pack: Any = None) -> None:
        self.other, self.pack, self.loaded = other, pack, []
        self.saved = frontend.KernelFrontend.load
        #: every knob name the other drop's libraries have (``identity`` leaves out newer ones at their defaults)
        self.their_knobs = {name for ident in other for name in json.loads(ident)["knobs"]}

    def identity(self, fe: Any) -> str:
        """``fe``'s variant as the other drop names it: a knob the other drop does not have (added since)
        is left out when it is at its default, which is the other drop's behaviour; at another value the
        other drop has no such variant."""
        key, theirs = fe.key.as_dict(), self.their_knobs
        defaults = (
            {f.name: f.default for f in dataclasses.fields(fe.knobs)} if dataclasses.is_dataclass(fe.knobs) else {}
        )
        key["knobs"] = {
            k: v for k, v in key["knobs"].items() if not (theirs and k not in theirs and v == defaults.get(k))
        }
        return kernel_cache.variant_identity(key)

    def __enter__(self) -> OtherDropLoader:
        loader = self

        def load(fe: Any, root: Path | None = None, *, allow_compile: bool = True) -> Any:
            if fe._fn is None:
                ident = loader.identity(fe)
                if ident not in loader.other:
                    raise SystemExit(f"--other has no library for {ident}: build it from the other checkout")
                lib, fn = loader.other[ident]
                fe._fn = kernel_cache.load_function(lib, fn)
                loader.loaded.append(lib.parent.name)
            return fe._fn

        frontend.KernelFrontend.load = load
        if self.pack is not None:
            kh.pack_quantized_weights = self.pack  # read by the shim at call time
        return self

    def __exit__(self, *exc: object) -> None:
        frontend.KernelFrontend.load = self.saved
        if self.pack is not None:
            del kh.pack_quantized_weights  # back to the lazy lookup of this drop's function


def other_packer(src: Path) -> Any:
    """``pack_quantized_weights`` of the drop whose ``src/`` directory is ``src`` (imported as a package
    of its own: its weight packing is torch only)."""
    init = src / "__init__.py"
    if not (src / "moe_quant_glu" / "weights.py").is_file() or not init.is_file():
        raise SystemExit(f"--other-src {src}: not a drop src/ directory (no __init__.py, moe_quant_glu/weights.py)")
    spec = importlib.util.spec_from_file_location("other_drop_src", init, submodule_search_locations=[str(src)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["other_drop_src"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("other_drop_src.moe_quant_glu.weights").pack_quantized_weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", type=Path, default=None, help="kernel cache built from the other drop")
    p.add_argument("--other-knobs", nargs="+", default=None,
                   help="JSON knobs of the second layer (default: --knobs); several: one layer each, "
                        "every one timed against ours in the same rounds")  # fmt: skip
    p.add_argument("--bucket-overrides", nargs="+", default=None, metavar="JSON",
                   help="at each T, the serving bucket's knobs against those knobs with these changes (one layer "
                        "per bucket and change); build them first: build --bucket-overrides")  # fmt: skip
    p.add_argument("--other-src", type=Path, default=None,
                   help="the other drop's src/ directory: its weight packing prepares the second layer")  # fmt: skip
    p.add_argument("--contract", nargs="+", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--tokens", type=int, nargs="+", required=True)
    p.add_argument("--knobs", default=None, help="JSON knobs for the backend config (default: the defaults)")
    p.add_argument("--sets", type=int, default=3, help="rotating input sets")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds of --iters launches per layer")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--graph", action="store_true",
                   help="time each call replayed from a CUDA graph (one per input set): the GPU's time without "
                        "the host's launch path, which a lone call at T <= 4 is bound by")  # fmt: skip
    args = p.parse_args()
    dev = torch.device("cuda")
    entry, _ = choose_backend(args.backend, dev)
    if args.bucket_overrides is not None and (args.other is not None or args.other_knobs is not None):
        p.error("--bucket-overrides is a knob A/B of its own (not with --other or --other-knobs)")
    if args.other is None and args.other_knobs is None and args.bucket_overrides is None:
        p.error("give --other (another drop's kernel cache), --other-knobs (or both), or --bucket-overrides")
    changes = [json.loads(k) for k in args.bucket_overrides or []]
    knobs = json.loads(args.knobs) if args.knobs else None
    candidates = [json.loads(k) for k in args.other_knobs] if args.other_knobs else [knobs]
    if args.other is not None and len(candidates) > 1:
        p.error("--other takes one set of --other-knobs")
    other = kernel_cache.index_by_variant(args.other) if args.other else None
    if args.other_src is not None and other is None:
        p.error("--other-src goes with --other (the kernels built from that drop)")
    pack = other_packer(args.other_src) if args.other_src is not None else None
    if other is not None:
        print(f"--other {args.other}: {len(other)} libraries")
    what = " and ".join(
        ([f"drop of {args.other}"] if other is not None else [])
        + ([f"knobs {' / '.join(map(str, candidates))}"] if args.other_knobs else [])
        + ([f"bucket's knobs with {' / '.join(map(json.dumps, changes))}"] if changes else [])
    )
    rows = []
    for name in args.contract:
        c = get_contract(name)
        w13, w2 = make_contract_weights(c, seed=7, device=dev)
        # the same calibration batch for both layers: one generator each, seeded alike
        cap = max(args.tokens)
        layers = {"ours": make_bench_layer(c, entry, w13, w2, knobs, cap, torch.Generator().manual_seed(7))[0]}
        by_knobs: dict[str, Any] = {}  # --bucket-overrides: one layer per explicit knob set
        for i, cand in enumerate(candidates if not changes else []):
            lab = "theirs" if len(candidates) == 1 else f"k{i + 1}"
            with OtherDropLoader(other, pack) if other is not None else contextlib.nullcontext() as loader:
                layers[lab] = make_bench_layer(c, entry, w13, w2, cand, cap, torch.Generator().manual_seed(7))[0]
            if loader is not None:
                if not loader.loaded:
                    raise SystemExit("the other layer loaded no kernel while it was built: nothing to compare")
                print(f"{name}: the other drop's layer runs {len(set(loader.loaded))} of its libraries")
        for t in args.tokens:
            at = layers  # the layers timed at T: ours and the others, or ours and its bucket's knob changes
            if changes:
                serving = dataclasses.asdict(layers["ours"].backend.frontend_for(t).knobs)
                print(f"  {name} T={t}: bucket knobs {json.dumps(serving)}", flush=True)
                at = {"ours": layers["ours"]}
                for i, change in enumerate(changes):
                    text = json.dumps({**serving, **change}, sort_keys=True)
                    if text not in by_knobs:  # calibrated like the others (seed 7)
                        print(
                            f"  {name} T={t}: building k{i + 1} = the bucket's knobs with {json.dumps(change)}",
                            flush=True,
                        )  # a fault in its warmup then names it
                        calib = torch.Generator().manual_seed(7)
                        by_knobs[text] = make_bench_layer(c, entry, w13, w2, json.loads(text), cap, calib)[0]
                    at[f"k{i + 1}"] = by_knobs[text]
            # each T's own inputs (core.inputs.make_token_inputs): the same whatever other T this run times
            feed = [moe.MoEEpTensors(*s) for s in make_token_inputs(
                t, c.hidden_size, c.num_experts, c.top_k, args.sets, seed=11, device=dev)]  # fmt: skip
            outs = {lab: [torch.full((t, c.hidden_size), float("nan"), dtype=torch.bfloat16, device=dev)
                          for _ in feed] for lab in at}  # fmt: skip
            for lab, layer in at.items():
                for i, s in enumerate(feed):
                    layer.forward(s, output=outs[lab][i])
            torch.cuda.synchronize()
            calls = {}
            for lab, layer in at.items():

                def fn(i: int, layer: Any = layer, feed: list = feed, out: list = outs[lab]) -> Any:
                    return layer.forward(feed[i], output=out[i])

                calls[lab] = graph_replays([fn], args.sets) if args.graph else fn
            times: dict[str, list[float]] = {lab: [] for lab in at}
            for _ in range(args.rounds):
                for lab in at:
                    times[lab] += launch_times_ms(calls[lab], args.iters, args.sets)
            ms = {lab: statistics.median(v) for lab, v in times.items()}
            for lab in list(at)[1:]:
                diff = max(float((a.float() - b.float()).abs().max()) if t else 0.0
                           for a, b in zip(outs["ours"], outs[lab], strict=True))  # fmt: skip
                same = all(torch.equal(a, b) for a, b in zip(outs["ours"], outs[lab], strict=True))
                rows.append((name, t, lab, ms["ours"], ms[lab], ms[lab] / ms["ours"], same, diff))
                verdict = "bitwise equal" if same else f"differ (max {diff:.3g})"
                print(f"  {name} T={t} {lab}: ours {ms['ours']:.4f} ms, other {ms[lab]:.4f} ms, "
                      f"other/ours {ms[lab] / ms['ours']:.3f} ({_verdict(ms[lab] / ms['ours'])}), "
                      f"outputs {verdict}", flush=True)  # fmt: skip
        for layer in [*layers.values(), *by_knobs.values()]:
            layer.destroy()
        del w13, w2
        torch.cuda.empty_cache()
    how = "graph replays" if args.graph else "launches"
    print(f"\n{args.backend}: ours against the {what}, median ms ({args.rounds} x {args.iters} interleaved {how})")
    if changes:
        print("\n".join(f"k{i + 1} = the bucket's knobs with {json.dumps(k)}" for i, k in enumerate(changes)))
    elif len(candidates) > 1:
        print("\n".join(f"k{i + 1} = {json.dumps(k)}" for i, k in enumerate(candidates)))
    # other/ours is the other layer's time over ours: above 1 the other is slower
    print(f"{'contract':16s} {'T':>6s} {'other':>6s} {'ours':>9s} {'other':>9s} {'other/ours':>10s} "
          f"{'the other is':>16s}  outputs")  # fmt: skip
    for name, t, lab, a, b, r, same, diff in rows:
        print(f"{name:16s} {t:6d} {lab:>6s} {a:9.4f} {b:9.4f} {r:10.3f} {_verdict(r):>16s}  "
              f"{'bitwise' if same else f'max diff {diff:.3g}'}")  # fmt: skip
    return 0 if all(r[6] for r in rows) else 1


def _verdict(ratio: float) -> str:
    """The other layer against ours from ``ratio`` = other time / our time, in words (session 39 read the bare
    ratio the wrong way round)."""
    if abs(ratio - 1.0) < 0.0005:
        return "as fast"
    return f"{abs(ratio - 1.0) * 100:.1f} % {'slower' if ratio > 1.0 else 'faster'}"


if __name__ == "__main__":
    sys.exit(main())
