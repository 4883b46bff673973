"""Collective autotune: every rank times the same candidate list in lockstep and all pick one winner.

Protocol, per candidate, on every rank, in the candidate list's order:

1. ``prepare(candidate)``: compile or load it (from the kernel cache) and return a zero-argument
   launch; an exception marks the candidate failed on this rank.
2. all-reduce MAX of the failure flag. This is also the barrier: no rank starts timing before every
   rank has finished compiling.
3. when no rank failed: ``timer(launch, iters)`` (CUDA events in production), the local median;
   an exception marks it failed here.
4. all-reduce MAX of ``[failed, median_ms]``: the candidate's time is the slowest rank's median, and
   a failure on any rank drops it on all ranks.

Every rank runs both collectives for every candidate whatever happened locally, so the sequence of
collectives is identical on all ranks and a failing candidate cannot hang the sweep. The winner is the
argmin of the all-reduced times (first in list order on ties): the same on every rank. With an
``incumbent`` (the defaults) it stays the winner unless the argmin beats it by more than ``margin``
(a fraction): timings closer than the run-to-run spread do not replace the defaults with a candidate
that is only luckier, so a tuned layer is not slower than the defaults it started from.

``confirm``: candidates timed one after the other also differ by the GPU's drift between them (clocks,
temperature; on an H200 two copies of one kernel library timed that way were up to 13 % apart, TUNING.md
"Session 11"). So when the sweep says the argmin beats the incumbent by more than the margin, both are
prepared again and timed head to head, interleaved (``pair_timer``), with the same two collectives
(failure flag, then ``[failed, incumbent ms, challenger ms]``); the argmin replaces the incumbent only
if it still wins by more than the margin there. Only for callers whose launches stay valid side by side
(a fresh ``run_candidate`` must not invalidate an earlier launch). At world size 1 no collective is
issued. Works with gloo (CPU tensors) and NCCL (CUDA tensors).

A kernel fault that poisons the CUDA context cannot be recovered here: the next collective fails on
that rank and the error surfaces on all of them.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

K = TypeVar("K")
Launch = Callable[[], Any]
Timer = Callable[[Launch, int], Sequence[float]]
PairTimer = Callable[[Sequence[Launch], int], Sequence[Sequence[float]]]


class AutotuneError(RuntimeError):
    """No candidate survived on every rank (the table says why each one failed)."""


@dataclass
class CandidateResult(Generic[K]):
    candidate: K
    ok: bool
    ms: float  # max over ranks of the per-rank median (inf when dropped)
    local_ms: float  # this rank's median (inf when not timed here)
    reason: str = ""  # why it was dropped


@dataclass
class AutotuneResult(Generic[K]):
    winner: K
    winner_ms: float
    table: list[CandidateResult[K]] = field(default_factory=list)
    #: ``confirm``: (incumbent ms, challenger ms) of the head-to-head timing, when one ran (all-reduced;
    #: inf when it failed on some rank, which keeps the incumbent)
    head_to_head: tuple[float, float] | None = None


def cuda_event_pair_timer(warmup: int = 3) -> PairTimer:
    """Times launches interleaved: round r times each once with CUDA events, starting at launch r (mod
    their number), so drift over the rounds reaches all of them alike. Per-launch ms, one list each."""

    def timer(launches: Sequence[Launch], iters: int) -> list[list[float]]:
        for launch in launches:
            for _ in range(warmup):
                launch()
        torch.cuda.synchronize()
        times: list[list[float]] = [[] for _ in launches]
        for r in range(iters):
            for j in range(len(launches)):
                i = (r + j) % len(launches)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launches[i]()
                end.record()
                end.synchronize()
                times[i].append(start.elapsed_time(end))
        return times

    return timer


def cuda_event_timer(warmup: int = 3) -> Timer:
    """Times each launch with CUDA events on the current stream (after ``warmup`` untimed launches): the
    one-launch case of ``cuda_event_pair_timer``."""
    pair = cuda_event_pair_timer(warmup)
    return lambda launch, iters: pair([launch], iters)[0]


class _Progress:
    """tqdm on rank 0 when installed, else one printed line per candidate; silent elsewhere."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.enabled, self.label, self.total, self.n = enabled, label, total, 0
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                print(f"{label}: {total} candidate(s)", file=sys.stderr, flush=True)
            else:
                self.bar = tqdm(total=total, desc=label, file=sys.stderr)

    def step(self, candidate: Any, result: CandidateResult[Any]) -> None:
        self.n += 1
        if not self.enabled:
            return
        what = f"{result.ms:.4f} ms" if result.ok else f"dropped ({result.reason})"
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        else:
            print(f"{self.label} [{self.n}/{self.total}] {candidate}: {what}", file=sys.stderr, flush=True)

    def note(self, line: str) -> None:
        if self.enabled:
            print(f"{self.label}: {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _flag_device(group: Any) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autotune(
    candidates: Sequence[K],
    run_candidate: Callable[[K], Launch],
    *,
    group: Any = None,
    rank: int = 0,
    world_size: int = 1,
    timer: Timer | None = None,
    iters: int = 10,
    progress: bool = True,
    label: str = "autotune",
    incumbent: K | None = None,
    margin: float = 0.0,
    confirm: bool = False,
    pair_timer: PairTimer | None = None,
) -> AutotuneResult[K]:
    """Time ``candidates`` on every rank of ``group`` in lockstep; return the common winner and the table.

    ``run_candidate(c)`` compiles or loads ``c`` and returns its launch; ``timer(launch, iters)`` returns
    per-launch milliseconds (default: CUDA events). Every rank must pass the same candidate list.
    Raises ``AutotuneError`` (on every rank alike) when no candidate survives. ``incumbent`` (one of
    ``candidates``) wins unless a candidate is faster by more than ``margin`` of its time; with
    ``confirm``, also in a head-to-head timing of the two (``pair_timer``, default CUDA events
    interleaved; see the module docstring).
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    import torch.distributed as dist

    timer = timer or cuda_event_timer()
    pair_timer = pair_timer or cuda_event_pair_timer()
    collective = world_size > 1
    device = _flag_device(group) if collective else torch.device("cpu")

    def all_max(values: list[float]) -> list[float]:
        if not collective:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()  # a host copy: for NCCL this waits for the collective

    bar = _Progress(len(candidates), label, progress and rank == 0)
    table: list[CandidateResult[K]] = []
    try:
        for cand in candidates:
            reason, launch = "", None
            try:
                launch = run_candidate(cand)
            except Exception as exc:  # any failure is a vote to drop, never a skipped collective
                reason = f"rank {rank}: {type(exc).__name__}: {exc}"
            (any_failed,) = all_max([float(launch is None)])  # the barrier after compile-or-load

            local = math.inf
            if not any_failed:
                try:
                    times = list(timer(launch, iters))  # type: ignore[arg-type]
                    local = float(statistics.median(times))
                    if not math.isfinite(local):
                        raise ValueError(f"non-finite median {local}")
                except Exception as exc:
                    reason = f"rank {rank}: {type(exc).__name__}: {exc}"
            failed, ms = all_max([float(bool(any_failed) or not math.isfinite(local)), local])

            ok = not failed
            if not ok and not reason:
                reason = "failed on another rank"
            row = CandidateResult(cand, ok, ms if ok else math.inf, local, reason)
            table.append(row)
            bar.step(cand, row)
    finally:
        bar.close()
    launch = None  # the last candidate's launch (and what it holds, e.g. a weight layout) is not needed now

    best = min((r for r in table if r.ok), key=lambda r: r.ms, default=None)  # min keeps the first tie
    if best is None:
        lines = "\n".join(f"  {r.candidate}: {r.reason}" for r in table)
        raise AutotuneError(f"{label}: no candidate ran on every rank\n{lines}")
    held = next((r for r in table if r.ok and incumbent is not None and r.candidate == incumbent), None)
    if held is None or best is held:
        return AutotuneResult(best.candidate, best.ms, table)
    if best.ms > held.ms * (1.0 - margin):
        return AutotuneResult(held.candidate, held.ms, table)  # all-reduced times: the same on every rank
    if not confirm:
        return AutotuneResult(best.candidate, best.ms, table)

    # head to head, interleaved: the same two collectives on every rank, whatever fails locally
    launches, reason = None, ""
    try:
        launches = [run_candidate(held.candidate), run_candidate(best.candidate)]
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
    (any_failed,) = all_max([float(launches is None)])
    local = [math.inf, math.inf]
    if not any_failed:
        try:
            local = [float(statistics.median(t)) for t in pair_timer(launches, iters)]  # type: ignore[arg-type]
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
    failed, held_ms, best_ms = all_max([float(bool(any_failed) or not all(map(math.isfinite, local))), *local])
    if failed:
        held_ms = best_ms = math.inf
    won = not failed and best_ms <= held_ms * (1.0 - margin)
    bar.note(
        f"head to head, interleaved: {incumbent} {held_ms:.4f} ms, {best.candidate} {best_ms:.4f} ms -> "
        + (f"{best.candidate}" if won else f"keeps {incumbent}" + (f" ({reason or 'failed on another rank'})"
                                                                    if failed else ""))
    )  # fmt: skip
    if won:
        return AutotuneResult(best.candidate, best_ms, table, (held_ms, best_ms))
    return AutotuneResult(held.candidate, held.ms, table, (held_ms, best_ms))


__all__ = [
    "AutotuneError",
    "AutotuneResult",
    "CandidateResult",
    "Launch",
    "PairTimer",
    "Timer",
    "autotune",
    "cuda_event_pair_timer",
    "cuda_event_timer",
]
