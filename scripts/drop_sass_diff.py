#!/usr/bin/env python3
"""Two drops' builds of the same kernel variants, compared instruction by instruction (CPU only).

For a kernel maintainer's refactoring drop: is the machine code what the drop before produced? Every
library of ``--cache`` (this drop) is paired with the library of ``--other`` (a kernel cache built from
another drop checkout) whose key equals its key in all but the drop version and source digest; the
kernels of each pair are matched by name and launch order and their SASS compared (``cuobjdump -sass``
with ``nvdisasm``: a CUDA toolkit, or the ``nvidia-cuda-nvdisasm`` and ``nvidia-cuda-cuobjdump``
wheels). Identical SASS means the kernels compute alike, results and timing, so a refactor of kernel
code is shown exact without a device run; a kernel that differs needs ``scripts/drop_ab.py`` on a GPU.
The host side of a library (grids, kernel arguments, TMA descriptors) is not compared. A drop that adds
a knob changes every key of its kernel family: ``--new-knob NAME=VALUE`` (JSON value) pairs this drop's
variants at that value with the other drop's, which lack the knob. Exit 0 when every paired kernel is
identical, 1 otherwise (or when nothing pairs).

    git worktree add /tmp/old <rev> && (cd /tmp/old && CUTE_DSL_ARCH=sm_90a python -m flashinfer.moe_ep
        build --backend ... --contract tiny --cache /work/main/.kcache-old)     (and the same here)
    python scripts/drop_sass_diff.py --cache .kcache --other .kcache-old
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer.moe_ep.kernel_src.cutedsl_megamoe.shim import kernel_cache, kernel_resources


def _without(index: dict[str, tuple[Path, str]], new_knobs: dict[str, object]) -> dict[str, tuple[Path, str]]:
    """``index`` keyed as the other drop keys it: the new knobs dropped where they hold the given value."""
    out = {}
    for ident, entry in index.items():
        key = json.loads(ident)
        if all(key["knobs"].get(k, v) == v for k, v in new_knobs.items()):
            key["knobs"] = {k: v for k, v in key["knobs"].items() if k not in new_knobs}
        out[kernel_cache.variant_identity(key)] = entry
    return out


def _label(identity: str) -> str:
    key = json.loads(identity)
    knobs = ",".join(f"{k}={v}" for k, v in key["knobs"].items())
    geometry = ",".join(f"{k}={v}" for k, v in key["geometry"].items() if v is not None)
    return f"{key['kernel']} [{geometry}] [{knobs}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = f"this drop's kernel cache (default: ${kernel_cache.CACHE_ENV})"
    p.add_argument("--cache", type=Path, default=None, help=default)
    p.add_argument("--other", type=Path, required=True, help="kernel cache built from the other drop")
    p.add_argument("--verbose", action="store_true", help="one line per kernel, identical ones too")
    p.add_argument("--new-knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a knob this drop added, at the value that reproduces the other drop (JSON value)")  # fmt: skip
    args = p.parse_args()
    new_knobs = {}
    for item in args.new_knob:
        name, _, value = item.partition("=")
        new_knobs[name] = json.loads(value)
    ours = _without(kernel_cache.index_by_variant(args.cache or kernel_cache.cache_root()), new_knobs)
    theirs = kernel_cache.index_by_variant(args.other)
    paired = [ident for ident in ours if ident in theirs]
    print(f"{len(ours)} libraries here, {len(theirs)} in --other, {len(paired)} variants in both")
    kernels = differ = 0
    for n, ident in enumerate(paired, 1):
        rows = kernel_resources.compare_sass(ours[ident][0], theirs[ident][0])
        kernels += len(rows)
        changed = [r for r in rows if r.verdict != "identical"]
        differ += len(changed)
        state = "identical" if not changed else f"{len(changed)} of {len(rows)} kernel(s) differ"
        print(f"[{n}/{len(paired)}] {_label(ident)}: {state}", flush=True)
        for r in rows if args.verbose else changed:
            print(f"    {r.name:36s} {r.count_a:6d} / {r.count_b:6d} instructions  {r.verdict}")
    for ident in ours:
        if ident not in theirs:
            print(f"not in --other: {_label(ident)}")
    print(f"\n{len(paired)} variant(s), {kernels} kernel(s): {kernels - differ} identical, {differ} differ")
    return 0 if paired and not differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
