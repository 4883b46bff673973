"""The EP loopback kernel draft compiles and exports for sm_90a on the CPU (one small variant).

Runs ``scripts/build_ep_loopback.py`` in a subprocess (tests import the drop only through its
package ``__init__``), then checks the library and the manifest the GPU test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer.moe_ep.kernel_src import cutedsl_megamoe as drop

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not drop.dsl_available(), reason="needs the CuTe DSL compiler (pip install .[test])")


def test_ep_r2_k1_compiles_and_exports(tmp_path: Path) -> None:
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_ep_loopback.py"), "--only", "ep_r2_k1", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = tmp_path / "libep_r2_k1.so"
    assert lib.stat().st_size > 10_000
    assert b"__tvm_ffi_ep_r2_k1" in lib.read_bytes()
    rec = json.loads((tmp_path / "manifest.json").read_text())["ep_r2_k1"]
    assert rec["world_size"] == 2 and rec["top_k"] == 1
    # 6 problem tensors + live_tokens, 7 symmetric buffers, 7 pointer tables, 7 local buffers (with the
    # device-side epoch state), abort, 2 scalars: nothing that changes per forward is a scalar
    assert len(rec["args"]) == 31
    assert rec["args"][6] == "live_tokens" and "ep_state" in rec["args"]
    assert rec["args"][-3:] == ["abort", "rank", "timeout_ns"]
    sym = [n for n, _, _ in rec["sym_specs"]]
    assert [b for _, b in rec["tables"]] == [n for n in sym]


def test_ep_knobs_take_tile_overrides_and_refuse_the_rest() -> None:
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    decode = drop.default_bf16_ep_knobs(g, 2, 2, bucket="decode")
    assert (decode.tile_m, decode.fc1_tile_n, decode.fc2_tile_n, decode.cluster_m) == (64, 256, 128, 1)
    prefill = drop.default_bf16_ep_knobs(g, 2, 2)  # H = 256: the widest FC2 tile that divides
    assert (prefill.tile_m, prefill.fc1_tile_n, prefill.fc2_tile_n, prefill.cluster_m) == (128, 256, 256, 2)
    assert drop.default_bf16_ep_knobs(g, 4, 4).cluster_m == 1  # 132 // 4 = 33 CTAs: no pairs
    knobs = drop.default_bf16_ep_knobs(g, 2, 2, {"tile_m": 64, "fc2_tile_n": 128}, bucket="mid")
    assert (knobs.tile_m, knobs.fc1_tile_n, knobs.fc2_tile_n, knobs.world_size) == (64, 256, 128, 2)
    drop.Bf16EpFrontend(g, knobs).check()
    with pytest.raises(ValueError, match="unknown token bucket"):
        drop.default_bf16_ep_knobs(g, 2, 2, bucket="huge")
    with pytest.raises(ValueError, match="cluster_m must be 1 or 2 and divide the grid"):
        drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 4, 4, {"cluster_m": 2})).check()
    with pytest.raises(ValueError, match="unknown EP knob.*num_sms"):
        drop.default_bf16_ep_knobs(g, 2, 2, {"num_sms": 64})
    with pytest.raises(ValueError, match="tile_m must be"):
        drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2, {"tile_m": 96})).check()
    with pytest.raises(ValueError, match="spills registers"):
        drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2, {"tile_m": 256, "fc1_tile_n": 256})).check()
    with pytest.raises(ValueError, match="fc2_tile_n"):  # H = 256 does not divide by 192
        drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2, {"fc2_tile_n": 192})).check()


def test_ep_autotune_candidates_are_valid_distinct_and_start_with_the_defaults() -> None:
    g = drop.Geometry(7168, 2048, 256, 8, "swiglu", None)  # deepseek-v3, global experts
    cands = drop.ep_candidates(g, 8, 1)
    assert cands[0] == drop.default_bf16_ep_knobs(g, 8, 1)
    assert len(set(cands)) == len(cands) >= 2
    for knobs in cands:
        drop.Bf16EpFrontend(g, knobs).check()
        assert (knobs.world_size, knobs.ranks_per_gpu) == (8, 1)
    assert {k.tile_m for k in cands} == {64, 128} and {k.cluster_m for k in cands} == {1, 2}
    assert drop.ep_candidates(g, 8, 1, bucket="decode")[0] == drop.default_bf16_ep_knobs(g, 8, 1, bucket="decode")
    odd = drop.Geometry(320, 192, 16, 4, "swiglu", None)  # N tiles must divide 384 and 320
    assert all(384 % k.fc1_tile_n == 0 and 320 % k.fc2_tile_n == 0 for k in drop.ep_candidates(odd, 2, 2))


def test_ep_rank_state_passes_its_buffers_in_the_exported_argument_order() -> None:
    """``EpRankState.state_args`` (built once, reused by every launch) is the state part of
    ``ep_workspace.EP_ARGS``: symmetric buffers, peer tables, local workspace, abort word, rank."""
    import torch

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    fe = drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2))
    group = kh.LoopbackGroup(2, torch.device("cpu"))
    states = [drop.EpRankState(fe, comm.make_provider("loopback", 2, r, torch.device("cpu"), group), r, 32,
                               torch.device("cpu")) for r in range(2)]  # fmt: skip
    ws = kh.ep_workspace
    names = list(ws.EP_ARGS[ws.EP_ARGS.index("flags") : ws.EP_ARGS.index("timeout_ns")])
    for r, st in enumerate(states):
        args = st.state_args()
        assert st.state_args() is args and len(args) == len(names)
        by_name = dict(zip(names, args, strict=True))
        assert by_name["rank"] == r and by_name["abort"] is st.abort and by_name["ep_state"] is st.ep_state
        for sym in ws.EP_SYM_BUFFERS:
            assert by_name[sym] is st.host.buffers[sym]
        for table, buf in ws.EP_TABLES:  # every rank's address of that buffer, own rank's at index r
            assert by_name[table].tolist() == [s.host.buffers[buf].data_ptr() for s in states]


def test_ep_rank_state_checks_every_ranks_room_before_allocating(monkeypatch, gloo_group) -> None:
    """Over NVSHMEM an EP state first all-reduces the free GPU memory (symmetric arena + local workspace
    + one heap chunk): a rank without room raises MemoryError before the collective allocation, so
    nothing is half allocated; with room it allocates. A CPU stand-in for the NVSHMEM provider, one-rank
    gloo group, the free-memory query stubbed."""
    import torch

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    class FakeNvshmem(kh.DeviceMemoryProvider):
        kind = "nvshmem"
        calls = 0

        def allocate(self, nbytes: int) -> torch.Tensor:
            FakeNvshmem.calls += 1
            return super().allocate(nbytes)

    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    fe = drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 1))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (comm.HEAP_CHUNK, 1 << 40))
    with pytest.raises(MemoryError, match="free GPU memory for the symmetric workspace"):
        drop.EpRankState(fe, FakeNvshmem(torch.device("cpu")), 0, 32, torch.device("cpu"), group=gloo_group)
    assert FakeNvshmem.calls == 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    state = drop.EpRankState(fe, FakeNvshmem(torch.device("cpu")), 0, 32, torch.device("cpu"), group=gloo_group)
    assert FakeNvshmem.calls == 1
    state.release()


def test_resync_states_continues_every_rank_after_the_largest_epoch(gloo_group) -> None:
    """``resync_states`` (recovery after a failed forward, and between EP autotune candidates): every
    state of the process continues after the largest epoch any rank reached, its next reuse wait
    skipped; over a process group the epoch is all-reduced (here a one-rank gloo group)."""
    import torch

    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import comm
    from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import kernel_helpers as kh

    ws = kh.ep_workspace
    g = drop.Geometry(256, 128, 16, 4, "swiglu", None)
    fe = drop.Bf16EpFrontend(g, drop.default_bf16_ep_knobs(g, 2, 2))
    group = kh.LoopbackGroup(2, torch.device("cpu"))
    states = [drop.EpRankState(fe, comm.make_provider("loopback", 2, r, torch.device("cpu"), group), r, 32,
                               torch.device("cpu")) for r in range(2)]  # fmt: skip
    for s, epoch in zip(states, (7, 9), strict=True):  # rank 0 aborted two forwards earlier
        s.ep_state.copy_(torch.tensor([epoch, epoch, epoch - 1, 0], dtype=torch.int32))
    assert drop.resync_states(states) == 9
    for s in states:
        assert s.ep_state.tolist() == ws.resync_state(9)
        assert s.ep_state[ws.STATE_NEXT_PREV] == 0  # the next forward skips the reuse wait
    states[0].ep_state[ws.STATE_EPOCH] = 12
    assert drop.resync_states(states[:1], gloo_group) == 12
    for s in states:
        s.release()
