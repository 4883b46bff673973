"""Drop lifecycle: manifest, contract audit on fixture drops derived from the real one, verbatim update,
two drops side by side in one process, CPU-safe import."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer.moe_ep.cli import main as cli_main
from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers

DROP_DIR = Path(drop.__file__).resolve().parent
SRC = drop.SRC_DIR


def _candidate(tmp_path: Path, with_scaffolding: bool = True) -> Path:
    """A copy of the real drop, laid out as the kernel team ships it (kernel packages + scaffolding)."""
    cand = tmp_path / "candidate"
    shutil.copytree(SRC, cand, ignore=shutil.ignore_patterns("__pycache__"))
    if with_scaffolding:
        for d in ("ci", "tester", "tests", "scripts"):
            (cand / d).mkdir()
            (cand / d / "__init__.py").write_text("")
            (cand / d / "run.py").write_text("print('scaffolding')\n")
        (cand / "README.md").write_text("kernel team readme\n")
    return cand


def _edit(path: Path, pattern: str, repl: str) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, repl, text)
    assert n, f"{pattern!r} not found in {path}"
    path.write_text(new)


def test_src_matches_the_recorded_manifest() -> None:
    assert drop.check_manifest() == []
    record = drop.read_vendor()
    assert record.version and record.packages and record.manifest


def test_real_drop_passes_the_contract_audit() -> None:
    assert drop.audit_src(SRC) == []


def test_renamed_helper_breaks_its_entry_and_its_importers(tmp_path: Path, capsys) -> None:
    """Renaming a helper breaks its own entry and every entry whose module imports it inside the drop
    (the quantized weight packing reuses the gate/up interleave): nothing else."""
    cand = _candidate(tmp_path)
    _edit(cand / "moe_bf16_glu" / "weights.py", r"\binterleave_gate_up\b", "interleave_gate_up_v2")
    problems = drop.audit_src(cand)
    assert [p.symbol for p in problems] == [
        "interleave_gate_up",
        "pack_quantized_weights",
        "unpack_quantized_matrix",
    ], problems
    assert "has no attribute 'interleave_gate_up'" in str(problems[0])
    assert "shim/kernel_helpers.py" in str(problems[0]) and "shim/bf16.py" in str(problems[0])
    assert "shim/quant.py" in str(problems[1])
    # the script prints exactly those breaks, and touches nothing
    before = drop.check_manifest()
    assert cli_main(["update-drop", str(cand)]) == 1
    out = capsys.readouterr().out
    assert "3 break(s)" in out and "SRC_SYMBOLS['interleave_gate_up']" in out and "not applied" in out
    assert drop.check_manifest() == before


def test_new_required_constructor_argument_is_reported(tmp_path: Path) -> None:
    cand = _candidate(tmp_path)
    _edit(
        cand / "moe_bf16_glu" / "kernel.py", r"def __init__\(\n(\s+)self,", r"def __init__(\n\1self,\n\1swizzle_mode,"
    )
    problems = drop.audit_src(cand)
    assert [p.symbol for p in problems] == ["Sm90MegaMoEBf16Kernel"]
    assert "new required parameter 'swizzle_mode'" in str(problems[0])


def test_changed_call_signature_is_reported(tmp_path: Path) -> None:
    cand = _candidate(tmp_path)
    _edit(
        cand / "moe_bf16_glu" / "kernel.py",
        r"\bh_buf: cute.Tensor,",
        "h_buf: cute.Tensor,\n        extra: cute.Tensor,",
    )
    problems = drop.audit_src(cand)
    assert len(problems) == 1 and "__call__ parameters changed" in str(problems[0])


def test_a_read_the_dsl_compiles_as_the_if_condition_is_reported(tmp_path: Path) -> None:
    """A variable named ``pred`` read inside a dynamic ``if`` of a DSL function is reported with its file and
    line (the DSL reads the if's condition there); a const_expr ``if``, a plain function and the ``if`` test
    itself are not."""
    cand = _candidate(tmp_path)
    decode = cand / "moe_bf16_glu" / "decode.py"
    before = decode.read_text()
    decode.write_text(
        before
        + """

@cute.jit
def _planted(lane, pred, out):
    if pred:  # the test: read outside the region, fine
        out[1] = 1
    if lane == 0:
        if pred:
            out[0] = 1
    if cutlass.const_expr(True):
        out[2] = pred


def _plain(lane, pred):
    if lane == 0:
        return pred
"""
    )
    line = before.count("\n") + 8
    problems = drop.audit_src(cand)
    assert [p.symbol for p in problems] == [f"moe_bf16_glu/decode.py:{line} (_planted)"], problems
    assert problems[0].kind == "dsl" and "names the if's condition 'pred'" in str(problems[0])


def test_file_edited_in_place_fails_the_manifest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    record = drop.read_vendor()
    assert drop.check_manifest(src, record) == []
    with open(src / "common" / "constants.py", "a") as f:
        f.write("# a quiet local patch\n")
    (src / "common" / "extra.py").write_text("X = 1\n")
    assert sorted(drop.check_manifest(src, record)) == [
        "added (not in the recorded drop): src/common/extra.py",
        "changed since the recorded drop: src/common/constants.py",
    ]


def test_kernel_keys_follow_the_drop_files_not_only_the_version(tmp_path: Path) -> None:
    """An edit of src/ that is not (yet) recorded as a new drop keeps the version string, but must not
    reuse a library compiled from the old files: the kernel key carries the digest of the files."""
    source_digest = drop.source_digest
    src = tmp_path / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_digest(src)
    assert before == source_digest(SRC)  # same files, same digest
    with open(src / "moe_bf16_glu" / "grouped_gemm.py", "a") as f:
        f.write("# a kernel tweak\n")
    source_digest.cache_clear()
    assert source_digest(src) != before
    fe = drop.Bf16Frontend(drop.Geometry(512, 256, 16, 4, "swiglu", None))
    key = fe.key.as_dict()
    assert key["drop_digest"] == source_digest(SRC) and key["drop_version"] == drop.read_vendor().version


def test_update_copies_kernel_packages_only(tmp_path: Path) -> None:
    compute_manifest, read_vendor = drop.vendor.compute_manifest, drop.read_vendor

    cand = _candidate(tmp_path)
    src_dir, vendor = tmp_path / "installed" / "src", tmp_path / "installed" / "VENDOR.md"
    src_dir.parent.mkdir()
    shutil.copy(drop.vendor.VENDOR_FILE, vendor)
    report = drop.update_drop(cand, version="v99", src_dir=src_dir, vendor_file=vendor)
    assert report.applied and not report.problems
    assert sorted(p.name for p in src_dir.iterdir()) == [
        "__init__.py",
        "common",
        "moe_bf16_glu",
        "moe_quant_glu",
        "src",
    ]
    assert {"ci/", "tester/", "tests/", "scripts/", "README.md"} <= set(report.skipped)
    record = read_vendor(vendor)
    assert record.version == "v99" and record.manifest == compute_manifest(src_dir)
    assert record.manifest == drop.read_vendor().manifest  # verbatim: same bytes as the real drop


def test_check_only_touches_nothing(tmp_path: Path) -> None:
    cand = _candidate(tmp_path)
    src_dir = tmp_path / "installed" / "src"
    report = drop.update_drop(cand, check_only=True, src_dir=src_dir, vendor_file=tmp_path / "V.md")
    assert not report.applied and not src_dir.exists() and not (tmp_path / "V.md").exists()


def test_two_drops_coexist_in_one_process(tmp_path: Path) -> None:
    parent = tmp_path / "otherdrops"
    parent.mkdir()
    (parent / "__init__.py").write_text("")
    shutil.copytree(DROP_DIR, parent / "megamoe_copy", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(tmp_path))
    try:
        import otherdrops.megamoe_copy as copy

        a, b = kernel_helpers, copy.kernel_helpers
        # eager and lazily-resolved helpers come from each drop's own modules
        assert a.constants is not b.constants
        assert a.constants.__name__.startswith("flashinfer.moe_ep.kernel_src.cutedsl_megamoe.src.")
        assert b.constants.__name__.startswith("otherdrops.megamoe_copy.src.")
        assert a.interleave_gate_up is not b.interleave_gate_up
        assert b.interleave_gate_up.__module__ == "otherdrops.megamoe_copy.src.moe_bf16_glu.weights"
        geometry = copy.Geometry(256, 128, 4, 2, "swiglu", None)
        specs = copy.Bf16Frontend(geometry).workspace_spec(16)  # imports host_utils lazily, at call time
        assert type(specs[0]).__module__ == "otherdrops.megamoe_copy.src.common.host_utils"
        for generic in ("common", "src", "moe_bf16_glu", "shim"):
            assert generic not in sys.modules, f"a generic top-level module {generic!r} leaked"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("otherdrops")]:
            del sys.modules[name]


def test_importing_the_drop_is_cpu_safe() -> None:
    code = (
        "import sys\nimport flashinfer.moe_ep.kernel_src.cutedsl_megamoe as d\n"
        "d.kernel_helpers.constants; d.kernel_helpers.interleave_gate_up\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cutlass', 'tvm_ffi', 'nvshmem')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", sorted(kernel_helpers.SRC_SYMBOLS))
def test_every_declared_symbol_resolves(name: str) -> None:
    assert getattr(kernel_helpers, name) is not None


def test_two_drops_builds_of_one_variant_pair_up(tmp_path: Path) -> None:
    """``kernel_cache.index_by_variant``: libraries of two drops' caches pair by everything but the drop
    version and digest (what ``scripts/drop_ab.py`` and ``scripts/drop_sass_diff.py`` compare); another
    knob value is another variant, and an incomplete entry (no library) is not listed."""
    kc = drop.kernel_cache

    def key(version: str, tile_m: int) -> object:
        return kc.KernelKey("moe_bf16_glu", version, "4.8.1", "sm_90a", {"hidden": 256}, {"tile_m": tile_m}, version)

    def fake_build(out: Path, function: str) -> Path:
        (out / f"lib{function}.so").write_bytes(b"not a real library")
        return out / f"lib{function}.so"

    old, new = tmp_path / "old", tmp_path / "new"
    for tile_m in (64, 128):
        kc.store(key("v1", tile_m), fake_build, old)
    kc.store(key("v2", 64), fake_build, new)
    kc.store(key("v2", 256), fake_build, new)
    (kc.entry_dir(key("v2", 128), new)).mkdir()  # a builder that died before publishing anything
    ours, theirs = kc.index_by_variant(new), kc.index_by_variant(old)
    assert len(ours) == 2 and len(theirs) == 2
    paired = [ident for ident in ours if ident in theirs]
    assert paired == [kc.variant_identity(key("v2", 64).as_dict())]
    assert ours[paired[0]][0] == kc.lib_path(key("v2", 64), new)
    assert theirs[paired[0]] == (kc.lib_path(key("v1", 64), old), key("v1", 64).function_name)
