"""Reference EP over gloo (world 2 and 4) equals the single-process reference on the same global inputs,
with the bf16 and the MXFP8 combine wire."""

from __future__ import annotations

import pytest
import torch

import flashinfer.moe_ep as moe
from flashinfer.moe_ep.core.inputs import make_expert_weights, make_hidden_states, make_topk
from flashinfer.moe_ep.core.reference import moe_reference
from flashinfer.moe_ep.core.runtime.local_ranks import run_on_local_ranks

E, H, I, K = 8, 64, 32, 3
UNUSED_EXPERT = 5


def _global_inputs(seed: int, tokens_per_rank: list[int], routing: str):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_expert_weights(E, H, I, generator=g)
    t = sum(tokens_per_rank)
    x = make_hidden_states(t, H, generator=g)
    ids, w = make_topk(t, E - 1, K, routing=routing, generator=g)
    ids = torch.where(ids >= UNUSED_EXPERT, ids + 1, ids)  # no token picks UNUSED_EXPERT
    return w13, w2, x, ids.to(torch.int32), w


def _rank(
    rank: int, world: int, seed: int, tokens_per_rank: list[int], routing: str, combine_dtype: str = "bf16"
) -> torch.Tensor:
    w13, w2, x, ids, w = _global_inputs(seed, tokens_per_rank, routing)
    lo = sum(tokens_per_rank[:rank])
    mine = slice(lo, lo + tokens_per_rank[rank])
    e_local = E // world
    experts = slice(rank * e_local, (rank + 1) * e_local)
    layer = moe.MoEEpLayer(
        moe.BootstrapConfig(world_size=world, rank=rank, device="cpu"),
        moe.FleetParams(E, max(tokens_per_rank), H),
        moe.MoEWeightPack(w13[experts].contiguous(), w2[experts].contiguous()),
        backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K, combine_dtype=combine_dtype)),
    )
    outs = [layer.forward(moe.MoEEpTensors(x[mine], ids[mine], w[mine])) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])  # deterministic across calls
    return outs[0]


@pytest.mark.parametrize(
    "tokens_per_rank,routing,combine_dtype",
    [
        ([5, 0], "uniform", "bf16"),
        ([7, 3, 0, 11], "uniform", "bf16"),
        ([4, 9, 1, 0], "skewed", "bf16"),
        ([1, 1], "one_expert", "bf16"),
        ([6, 2, 0, 5], "uniform", "mxfp8"),  # results cross back as MXFP8 codes and scales
    ],
)
def test_ep_equals_single_process(tokens_per_rank: list[int], routing: str, combine_dtype: str) -> None:
    world = len(tokens_per_rank)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    outs = run_on_local_ranks(_rank, world, seed, tokens_per_rank, routing, combine_dtype)
    w13, w2, x, ids, w = _global_inputs(seed, tokens_per_rank, routing)
    assert not bool((ids == UNUSED_EXPERT).any())
    want = moe_reference(x, ids, w, w13, w2, combine_dtype=combine_dtype)
    got = torch.cat(outs)
    assert [o.shape[0] for o in outs] == tokens_per_rank
    # Same rounding points; only fp32 accumulation order may differ: allow 1 bf16 ulp.
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def _one_rank_rejects(rank: int, world: int) -> list:
    """Rank 0 rejects its inputs (never reaches the exchange) and stays alive past the others' deadline;
    the others' forward raises MoEEpTransportError after ``transport_timeout_s``, and recovery says what to do."""
    import time

    w13, w2, x, ids, w = _global_inputs(3, [4] * world, "uniform")
    e_local = E // world
    experts = slice(rank * e_local, (rank + 1) * e_local)
    layer = moe.MoEEpLayer(
        moe.BootstrapConfig(world_size=world, rank=rank, device="cpu", transport_timeout_s=1.0),
        moe.FleetParams(E, 4, H),
        moe.MoEWeightPack(w13[experts].contiguous(), w2[experts].contiguous()),
        backend=moe.MegaConfig(moe.ReferenceMegaMoeConfig(H, I, E, K)),
    )
    mine = slice(4 * rank, 4 * rank + 4)
    layer.forward(moe.MoEEpTensors(x[mine], ids[mine], w[mine]))  # every rank in step first
    seen: list = []
    if rank == 0:
        bad = ids[mine].clone()
        bad[0, 0] = E
        with pytest.raises(moe.MoEEpInputError, match="outside"):
            layer.forward(moe.MoEEpTensors(x[mine], bad, w[mine]))
        time.sleep(4.0)  # alive past the others' deadline: they time out, not see a closed connection
        return seen
    t0 = time.monotonic()
    with pytest.raises(moe.MoEEpTransportError, match="dispatch count exchange failed or did not complete"):
        layer.forward(moe.MoEEpTensors(x[mine], ids[mine], w[mine]))
    seen.append(time.monotonic() - t0)
    with pytest.raises(moe.MoEEpTransportError, match="rebuild the process group"):
        layer.recover_transport()
    return seen


def test_a_rank_that_rejects_its_inputs_costs_the_others_the_transport_timeout_not_a_hang() -> None:
    (waited,) = run_on_local_ranks(_one_rank_rejects, 2, timeout_s=120)[1]
    assert 0.9 <= waited < 3.5  # the 1 s deadline (gloo's own default is 30 min)
