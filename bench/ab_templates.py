"""A/B of CPU kernel templates in one process: the same program rendered from two or more
template trees (say a worktree of the last commit's templates/ and the edited one), built, checked
against the first, then timed in turn, batches of calls alternating, medians per call.

Alternating in one process keeps the machine's drift (these 2-core VMs swing by 5-10% between
processes) off the comparison. The headers (attncc/include) are the running package's for every
tree: only template differences are compared.

    git worktree add /tmp/base HEAD~1
    python bench/ab_templates.py --n 512 --d 128 --dtype bfloat16 /tmp/base/templates templates
    python bench/ab_templates.py --program causal --n 2048 --d 64 /tmp/base/templates templates:128,128
    python bench/ab_templates.py --backward --n 2048 /tmp/base/templates templates   # forward + backward
    python bench/ab_templates.py --n 1 --keys 16384 --heads 32 --kv-heads 8 --batch 8 /tmp/base/templates templates
    python bench/ab_templates.py --n 16 --keys 4096 --heads 32 --kv-heads 8 --batch 8 --kv-side-by-side /tmp/base/templates templates
    python bench/ab_templates.py --n 1 --keys 4096 --caches 16 /tmp/base/templates templates   # layers in turn

A tree may carry `:Br,Bc` to force those tiles (Kernel tiles=).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import attncc
import attncc.codegen as codegen

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Call arguments of the examples that read runtime inputs (queries' heads H, sequences B, queries N).
EXAMPLE_INPUTS = {
    "alibi": lambda B, H, N: {"slopes": torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)])},
    "relative_bias": lambda B, H, N: {"bias": torch.randn(H, 257)},
    "document": lambda B, H, N: {"doc": (torch.arange(N) // 300).repeat(B, 1)},
    "prefix_lm": lambda B, H, N: {"prefix": torch.full((B,), N // 4)},
    "padding": lambda B, H, N: {"lengths": torch.full((B,), N - N // 8)},
    "gpt2": lambda B, H, N: {"seed": 1234},  # dropout: the same bits on every call, so trees compare
}


def kernel_from(tree: str, program: Path, inputs: tuple[torch.Tensor, ...], runtime: dict) -> attncc.Kernel:
    """The program compiled with the templates of `tree` (`path[:Br,Bc]`), called once on
    `inputs` (forward and, for inputs that require grad, backward): a kernel renders its sources
    at their first call for a dtype, from the templates the process points at then."""
    path, _, tiles = tree.partition(":")
    codegen.TEMPLATE_DIR = Path(path).resolve()
    codegen.environment.cache_clear()
    options = {"tiles": tuple(int(t) for t in tiles.split(","))} if tiles else {}
    kernel = attncc.compile(program, **options)
    out = kernel(*inputs, **runtime)
    if out.requires_grad:
        out.sum().backward()
    return kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", help="template directories (the first is the baseline)")
    parser.add_argument("--program", default="vanilla", help="an example's name (examples/NAME.attn)")
    parser.add_argument("--n", type=int, default=512, help="queries per sequence")
    parser.add_argument("--keys", type=int, help="keys per sequence (default: --n)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, help="K/V heads, a divisor of --heads (default: --heads)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=0.05, help="per batch of calls")
    parser.add_argument("--backward", action="store_true", help="time forward + backward (q, k, v gradients)")
    parser.add_argument(
        "--caches",
        type=int,
        default=1,
        help="K/V pairs called in turn (a model's layers: each read from memory, not from the last call's cache)",
    )
    parser.add_argument(
        "--kv-side-by-side",
        action="store_true",
        help="K and V as [B, M, Hkv, D] memory (a paged cache's rows), viewed as [B, Hkv, M, D]",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    keys, kv_heads = args.keys or args.n, args.kv_heads or args.heads
    q = torch.randn(args.batch, args.heads, args.n, args.d, dtype=dtype, requires_grad=args.backward)

    def keys_and_values() -> list[torch.Tensor]:
        if args.kv_side_by_side:
            return [
                torch.randn(args.batch, keys, kv_heads, args.d, dtype=dtype)
                .transpose(1, 2)
                .requires_grad_(args.backward)
                for _ in range(2)
            ]
        return [
            torch.randn(args.batch, kv_heads, keys, args.d, dtype=dtype, requires_grad=args.backward) for _ in range(2)
        ]

    caches = [keys_and_values() for _ in range(args.caches)]
    k, v = caches[0]
    turn = [0]  # the cache the next call reads
    dout = torch.randn(args.batch, args.heads, args.n, args.d, dtype=dtype)
    runtime = EXAMPLE_INPUTS.get(args.program, lambda B, H, N: {})(args.batch, args.heads, args.n)

    def run(kernel: attncc.Kernel, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        if k is None or v is None:  # (timed calls: the caches in turn)
            k, v = caches[turn[0]]
            turn[0] = (turn[0] + 1) % len(caches)
        if not args.backward:
            with torch.no_grad():
                return kernel(q, k, v, **runtime).float()
        out = kernel(q, k, v, **runtime)
        return torch.cat([g.float().flatten() for g in torch.autograd.grad(out, (q, k, v), dout)])

    kernels = [kernel_from(tree, EXAMPLES / f"{args.program}.attn", (q, k, v), runtime) for tree in args.trees]
    baseline = run(kernels[0], k, v)
    for tree, kernel in zip(args.trees[1:], kernels[1:]):
        difference = (run(kernel, k, v) - baseline).abs().max().item()
        if difference > 2e-2 * max(1.0, baseline.abs().max().item()):
            raise SystemExit(f"{tree}: results differ from {args.trees[0]}'s by {difference:.3g}")
    start = time.perf_counter()
    run(kernels[0])
    calls = max(3, round(args.seconds / max(time.perf_counter() - start, 1e-5)))
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(args.rounds):
        for index, kernel in enumerate(kernels):
            start = time.perf_counter()
            for _ in range(calls):
                run(kernel)
            times[index].append((time.perf_counter() - start) / calls)
    base = statistics.median(times[0])
    what = "fwd+bwd" if args.backward else "fwd"
    print(
        f"{args.program} {what} {args.dtype} B={args.batch} H={args.heads} Hkv={kv_heads} N={args.n} M={keys} "
        f"D={args.d}, {args.rounds} x {calls} calls each"
        + (f", {args.caches} K/V caches in turn" if args.caches > 1 else "")
    )
    for tree, kept in zip(args.trees, times):
        median = statistics.median(kept)
        print(f"{tree:40s} {median * 1e3:8.3f} ms  baseline / this {base / median:.3f}")


if __name__ == "__main__":
    main()
