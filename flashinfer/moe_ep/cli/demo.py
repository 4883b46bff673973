"""``demo``: build a layer for a model contract, run it, check it against the fp64 oracle, print a table."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from ..config import BootstrapConfig, FleetParams, MegaConfig, MoEEpTensors, MoEWeightPack
from ..core.contracts import CONTRACTS, GEOMETRY_FORM, get_contract
from ..core.inputs import ROUTINGS, make_expert_weights, make_hidden_states, make_topk, relative_errors, rounding_ulps
from ..core.reference import moe_reference
from ..core.runtime.local_ranks import run_on_local_ranks
from ..errors import MoEEpConfigError
from ..layer import MoEEpLayer
from .backends import choose_backend

#: correctness bars shared with the kernel tests: mean elementwise relative error, and the largest error
#: in units of the bf16 rounding the semantics allow (``core.inputs.rounding_ulps``).
MEAN_BAR, ULPS_BAR = 1e-2, 4.0
CPU_WEIGHT_LIMIT_BYTES = 6 << 30


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a model contract's MoE layer and check it against the reference")
    p.add_argument(
        "--contract",
        default="tiny",
        help=f"model geometry: {', '.join(sorted(CONTRACTS))}, or {GEOMETRY_FORM} (default: tiny)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 7, 64], help="tokens per rank (several allowed)")
    p.add_argument("--world-size", type=int, default=1, help="EP ranks; >1 runs local gloo ranks on the CPU")
    p.add_argument("--backend", default="auto", help="kernel name, or auto (best that runs here)")
    p.add_argument("--experts", type=int, default=None, help="override the contract's expert count (smaller = faster)")
    p.add_argument("--routing", default="uniform", choices=ROUTINGS)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    p.add_argument("--iters", type=int, default=3, help="timed forwards per size (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _device(arg: str | None, world: int) -> torch.device:
    if world > 1:
        if arg not in (None, "cpu"):
            raise MoEEpConfigError("--world-size > 1 runs local gloo ranks on the CPU; use torchrun for GPU EP")
        return torch.device("cpu")
    if arg:
        return torch.device(arg)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _rank_job(rank: int, world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank's part: build the layer on its experts, run each size, check against the fp64 oracle."""
    c, device = spec["contract"], torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    w13, w2 = make_expert_weights(c.num_experts, c.hidden_size, c.intermediate_size, c.activation, generator=gen)
    e_local = c.num_experts // world
    mine = slice(rank * e_local, (rank + 1) * e_local)
    entry = spec["entry"]
    config = entry.load_config_class()(
        c.hidden_size, c.intermediate_size, c.num_experts, c.top_k, c.activation, c.activation_limit
    )
    layer = MoEEpLayer(
        # local ranks on the CPU wait in the reference backend's exchanges while the others compute: large
        # contracts take far longer there than the 30 s default, which is meant for GPU kernels
        BootstrapConfig(world_size=world, rank=rank, device=device, transport_timeout_s=3600.0),
        FleetParams(c.num_experts, max(spec["tokens"]), c.hidden_size),
        MoEWeightPack(w13[mine].contiguous().to(device), w2[mine].contiguous().to(device)),
        backend=MegaConfig(megakernel=config),
    )
    layer.warmup()
    rows = []
    for t in spec["tokens"]:
        g = torch.Generator().manual_seed(spec["seed"] * 7919 + t * 31 + rank)
        x = make_hidden_states(t, c.hidden_size, generator=g)
        ids, w = make_topk(t, c.num_experts, c.top_k, routing=spec["routing"], generator=g)
        tensors = MoEEpTensors(x.to(device), ids.to(device), w.to(device))
        times = []
        out = None
        for _ in range(spec["iters"] + 1):  # the first is a warmup
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = layer.forward(tensors)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        ref, scale = moe_reference(
            x, ids, w, w13, w2, c.activation, c.activation_limit, compute_dtype=torch.float64, return_term_scale=True
        )
        mean_err, max_err = relative_errors(out.cpu(), ref)
        ulps = rounding_ulps(out.cpu(), ref, scale)
        row = {"rank": rank, "tokens": t, "ms": statistics.median(times[1:]), "mean": mean_err, "max": max_err}
        rows.append({**row, "ulps": ulps})
    layer.destroy()
    return rows


def run(args: argparse.Namespace) -> int:
    world = args.world_size
    if world < 1:
        raise MoEEpConfigError("--world-size must be >= 1")
    if any(t < 0 for t in args.tokens):
        raise MoEEpConfigError("--tokens must be >= 0")
    contract = get_contract(args.contract)
    if args.experts is not None:
        contract = contract.with_experts(args.experts)
    if contract.num_experts % world:
        raise MoEEpConfigError(f"{contract.num_experts} experts do not split over {world} ranks")
    device = _device(args.device, world)
    weight_bytes = contract.num_experts * contract.weight_bytes_per_expert()
    if device.type == "cpu" and weight_bytes * 1.5 > CPU_WEIGHT_LIMIT_BYTES:
        raise MoEEpConfigError(
            f"{contract.name} holds {weight_bytes / 2**30:.1f} GiB of bf16 weights, too much for a CPU demo; "
            f"pass --experts N (e.g. --experts {max(contract.top_k, 16)}) or run on a GPU"
        )
    entry, note = choose_backend(args.backend, device)
    print(
        f"demo: contract {contract.name} (H={contract.hidden_size}, I={contract.intermediate_size}, "
        f"E={contract.num_experts}, top-{contract.top_k}, {contract.activation}), world {world}, device {device}, "
        f"backend {entry.kernel_name}"
    )
    if note:
        print(f"note: {note}")
    spec = {
        "contract": contract,
        "device": str(device),
        "entry": entry,
        "tokens": args.tokens,
        "routing": args.routing,
        "iters": max(1, args.iters),
        "seed": args.seed,
    }
    if world == 1:
        per_rank = [_rank_job(0, 1, spec)]
    else:
        per_rank = run_on_local_ranks(_rank_job, world, spec)

    print(
        f"\n{'tokens/rank':>11} {'ms (max rank)':>13} {'mean rel err':>12} {'max rel err':>11} {'max units':>9}  check"
    )
    ok_all = True
    for i, t in enumerate(args.tokens):
        rows = [r[i] for r in per_rank]
        ms = max(r["ms"] for r in rows)
        mean_err = max(r["mean"] for r in rows)
        max_err = max(r["max"] for r in rows)
        ulps = max(r["ulps"] for r in rows)
        ok = mean_err < MEAN_BAR and ulps <= ULPS_BAR
        ok_all &= ok
        print(f"{t:>11} {ms:>13.3f} {mean_err:>12.2e} {max_err:>11.2e} {ulps:>9.2f}  {'ok' if ok else 'FAIL'}")
    print(
        f"\n{'all sizes match' if ok_all else 'MISMATCH against'} the fp64 reference (bars: mean rel err < "
        f"{MEAN_BAR:g}, max error <= {ULPS_BAR:g} units of the allowed bf16 rounding, see docs/numerics.md); "
        "times are wall-clock per forward"
    )
    return 0 if ok_all else 1


__all__ = ["add_parser", "run"]
