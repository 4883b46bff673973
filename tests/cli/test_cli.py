import importlib.metadata as md
import json

import pytest
import torch

from flashinfer.moe_ep.cli import doctor, main


def test_demo_runs_and_checks(capsys) -> None:
    assert main(["demo", "--tokens", "0", "1", "9", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "backend reference" in out and "all sizes match" in out
    assert out.count(" ok") >= 3


def test_demo_world_size_two(capsys) -> None:
    assert main(["demo", "--world-size", "2", "--tokens", "0", "5", "--iters", "1", "--routing", "skewed"]) == 0
    assert "world 2" in capsys.readouterr().out


def test_demo_refuses_huge_cpu_contract(capsys) -> None:
    assert main(["demo", "--contract", "deepseek-v3", "--device", "cpu"]) == 2
    assert "--experts" in capsys.readouterr().err


def test_demo_unknown_backend(capsys) -> None:
    assert main(["demo", "--backend", "nope"]) == 2
    assert "unknown backend" in capsys.readouterr().err


def test_doctor_reports_backends(capsys) -> None:
    main(["doctor"])
    out = capsys.readouterr().out
    assert "torch" in out and "reference" in out and "can run" in out


def test_doctor_detects_upstream_flashinfer(monkeypatch) -> None:
    real = md.version

    def fake(name: str) -> str:
        if name == "flashinfer-python":
            return "0.7.2"
        return real(name)

    monkeypatch.setattr(doctor.md, "version", fake)
    problems = doctor.namespace_conflicts()
    assert any("flashinfer-python 0.7.2" in p and "uninstall" in p for p in problems)


def test_bad_subcommand() -> None:
    with pytest.raises(SystemExit):
        main(["nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize("how", ["torchrun", "loopback"])
def test_tune_of_the_ep_kernel_needs_the_gpu(monkeypatch, capsys, how: str) -> None:
    """EP tuning (torchrun ranks or loopback ranks) times kernels: without an SM90 GPU it says what is missing."""
    args = ["tune", "--contract", "tiny"]
    if how == "torchrun":
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    else:
        args += ["--loopback", "2"]
    assert main(args) == 2
    assert "tune times kernels on the GPU" in capsys.readouterr().err


def test_bench_knob_lists_and_prequantized_inputs() -> None:
    from flashinfer.moe_ep.cli.bench import parse_knobs, prequantized_tensors
    from flashinfer.moe_ep.errors import MoEEpConfigError

    assert parse_knobs(None, 2) == [None, None]
    assert parse_knobs('{"tile_m": 64}', 2) == [{"tile_m": 64}] * 2
    assert parse_knobs('[null, {"tile_m": 64}]', 2) == [None, {"tile_m": 64}]
    with pytest.raises(MoEEpConfigError, match="lists 1 entries for 2 backends"):
        parse_knobs("[null]", 2)
    import flashinfer.moe_ep as moe

    s = moe.MoEEpTensors(torch.randn(3, 64).bfloat16(), torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 2))
    cfg = moe.Sm90_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(64, 64, 2, 2, prequantized_input=True)
    q = prequantized_tensors(s, cfg)
    assert q.hidden_states.shape == (3, 32) and q.scales.shape == (3, 4) and q.topk_ids is s.topk_ids


def test_bench_graph_layers_fit_the_memory_budget() -> None:
    """--graph-layers: as many layers as asked, fewer where their weights exceed the budget, never none."""
    from flashinfer.moe_ep.cli.bench import graph_layer_count
    from flashinfer.moe_ep.core.contracts import get_contract

    q30, ds = get_contract("qwen3-30b-a3b"), get_contract("deepseek-v3")
    assert graph_layer_count(q30, "bf16", 8, 48.0) == 8  # 1.2 GB of weights per layer
    assert graph_layer_count(q30, "bf16", 1, 48.0) == 1
    assert graph_layer_count(ds, "bf16", 8, 48.0) == 2  # 22.5 GB per layer: one extra (twice that while made)
    assert graph_layer_count(ds, "nvfp4", 8, 48.0) > graph_layer_count(ds, "bf16", 8, 48.0)
    assert graph_layer_count(ds, "bf16", 8, 0.0) == 1


def test_bench_eager_layers_run_back_to_back_and_report_per_layer(monkeypatch) -> None:
    """``L ms``: every timed launch runs the L layers in order on the same input set, and the time is per
    layer (the host clock stands in for CUDA events on a machine without a GPU)."""
    from flashinfer.moe_ep.cli import bench

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    calls = []
    fns = [lambda i, n=n: calls.append((n, i)) for n in range(3)]
    clock = iter(range(0, 1000, 6))  # each timed launch takes 6 ms on this fake clock
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock) / 1e3)
    ms = bench._eager_layers_time_ms(fns, iters=4, sets=2)
    assert ms == pytest.approx(2.0)  # 6 ms for three layers
    warmup, timed = calls[:6], calls[6:]
    assert warmup == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert timed == [(n, i % 2) for i in range(4) for n in range(3)]


@pytest.mark.parametrize("backend", ["sm90_bf16_bf16_bf16_cutedsl", "sm90_nvfp4_nvfp4_bf16_cutedsl"])
def test_build_bucket_overrides_adds_each_buckets_changed_knobs(backend: str, monkeypatch, capsys) -> None:
    """``build --bucket-overrides``: every token bucket's kernel and, per JSON, the same kernel with those
    knobs changed (``KernelFrontend.with_knobs``: same family and geometry); a change a bucket cannot take
    is reported and left out; an unknown knob, bad JSON or world size > 1 is an error. No compile: the
    frontends' ``build`` is recorded."""
    from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

    built: list[drop.frontend.KernelFrontend] = []
    monkeypatch.setattr(
        drop.frontend.KernelFrontend, "build", lambda self, root=None, force=False: built.append(self) or "lib"
    )
    monkeypatch.setenv("FLASHINFER_MOE_EP_KNOB_CACHE", "off")
    shape = ["--backend", backend, "--hidden", "256", "--intermediate", "128", "--experts", "16", "--top-k", "4"]
    bf16 = backend.startswith("sm90_bf16")
    change = {"fc2_tile_n": 64} if bf16 else {"swap_wg": 4, "swap_atoms": 1}
    bad = {"tile_m": 100}  # no bucket takes it
    assert main(["build", *shape]) == 0
    base = list(built)
    built.clear()
    assert main(["build", *shape, "--bucket-overrides", json.dumps(change), json.dumps(bad)]) == 0
    assert [fe.key for fe in built[: len(base)]] == [fe.key for fe in base]
    changed = built[len(base) :]
    assert changed, "no bucket took the change"
    for fe in changed:
        assert type(fe) in {type(b) for b in base} and fe.geometry == base[0].geometry
        assert all(getattr(fe.knobs, k) == v for k, v in change.items())
        # the bucket it came from: the same knobs but for the change
        assert any(fe.with_knobs(**{k: getattr(b.knobs, k) for k in change}).key == b.key for b in base)
    out = capsys.readouterr().out
    assert f"+ {json.dumps(bad)}: skipped" in out
    for args in (['{"no_such_knob": 1}'], ["{not json"], ["{}"]):
        assert main(["build", *shape, "--bucket-overrides", *args]) == 2
    assert main(["build", *shape, "--world-size", "2", "--bucket-overrides", json.dumps(change)]) == 2
    with pytest.raises(ValueError):
        base[0].with_knobs(tile_m=100)


def test_gpu_session_multigpu_keeps_the_auto_knobs(monkeypatch, tmp_path) -> None:
    """``gpu_session.py multigpu --ep-knobs ... auto``: the EP bench records what ``auto`` tuned in
    ``$OUT/ep_knobs.json`` (its knob cache); without ``auto`` no knob cache is written. No process runs:
    the commands are recorded."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.py"
    spec = importlib.util.spec_from_file_location("gpu_session_under_test", path)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    cmds: list[list[str]] = []

    class Done:
        pid = 0

        def __init__(self, cmd: list[str], **kw: object) -> None:
            cmds.append(cmd)

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(gs.subprocess, "Popen", Done)
    for knobs, cache in ((["default", "auto"], str(tmp_path / "ep_knobs.json")), (["default"], None)):
        cmds.clear()
        assert gs.multigpu(tmp_path, 2, ["8"], knobs, True, False, [], tmp_path) == 0
        bench = next(c for c in cmds if "--knobs" in c)
        assert (bench[bench.index("--knob-cache") + 1] if "--knob-cache" in bench else None) == cache


def test_gemv_phase_stamps_patches_a_copy_of_this_drop_once(tmp_path) -> None:
    """``scripts/gemv_phase_stamps.py patch`` stamps a copy of this drop's ``gemv.py`` (every anchor found once; the
    stamps land in the GEMV's output buffer), then refuses the patched copy (stamped already) and this
    checkout's own drop. A new drop that moves the anchors fails here, so the diagnostic is updated with it."""
    import importlib.util
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "scripts" / "gemv_phase_stamps.py"
    spec = importlib.util.spec_from_file_location("gemv_phase_stamps_under_test", script)
    stamps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stamps)
    copy = tmp_path / stamps.GEMV
    copy.parent.mkdir(parents=True)
    shutil.copy(root / stamps.GEMV, copy)
    assert stamps.patch(tmp_path) == 0
    text = copy.read_text()
    assert text.count("_stamp(st_base") == 11 and "mC.iterator.toint()" in text  # v56: + the cluster combine's end
    compile(text, str(copy), "exec")  # still Python
    assert stamps.patch(tmp_path) == 1 and copy.read_text() == text  # nothing half-done
    assert stamps.patch(root) == 1


def test_bar_cells_tables_read_the_bench_csv() -> None:
    """``scripts/bar_cells.py`` turns the bench's CSV rows into the bars' tables: decode per layer in the graph (us,
    BF16's share of the weight floor, BF16's time over each format's), prefill per call (ms, the share of the run's
    matmul ceiling, x the pipeline, BF16's time over each format's)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bar_cells.py"
    spec = importlib.util.spec_from_file_location("bar_cells_under_test", script)
    cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cells)
    bf16, mxfp8, nvfp4 = cells.BACKENDS

    def row(backend: str, t: int, **values: float) -> dict[str, str]:
        return {"contract": "qwen3-30b-a3b", "backend": backend, "tokens": str(t), "graph_layers": "8",
                **{k: str(v) for k, v in values.items()}}  # fmt: skip

    decode = [row(bf16, 1, graph_ms=0.030, floor_ms=0.021), row(mxfp8, 1, graph_ms=0.020, floor_ms=0.0105),
              row(nvfp4, 1, graph_ms=0.012, floor_ms=0.006)]  # fmt: skip
    lines = cells.decode_table(decode)
    assert "graph of 8" in lines[0] and len(lines) == 2
    assert lines[1].split() == ["T=", "1", "BF16", "30.00", "(70%)", "MXFP8", "20.00", "(1.50x)", "NVFP4", "12.00",
                                "(2.50x)"]  # fmt: skip
    prefill = [row(bf16, 4096, ms=2.0, tflops=400.0, speedup=2.5), row(nvfp4, 4096, ms=1.6, tflops=500.0, speedup=3.1)]
    lines = cells.prefill_table(prefill, 800.0)
    assert lines[1].split() == ["T=", "4096", "BF16", "2.000", "ms", "400", "50.0%", "2.50x", "NVFP4", "1.250x"]
    assert "-" in cells.prefill_table(prefill, None)[1].split()  # no ceiling line: no share of it
    assert cells.short(nvfp4) == "NVFP4"


def test_demo_and_build_take_a_geometry_spec(capsys) -> None:
    import argparse

    from flashinfer.moe_ep.cli import build

    assert main(["demo", "--contract", "h256-i128-e16-k4-relu2", "--tokens", "0", "7", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "h256-i128-e16-k4-relu2" in out and "all sizes match" in out
    args = argparse.Namespace(
        knobs=None, contract=["h2048-i1024-e128-k8"], world_size=1, combine_dtype="bf16", hidden=None
    )
    [(name, cfg, e_local)] = build._configs(args)
    assert name == "h2048-i1024-e128-k8" and e_local == 128
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.top_k) == (2048, 1024, 8)
    assert main(["demo", "--contract", "h256-i128-e16"]) == 2
    assert "is not a geometry" in capsys.readouterr().err
