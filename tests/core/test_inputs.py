import torch

from flashinfer.moe_ep.core.inputs import make_token_inputs


def test_token_inputs_do_not_depend_on_the_other_token_counts() -> None:
    """A T's rotating input sets come from a generator of their own: the bench and ``drop_ab`` time the same routing
    at T whatever other T a run lists (session 42: two runs with other token lists timed other routings at one T)."""
    a = make_token_inputs(3, 64, 16, 4, 2, seed=1234)
    b = make_token_inputs(3, 64, 16, 4, 2, seed=1234)
    make_token_inputs(2, 64, 16, 4, 2, seed=1234)  # drawing another T first changes nothing
    c = make_token_inputs(3, 64, 16, 4, 2, seed=1234)
    for sa, sb, sc in zip(a, b, c, strict=True):
        for u, v, w in zip(sa, sb, sc, strict=True):
            assert torch.equal(u, v) and torch.equal(u, w)
    x, ids, w = a[0]
    assert x.shape == (3, 64) and x.dtype == torch.bfloat16 and ids.shape == w.shape == (3, 4)
    assert all(len(set(r.tolist())) == 4 for r in ids) and torch.allclose(w.sum(1), torch.ones(3))
    assert not torch.equal(a[0][1], a[1][1])  # the sets rotate: other routings
    assert not torch.equal(make_token_inputs(3, 64, 16, 4, 1, seed=1)[0][0], x)  # the seed matters
    assert make_token_inputs(0, 64, 16, 4, 1, seed=1)[0][0].shape == (0, 64)
