"""Run a function on R local CPU ranks (torch.multiprocessing spawn + gloo), collecting each result.

Used by the demo's ``--world-size`` and by the multi-rank CPU tests; not a serving path.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...errors import MoEEpError


def _worker(rank: int, world: int, init_file: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        # Tensors go through as bytes: torch's fd sharing dies with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_on_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes sharing a gloo group.

    ``fn`` must be importable (module level) and its result picklable. Raises ``MoEEpError`` with the
    failing rank's traceback if any rank fails.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                break
            if queue.empty():
                if not any(p.is_alive() for p in procs) and queue.empty():
                    break
                time.sleep(0.02)
                continue
            rank, ok, value = queue.get()
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    if errors:
        raise MoEEpError("\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise MoEEpError(f"local ranks {missing} did not report within {timeout_s:.0f} s (crashed or hung)")
    return [results[r] for r in range(world_size)]


__all__ = ["run_on_local_ranks"]
