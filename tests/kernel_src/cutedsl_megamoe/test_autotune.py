"""Collective autotune with a fake frontend and a fake timer: one winner on every rank, failures dropped
everywhere without a hang, the same collectives on every rank (gloo ranks on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from flashinfer.moe_ep.core.runtime.local_ranks import run_on_local_ranks
from flashinfer.moe_ep.kernel_src.cutedsl_megamoe import autotune as at

CANDIDATES = ["a", "b", "c", "d"]
# ms per (rank, candidate). Each rank alone would pick another winner; the slowest rank's time decides:
# the max over ranks is a: 9, b: 5, c: 7, d: 6 at world 2 and 3, so "b" wins.
TIMES = {
    0: {"a": 1.0, "b": 5.0, "c": 7.0, "d": 6.0},
    1: {"a": 9.0, "b": 4.0, "c": 2.0, "d": 6.0},
    2: {"a": 3.0, "b": 5.0, "c": 7.0, "d": 1.0},
}


class FakeFrontend:
    """Stands in for a kernel frontend: ``load`` may fail; the launch returns its fake duration."""

    def __init__(self, rank: int, name: str, fail_load: bool = False, fail_time: bool = False) -> None:
        self.rank, self.name, self.fail_load, self.fail_time = rank, name, fail_load, fail_time

    def load(self) -> at.Launch:
        if self.fail_load:
            raise RuntimeError(f"compile failed for {self.name}")
        if self.fail_time:
            return lambda: math.nan  # a launch that produces garbage timing
        return lambda: TIMES[self.rank][self.name]


def fake_timer(launch: at.Launch, iters: int) -> list[float]:
    return [launch() for _ in range(iters)]


def _run(rank: int, world: int, fail_load: dict[str, int], fail_time: dict[str, int]) -> dict:
    calls = {"all_reduce": 0, "barrier": 0}
    real_all_reduce, real_barrier = dist.all_reduce, dist.barrier

    def counting_all_reduce(*a, **k):
        calls["all_reduce"] += 1
        return real_all_reduce(*a, **k)

    def counting_barrier(*a, **k):
        calls["barrier"] += 1
        return real_barrier(*a, **k)

    dist.all_reduce, dist.barrier = counting_all_reduce, counting_barrier
    try:

        def run_candidate(name: str) -> at.Launch:
            fe = FakeFrontend(rank, name, fail_load.get(name) == rank, fail_time.get(name) == rank)
            return fe.load()

        try:
            res = at.autotune(
                CANDIDATES, run_candidate, rank=rank, world_size=world, timer=fake_timer, iters=3, progress=False
            )
        except at.AutotuneError as exc:
            return {"error": str(exc), "calls": calls}
    finally:
        dist.all_reduce, dist.barrier = real_all_reduce, real_barrier
    return {
        "winner": res.winner,
        "ms": res.winner_ms,
        "table": [(r.candidate, r.ok, r.ms, r.reason) for r in res.table],
        "calls": calls,
    }


def _expected(world: int, dropped: set[str]) -> tuple[str, float]:
    worst = {c: max(TIMES[r][c] for r in range(world)) for c in CANDIDATES if c not in dropped}
    best = min(worst, key=lambda c: worst[c])
    return best, worst[best]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_different_timings_agree_on_one_winner(world: int) -> None:
    outs = run_on_local_ranks(_run, world, {}, {}, timeout_s=120)
    want = _expected(world, set())
    for rank, out in enumerate(outs):
        assert (out["winner"], out["ms"]) == want, rank
        local_best = min(CANDIDATES, key=lambda c: TIMES[rank][c])
        assert local_best != want[0]  # the fixture really disagrees locally
    assert len({str(o["table"]) for o in outs}) == 1  # identical tables on every rank
    # two all-reduces per candidate on every rank (the flag one is the barrier), nothing else
    assert all(o["calls"] == {"all_reduce": 2 * len(CANDIDATES), "barrier": 0} for o in outs)


@pytest.mark.parametrize("world", [2, 3])
def test_candidate_failing_on_one_rank_is_dropped_everywhere_without_a_hang(world: int) -> None:
    # "b" (the would-be winner) fails to compile on the last rank only; "d" times garbage on rank 0 only.
    outs = run_on_local_ranks(_run, world, {"b": world - 1}, {"d": 0}, timeout_s=120)
    want = _expected(world, {"b", "d"})
    for rank, out in enumerate(outs):
        assert (out["winner"], out["ms"]) == want
        table = {c: (ok, reason) for c, ok, _, reason in out["table"]}
        assert not table["b"][0] and not table["d"][0] and table["a"][0] and table["c"][0]
        if rank == world - 1:
            assert "compile failed for b" in table["b"][1]
        else:
            assert table["b"][1] == "failed on another rank"
    assert all(o["calls"]["all_reduce"] == 2 * len(CANDIDATES) for o in outs)


def test_every_candidate_failing_somewhere_raises_on_every_rank() -> None:
    outs = run_on_local_ranks(_run, 2, {"a": 0, "b": 1, "c": 0, "d": 1}, {}, timeout_s=120)
    assert all("no candidate ran on every rank" in o["error"] for o in outs)
    assert all(o["calls"]["all_reduce"] == 2 * len(CANDIDATES) for o in outs)


def test_world_one_issues_no_collective_and_prints_progress(capsys) -> None:
    out = _run(0, 1, {"c": 0}, {})
    assert out["winner"] == "a" and out["calls"] == {"all_reduce": 0, "barrier": 0}
    res = at.autotune(["a", "b"], lambda c: FakeFrontend(0, c).load(), timer=fake_timer, label="t")
    assert res.winner == "a"
    err = capsys.readouterr().err
    assert "t: 2 candidate(s)" in err and "[2/2] b: 5.0000 ms" in err


def test_ties_go_to_the_first_candidate() -> None:
    res = at.autotune(["x", "y"], lambda c: lambda: 1.0, timer=fake_timer, progress=False)
    assert res.winner == "x"


def test_incumbent_holds_unless_beaten_by_more_than_the_margin() -> None:
    times = {"defaults": 1.00, "close": 0.97, "clear": 0.90}

    def run(names: list[str], margin: float) -> str:
        res = at.autotune(
            names, lambda c: lambda c=c: times[c], timer=fake_timer, progress=False, incumbent="defaults", margin=margin
        )
        return res.winner

    assert run(["defaults", "close"], 0.04) == "defaults"  # 3 % faster: inside the margin
    assert run(["defaults", "close", "clear"], 0.04) == "clear"  # 10 % faster: replaces the defaults
    assert run(["defaults", "close"], 0.0) == "close"  # no margin: plain argmin
    with pytest.raises(ValueError, match="margin"):
        at.autotune(["defaults"], lambda c: lambda: 1.0, timer=fake_timer, progress=False, margin=1.5)


@pytest.mark.parametrize("world", [2])
def test_incumbent_decision_is_the_same_on_every_rank(world: int) -> None:
    """Each rank alone would keep or drop the incumbent differently; the all-reduced times decide."""
    results = run_on_local_ranks(_run_incumbent, world, timeout_s=120)
    assert [r["winner"] for r in results] == ["b"] * world
    assert min(TIMES[1], key=lambda c: TIMES[1][c]) == "c"  # rank 1 alone would keep the incumbent


def _run_incumbent(rank: int, world: int) -> dict:
    # max over ranks: a 9, b 5, c 7, d 6; incumbent c (7): b is 29 % faster, beyond the 4 % margin.
    res = at.autotune(
        CANDIDATES,
        lambda c: FakeFrontend(rank, c).load(),
        rank=rank,
        world_size=world,
        timer=fake_timer,
        iters=3,
        progress=False,
        incumbent="c",
        margin=0.04,
    )
    return {"winner": res.winner}


# ------------------------------------------------------------------ confirm: the head-to-head timing
class DriftingLaunches:
    """Launches whose time is their own cost plus a drift that accumulates over every launch of any of
    them (a GPU's clocks or temperature moving during the sweep)."""

    def __init__(self, cost: dict[str, float], drift_per_launch: float) -> None:
        self.cost, self.drift, self.n, self.prepared = cost, drift_per_launch, 0, []

    def run_candidate(self, name: str) -> at.Launch:
        self.prepared.append(name)

        def launch(name: str = name) -> float:
            self.n += 1
            return self.cost[name] + self.drift * self.n

        return launch


def fake_pair_timer(launches, iters: int) -> list[list[float]]:
    times: list[list[float]] = [[] for _ in launches]
    for r in range(iters):
        for j in range(len(launches)):
            i = (r + j) % len(launches)
            times[i].append(launches[i]())
    return times


def test_confirm_keeps_the_incumbent_when_its_loss_was_drift() -> None:
    """Two equal candidates; every launch is a little faster than the one before (the drift), so the one
    timed later looks 5 % faster in the sweep. Head to head, interleaved, they are equal: the defaults stay."""
    la = DriftingLaunches({"defaults": 1.0, "later": 1.0}, drift_per_launch=-0.01)
    res = at.autotune(
        ["defaults", "later"], la.run_candidate, timer=fake_timer, pair_timer=fake_pair_timer, iters=5,
        progress=False, incumbent="defaults", margin=0.04, confirm=True,
    )  # fmt: skip
    sweep = {r.candidate: r.ms for r in res.table}
    assert sweep["later"] < sweep["defaults"] * 0.96  # the sweep alone would replace the defaults
    assert res.winner == "defaults" and res.head_to_head is not None
    held_ms, challenger_ms = res.head_to_head
    assert challenger_ms == pytest.approx(held_ms, rel=0.02)
    assert la.prepared == ["defaults", "later", "defaults", "later"]  # both prepared again for the match


def test_confirm_lets_a_real_win_through_and_reports_the_head_to_head_time() -> None:
    la = DriftingLaunches({"defaults": 1.0, "better": 0.8}, drift_per_launch=0.0)
    res = at.autotune(
        ["defaults", "better"], la.run_candidate, timer=fake_timer, pair_timer=fake_pair_timer, iters=4,
        progress=False, incumbent="defaults", margin=0.04, confirm=True,
    )  # fmt: skip
    assert res.winner == "better" and res.winner_ms == pytest.approx(0.8) and res.head_to_head == (1.0, 0.8)


def test_confirm_only_runs_when_the_sweep_would_replace_the_incumbent() -> None:
    for cost in ({"defaults": 1.0, "close": 0.99}, {"defaults": 0.9, "worse": 1.0}):
        la = DriftingLaunches(cost, drift_per_launch=0.0)
        res = at.autotune(
            list(cost), la.run_candidate, timer=fake_timer, pair_timer=fake_pair_timer, iters=3,
            progress=False, incumbent="defaults", margin=0.04, confirm=True,
        )  # fmt: skip
        assert res.winner == "defaults" and res.head_to_head is None and la.prepared == list(cost)


def test_confirm_failure_keeps_the_incumbent() -> None:
    def broken(launches, iters):
        raise RuntimeError("launch failed")

    la = DriftingLaunches({"defaults": 1.0, "better": 0.5}, drift_per_launch=0.0)
    res = at.autotune(
        ["defaults", "better"], la.run_candidate, timer=fake_timer, pair_timer=broken, iters=3,
        progress=False, incumbent="defaults", margin=0.04, confirm=True,
    )  # fmt: skip
    assert res.winner == "defaults" and res.head_to_head == (math.inf, math.inf)


@pytest.mark.parametrize("world", [2])
def test_confirm_decision_and_collectives_are_the_same_on_every_rank(world: int) -> None:
    """Rank 1's head-to-head fails: every rank keeps the incumbent, after the same number of
    collectives (two per candidate, two for the head to head)."""
    results = run_on_local_ranks(_run_confirm, world, timeout_s=120)
    assert [r["winner"] for r in results] == ["defaults"] * world
    assert len({r["all_reduce"] for r in results}) == 1 and results[0]["all_reduce"] == 2 * 2 + 2


def _run_confirm(rank: int, world: int) -> dict:
    calls = {"all_reduce": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **k):
        calls["all_reduce"] += 1
        return real_all_reduce(*a, **k)

    def pair_timer(launches, iters):
        if rank == 1:
            raise RuntimeError("launch failed on rank 1")
        return fake_pair_timer(launches, iters)

    dist.all_reduce = counting_all_reduce
    try:
        la = DriftingLaunches({"defaults": 1.0, "better": 0.5}, drift_per_launch=0.0)
        res = at.autotune(
            ["defaults", "better"], la.run_candidate, rank=rank, world_size=world, timer=fake_timer,
            pair_timer=pair_timer, iters=3, progress=False, incumbent="defaults", margin=0.04, confirm=True,
        )  # fmt: skip
    finally:
        dist.all_reduce = real_all_reduce
    return {"winner": res.winner, "all_reduce": calls["all_reduce"]}
