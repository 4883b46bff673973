"""AOT kernel cache on the CPU: every default variant compiles and exports for sm_90a; cache keys,
atomic publishing under concurrent builders, and the error when neither cache nor compiler is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer.moe_ep.backends.mega.kernel.sm90.bf16_bf16_bf16_cutedsl.backend import make_frontend
from flashinfer.moe_ep.cli import main as cli_main
from flashinfer.moe_ep.core.contracts import CONTRACTS
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import frontend as frontend_mod
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_cache, kernel_resources

from .sass import pdl_order, wgmma_batches

pytestmark = pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")


def _frontend(name: str = "tiny", **knobs):
    import flashinfer.moe_ep as moe

    c = CONTRACTS[name]
    cfg = moe.Sm90_Bf16_Bf16_Bf16_Cutedsl_MegaMoeConfig(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit, knobs or None
    )
    return make_frontend(cfg, c.num_experts)


def test_build_every_default_variant_for_sm90a(tmp_path: Path, capsys) -> None:
    """Every contract, every token bucket's default kernel (what a server with the defaults loads); with
    cuobjdump (the test extras) also that no kernel of them spills registers (``build --resources``)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    audit = ["--resources"] if kernel_resources.find_cuobjdump() else []
    assert cli_main(["build", "--contract", "all", "--cache", str(tmp_path), *audit]) == 0
    out = capsys.readouterr().out
    assert not audit or "resources: no kernel spills" in out
    keys = kernel_cache.entries(tmp_path)
    assert f"build: {len(keys)} kernel(s)" in out and f"[{len(keys)}/{len(keys)}]" in out
    assert len(keys) >= len(CONTRACTS)
    for name in CONTRACTS:
        lib = kernel_cache.lookup(_frontend(name).key, tmp_path)  # the prefill (primary) kernel
        assert lib is not None and lib.stat().st_size > 10_000
        assert b"__tvm_ffi_" in lib.read_bytes()  # the exported TVM-FFI symbol


def test_both_fc1_row_sources_compile_under_their_own_keys(tmp_path: Path) -> None:
    """``gather_in_fc1`` (drop v18): FC1 loading its rows from x (the default: a row-map kernel, no
    copy) and the separate gather kernel are two libraries under two keys; the knob reaches the kernel."""
    on, off = _frontend(gather_in_fc1=True), _frontend(gather_in_fc1=False)
    assert on.knobs.gather_in_fc1 and not off.knobs.gather_in_fc1
    assert on.key.digest() != off.key.digest()
    blobs = [fe.build(tmp_path).read_bytes() for fe in (on, off)]
    assert all(b"__tvm_ffi_" in blob for blob in blobs)
    assert b"row_map_kernel" in blobs[0] and b"gather_kernel" not in blobs[0]
    assert b"gather_kernel" in blobs[1] and b"row_map_kernel" not in blobs[1]


@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_fc2_loads_its_first_weights_before_waiting_for_fc1(tmp_path: Path) -> None:
    """``fc2_early_weights`` (drop v34, the default): FC2 issues its weight loads (one TMA) before its
    ``griddepcontrol.wait`` and FC1 lets it launch only after its own wait (it reads the routing's block
    map early). Off, or with clusters (where it has no effect), both GEMMs trigger first and load after."""
    orders = {}
    for name, knobs in (("on", {"tile_m": 64}), ("off", {"tile_m": 64, "fc2_early_weights": False}),
                        ("clusters", {"cluster_m": 2})):  # fmt: skip
        fe = _frontend(**knobs)
        sass = kernel_resources.kernel_sass(fe.build(tmp_path / name))
        orders[name] = [pdl_order(code) for kernel, code in sass.items() if "GroupedGemm" in kernel]
    assert orders["on"] == [(0, False), (1, True)]
    assert orders["off"] == orders["clusters"] == [(0, True), (0, True)]


@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_grouped_gemms_keep_a_wgmma_batch_in_flight(tmp_path: Path) -> None:
    """Drop v47: the padding branch holds the whole K loop, so no GEMM closes its batches with an empty one
    (drops <= v46: `if active:` around the WGMMAs inside the loop made every ``wait_group(1)`` wait for the
    batch just issued). ``mma_overlap`` on (the default) waits with one batch pending; off, with none."""
    cases = (({"tile_m": 64}, True), ({"cluster_m": 2}, True), ({"mma_overlap": False}, False))
    for i, (knobs, in_flight) in enumerate(cases):
        sass = kernel_resources.kernel_sass(_frontend(**knobs).build(tmp_path / str(i)))
        for kernel, code in sass.items():
            if "GroupedGemm" in kernel:
                b = wgmma_batches(code)
                assert b["hgmma"] > 0 and b["empty"] == 0, (knobs, kernel, b)
                assert (b["in_flight"] > 0) == in_flight, (knobs, kernel, b)


@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_decode_fused_is_one_kernel_with_a_grid_barrier_and_no_spills(tmp_path: Path) -> None:
    """``decode_fused`` (drop v37): the library holds the fused kernel alone (no routing, GEMM or combine
    kernel), whose machine code has the grid barrier's atomics, ``cp.async`` copies, ``mma.sync``, no
    register spill."""
    fe = _frontend("qwen3-30b-a3b", tile_m=64, decode_fused=True, decode_warps=8, decode_stages=6)
    lib = fe.build(tmp_path)
    sass = kernel_resources.kernel_sass(lib)
    assert [k.split("#")[0] for k in sass] == ["FusedDecodeSm90"], list(sass)
    code = next(iter(sass.values()))
    assert sum("ATOMG" in line for line in code) == 1  # the leave count (its reply names the last CTA out)
    assert sum("REDG.E.ADD" in line for line in code) == 1  # the arrive count (no reply awaited)
    assert any("LDGSTS" in line for line in code) and any("HMMA.16816.F32.BF16" in line for line in code)
    assert all(r.spill_bytes == 0 for r in kernel_resources.kernel_resources(lib))


@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_pair_blocks_drops_the_routing_kernels(tmp_path: Path) -> None:
    """``pair_blocks`` (session 27 candidate): the library holds FC1, FC2 and the combine only (no routing or
    row-map kernel), no spill; the GEMMs read ``topk_ids`` instead of a block map."""
    lib = _frontend("qwen3-30b-a3b", tile_m=64, fc1_split_n=True, pair_blocks=True).build(tmp_path)
    names = [k.split("#")[0] for k in kernel_resources.kernel_sass(lib)]
    assert names == ["GroupedGemmSm90", "GroupedGemmSm90", "combine_kernel"], names
    assert all(r.spill_bytes == 0 for r in kernel_resources.kernel_resources(lib) if "Grouped" in r.name)


@pytest.mark.skipif(kernel_resources.find_cuobjdump() is None, reason="needs cuobjdump (pip install .[test])")
def test_pair_combine_leaves_two_kernels(tmp_path: Path) -> None:
    """``pair_combine`` (drop v44): FC1 and FC2 only (FC2 combines), no spill; FC2 counts arrivals with one
    reply-awaited atomic (the last arrival sums)."""
    lib = _frontend("qwen3-30b-a3b", tile_m=64, fc1_split_n=True, pair_blocks=True, pair_combine=True).build(tmp_path)
    sass = kernel_resources.kernel_sass(lib)
    assert [k.split("#")[0] for k in sass] == ["GroupedGemmSm90", "GroupedGemmSm90"], list(sass)
    fc2 = sass[list(sass)[1]]
    assert sum("ATOMG" in line for line in fc2) == 1, [ln for ln in fc2 if "ATOM" in ln]
    assert all(r.spill_bytes == 0 for r in kernel_resources.kernel_resources(lib))


def test_key_covers_versions_geometry_and_knobs(tmp_path: Path, monkeypatch) -> None:
    base = _frontend()
    assert base.key.digest() != _frontend(tile_m=64).key.digest()
    assert base.key.digest() != _frontend("qwen3-30b-a3b").key.digest()
    lib = base.build(tmp_path)
    assert kernel_cache.lookup(base.key, tmp_path) == lib
    record = drop.read_vendor()
    for field, value in (("version", "v999"), ("dsl_version", "9.9.9")):
        changed = type(record)(**{**record.__dict__, field: value})
        monkeypatch.setattr(frontend_mod, "read_vendor", lambda changed=changed: changed)
        assert kernel_cache.lookup(_frontend().key, tmp_path) is None, f"a cache hit across a {field} change"


def test_missing_kernel_without_compiler_names_the_build_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(frontend_mod, "dsl_available", lambda: False)
    with pytest.raises(drop.KernelUnavailableError, match="python -m flashinfer.moe_ep build --arch sm_90a"):
        _frontend().load(tmp_path)


BUILD_ONE = """
import sys
from tests.backends.mega.kernel.sm90.test_bf16_build import _frontend
print(_frontend().build(__import__('pathlib').Path(sys.argv[1]), force=True))
"""


def test_concurrent_builders_publish_one_complete_entry(tmp_path: Path) -> None:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(Path(__file__).resolve().parents[5])}
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_ONE, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1  # both return the one published library
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]
    assert json.loads((entries[0] / "key.json").read_text()) == _frontend().key.as_dict()
