"""The `attncc` command line: compile, explain, check, profile, examples and prebuild.

Every user mistake (a DSL error, a missing file, bad input) is printed as one clean message
and exits with status 1; no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

import attncc
from attncc import distributed
from attncc.codegen import KV_FORMATS
from attncc.errors import AttnccError
from attncc.ir.graph import fused_node
from attncc.ir.ops import FusedAttention
from attncc.passes.cost import IOReport
from attncc.passes.sparsity import EMPTY, FULL
from attncc.passes.tiling import CPU_MAX_HEAD_DIM, TilePlan, resident_blocks, split_kv_blocks, split_kv_slots
from attncc.runtime.build import LIBRARY_NAME_CHARS
from attncc.runtime.check import check
from attncc.runtime.emulate import EmulatedKernel
from attncc.runtime.inputs import AWKWARD_SHAPES, Shape, adapt, make_inputs
from attncc.targets import GPUS

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"


def _shape(text: str) -> Shape:
    try:
        values = [int(x) for x in text.split(",")]
        shape = Shape(*values)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            "expected B,H,Hkv,N,M,D[,Dv] such as 1,8,8,2048,2048,64 (Dv: v's head dim, default D)"
        ) from None
    if min(values) < 0 or shape.H < 1 or shape.Hkv < 1 or shape.D < 1 or shape.Dv < 1 or shape.H % shape.Hkv:
        raise argparse.ArgumentTypeError(
            f"expected sizes >= 0, H, Hkv, D and Dv >= 1 and H a multiple of Hkv, got {text}"
        )
    if max(values) > MAX_SIZE:  # (1e20 overflowed the traffic estimate's C longs: a TypeError)
        raise argparse.ArgumentTypeError(f"expected sizes up to {MAX_SIZE}, got {text}")
    return shape


#: The largest size --shape takes (the kernels index rows and keys in 32 bits).
MAX_SIZE = 2**31 - 1


def _adapted(shape: Shape, kern: attncc.Kernel, given: bool) -> Shape:
    """`adapt`'s shape for `kern` (M = N where runtime inputs run along N or M), saying so on
    stderr where it is not the --shape given (it ran another M silently)."""
    adapted = adapt(shape, kern)
    if given and adapted != shape:
        print(
            f"note: --shape M={shape.M} taken as M = N = {shape.N}: {kern.name}'s runtime inputs run along N or M, "
            "and the generated inputs give them one length",
            file=sys.stderr,
        )
    return adapted


def _too_large(shape: Shape, error: Exception) -> AttnccError:
    """The error of a --shape whose tensors this machine cannot hold (`check`, `explain`)."""
    said = str(error).splitlines()[0] if str(error) else type(error).__name__
    return AttnccError(f"--shape {shape}: too large for this machine's memory ({said})")


def _out_of_memory(error: Exception) -> bool:
    """Whether torch's `error` says an allocation failed or a size did not fit."""
    text = str(error)
    return isinstance(error, MemoryError) or any(
        words in text for words in ("not enough memory", "allocate", "Storage size calculation overflowed")
    )


def _positive(text: str) -> int:
    """An argument that counts something (head dims, ranks): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def _count(text: str) -> int:
    """An argument that counts what to show (source lines): an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text}")
    return value


def _fused(kern_or_stages: attncc.Kernel | list) -> FusedAttention:
    graph = kern_or_stages.graph if isinstance(kern_or_stages, attncc.Kernel) else kern_or_stages[-1].graph
    return fused_node(graph)[1]


def predict_io(op: FusedAttention, shape: Shape, elt: int, tiles: TilePlan, density: float = 1.0) -> IOReport:
    """The cost model at `shape` with the plan's forward and backward tiles."""
    assert op.cost is not None
    backward = (tiles.backward.block_rows, tiles.backward.block_cols) if tiles.backward else None
    return op.cost.predict(
        shape.B, shape.H, shape.N, shape.M, shape.D, elt, tiles.block_rows, tiles.block_cols, density, backward,
        Dv=shape.Dv,
    )  # fmt: skip


def plan_text(op: FusedAttention, shape: Shape, elt: int = 4) -> str:
    """Tiles, threads, on-chip bytes and predicted traffic at `shape` (dense tile count)."""
    assert op.tiling is not None and op.cost is not None and op.sparsity is not None
    head_dim_tiles = op.tiling.for_head_dim(shape.D)
    tiles = head_dim_tiles.for_keys(shape.M)
    report = predict_io(op, shape, elt, tiles)
    rows = (
        f" (this shape's forward where a query tile sees all keys: Br={tiles.block_rows})"
        if tiles is not head_dim_tiles
        else ""
    )
    return "\n".join(
        [
            f"  tiles   {op.tiling.describe(shape.D)}{rows}",
            f"  mask    {op.sparsity.describe()}",
            f"  grads   {op.backward.describe() if op.backward else '-'}",
            f"  traffic at {shape} (fp32, dense): {report.describe()}",
        ]
    )


def check_cpu_head_dims(asked: dict[str, int]) -> None:
    """Head dims asked of the cpu target (the argument that asks each: its one library per dtype
    takes every head dim up to CPU_MAX_HEAD_DIM): one above it was accepted and ignored, then
    refused at the call."""
    for argument, head_dim in asked.items():
        if head_dim > CPU_MAX_HEAD_DIM:
            raise AttnccError(
                f"{argument}: the cpu target's kernels take head dims in [1, {CPU_MAX_HEAD_DIM}] (one library per "
                "dtype serves them all)"
            )


def cmd_compile(args: argparse.Namespace) -> int:
    if args.target == "cpu":
        shape = args.shape
        asked = {f"--head-dim {d}": d for d in args.head_dim}
        check_cpu_head_dims({**asked, f"--shape D={shape.D}": shape.D, f"--shape Dv={shape.Dv}": shape.Dv})
    stages = attncc.lower(args.file, args.target)
    op = _fused(stages)
    print(f"{args.file}: variant `{stages[-1].graph.graph['name']}` for {args.target}")
    print(plan_text(op, args.shape))
    if args.target != "cpu":
        return _compile_cuda(args, stages)
    kern = attncc.Kernel(stages, args.target)
    out_dir = Path(args.output) if args.output else None
    for dtype in args.dtype:
        source = kern.source(dtype)
        if out_dir:
            out_dir.mkdir(parents=True, exist_ok=True)
            # (a variant's name may be longer than a file name: cut as the cache cuts it)
            (out_dir / f"{kern.name[:LIBRARY_NAME_CHARS]}_{dtype}.cpp").write_text(source)
        start = time.perf_counter()
        kern.library(dtype)
        print(f"  built   {dtype} in {time.perf_counter() - start:.2f} s (cache: {attncc.runtime.build.cache_dir()})")
    if out_dir:
        print(f"  sources written to {out_dir}/ (compile with -I {attncc.include_dir()})")
    return 0


def _compile_cuda(args: argparse.Namespace, stages: list) -> int:
    """Emit the CUDA forward kernel per (dtype, head dim), compile it with nvcc, print ptxas."""
    from attncc.codegen.cuda import generate_cuda, storage_dtypes
    from attncc.runtime.nvcc import compile_cuda

    op = _fused(stages)
    taken = storage_dtypes(args.target)
    refused = [d for d in args.dtype if d in ("bfloat16", "float16") and d not in taken]
    if refused:  # (sm75 and bfloat16: a float16 kernel was emitted instead, silently)
        raise AttnccError(f"--dtype {' '.join(refused)}: the {args.target} kernels take {' and '.join(taken)}")
    dtypes = [d for d in args.dtype if d in taken] or [taken[0]]  # (float32, float64: the kernels' storage)
    out_dir = Path(args.output) if args.output else None
    for dtype in dtypes:
        for head_dim in args.head_dim:
            plan = op.tiling.for_head_dim(head_dim)
            if plan.head_dim != op.tiling.for_head_dim(args.shape.D).head_dim:  # the plan above was for shape.D
                print(f"  tiles   {op.tiling.describe(head_dim)}")
            source = generate_cuda(stages[-1].graph, dtype, plan, args.target)
            name = f"{stages[-1].graph.graph['name'][:LIBRARY_NAME_CHARS]}_{args.target}_{dtype}_d{plan.head_dim}.cu"
            if out_dir:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / name).write_text(source)
            report = compile_cuda(source, args.target)
            tensor_cores = "mma.sync.aligned.m16n8k" in report.ptx
            print(f"  nvcc    {name}: {report.describe()}; tensor cores: {'yes' if tensor_cores else 'NO'}")
    if out_dir:
        print(f"  sources written to {out_dir}/ (compile with nvcc -I {attncc.include_dir()})")
    return 0


def tile_map(classes: torch.Tensor, limit: int = 48) -> str:
    """Tile classes of (b=0, h=0) as text: '#' full, '+' partial, '.' empty."""
    grid = classes[0, 0]
    chars = {EMPTY: ".", FULL: "#"}
    rows = ["".join(chars.get(int(c), "+") for c in row[:limit]) for row in grid[:limit]]
    return "\n".join("    " + r for r in rows)


def cmd_explain(args: argparse.Namespace) -> int:
    stages = attncc.lower(args.file, args.target)
    for stage in stages:
        print(stage.text())
        print()
    op = _fused(stages)
    shape = args.shape
    assert op.tiling is not None
    # (D's is the plan's error; a Dv of its own was planned where the kernels refuse it)
    if shape.Dv != shape.D and not 1 <= shape.Dv <= op.tiling.max_head_dim:
        raise AttnccError(
            f"--shape Dv={shape.Dv}: v's head dim must be in [1, {op.tiling.max_head_dim}] on target {args.target}"
        )
    print("// plan")
    print(plan_text(op, shape))
    kern = (
        attncc.Kernel(stages, "cpu") if args.target == "cpu" else attncc.Kernel(attncc.lower(args.file, "cpu"), "cpu")
    )
    shape = _adapted(shape, kern, args.shape_given)
    try:
        q, k, _, runtime = make_inputs(kern, shape, requires_grad=False, operands=False)
        tiles, classes = kern.forward_classes(q, k, **runtime)
    except (RuntimeError, MemoryError) as error:  # (the map of tile classes at b=0, h=0 did not fit)
        raise _too_large(shape, error) from None
    counts = {name: int((classes == value).sum()) for name, value in (("empty", 0), ("partial", 1), ("full", 2))}
    print(
        f"// tile classes at {shape} with Br={tiles.block_rows} Bc={tiles.block_cols} (b=0, h=0; # full, + partial, . empty)"
    )
    print(tile_map(classes))
    total = sum(counts.values())
    print(f"    {counts['full']} full, {counts['partial']} partial, {counts['empty']} empty of {total} tiles")
    assert op.cost is not None
    density = (counts["full"] + counts["partial"]) / max(total, 1)
    report = predict_io(op, shape, 4, tiles, density)
    print(f"// IO at {shape}, density {density:.2f}: {report.describe()}")
    if args.target != "cpu":
        gpu_kernel = EmulatedKernel(stages, args.target)  # (the lowered stages above: nothing built)
        on_gpu = torch.empty(shape.B, shape.H, shape.N, shape.D, device="meta")
        group = gpu_kernel.query_head_group(on_gpu, shape.Hkv, shape.Dv, op.dropout, None)
        heads, rows = (shape.Hkv, group * shape.N) if group > 1 else (shape.H, shape.N)
        if group > 1:
            print(
                f"// GQA decoding on {args.target}: each group's {group} query heads run as the rows of one head "
                f"(fold_query_heads: q as [B, Hkv, {group} N, D]), so each K/V tile is read once per group"
            )
        gpu_kernel.short_query_tiles = True  # as a GPU runs it (GpuKernel)
        gpu_kernel.key_split_warps = not args.no_key_split_warps
        runs = gpu_kernel.for_rows(rows, max(shape.D, shape.Dv))
        plan = runs.plan(
            torch.empty(shape.B, heads, rows, shape.D, device="meta"),
            torch.empty(shape.B, shape.Hkv, shape.M, shape.D, device="meta"),
            None,
            value_dim=shape.Dv,
        )
        forward, splits = plan.tiles, plan.kv_splits
        query_blocks, key_tiles = split_kv_blocks(shape.B, heads, rows, shape.M, forward)
        sms, resident = runs.multiprocessors(), resident_blocks(forward, GPUS[args.target])
        counted = split_kv_slots(forward, GPUS[args.target], sms) // max(1, sms)
        warps = (
            f", {forward.key_warps} warps of {forward.block_cols // forward.key_warps} keys per 16 rows"
            if forward.key_warps > 1
            else ""
        )
        print(
            f"// split-KV on {args.target} ({sms} SMs x {resident} resident blocks of {forward.block_rows} x "
            f"{forward.block_cols}{warps}, {counted} counted): {query_blocks} query blocks, {key_tiles} key tiles: "
            f"{splits} block(s) per query tile"
        )
    if args.context_parallel:
        explain_context_parallel(kern, shape, args.context_parallel, runtime)
    return 0


def explain_context_parallel(kern: attncc.Kernel, shape: Shape, world_size: int, runtime: dict[str, object]) -> None:
    """The globalized program, both layouts' chunk pairs and traffic, and the layout chosen."""
    globalized = kern.at_global_positions()
    print(f"// context parallel over {world_size} ranks: the program at global positions")
    print(globalized.stages[[s.name for s in globalized.stages].index("globalize_positions")].text())
    sizes = {"B": shape.B, "H": shape.H, "Hkv": shape.Hkv, "D": shape.D, "Dv": shape.Dv}
    try:
        plans = distributed.layout_plans(kern, world_size, shape.N, shape.M, **sizes, **runtime)  # type: ignore[arg-type]
    except attncc.InputError as e:
        print(f"// {e}")
        return
    for plan in plans:
        print(f"// {plan.describe(itemsize=4)}")
    chosen = distributed.balanced(plans)
    print(f"// chosen layout: {chosen.layout} (the smallest largest per-rank work)")


def cmd_check(args: argparse.Namespace) -> int:
    if args.target != "cpu" and not args.emulate:
        raise AttnccError(
            f"`check --target {args.target}` needs a GPU; add --emulate to run the CUDA kernel on the host emulator"
        )
    kern = attncc.compile(args.file, args.target, emulate=args.emulate)
    shapes = [args.shape] if args.shape_given else AWKWARD_SHAPES
    if args.target == "cpu":
        dtypes = args.dtype
    else:
        from attncc.codegen.cuda import storage_dtypes

        dtypes = [d for d in args.dtype if d in storage_dtypes(args.target)]
        if not dtypes:  # (float16 was checked instead, silently)
            raise AttnccError(
                f"--dtype {' '.join(args.dtype)}: the {args.target} kernels take {' and '.join(storage_dtypes(args.target))}"
            )
    backward = not args.forward_only
    failures = 0
    for given in shapes:
        shape = _adapted(given, kern, args.shape_given)
        for dtype in dtypes:
            try:
                result = check(kern, shape, DTYPES[dtype], backward=backward)
            except (RuntimeError, MemoryError) as error:
                if not _out_of_memory(error):
                    raise
                raise _too_large(shape, error) from None
            print(result.describe())
            failures += not result.ok
            if args.emulate:
                failures += not _schedules_agree(kern, shape, DTYPES[dtype])
    print(f"{args.file}: {'all ok' if not failures else f'{failures} mismatch(es)'}")
    return 1 if failures else 0


def _schedules_agree(kern: attncc.Kernel, shape: Shape, dtype: torch.dtype) -> bool:
    """The emulated kernel must give identical bits under every emulator schedule."""
    q, k, v, runtime = make_inputs(kern, shape, dtype, requires_grad=False)
    outputs = []
    for schedule in ("lockstep", "warp-greedy"):
        kern.schedule = schedule  # type: ignore[attr-defined]
        outputs.append(kern(q, k, v, seed=1, return_lse=True, **runtime))
    kern.schedule = "lockstep"  # type: ignore[attr-defined]
    same = all(torch.equal(a, b) for a, b in zip(outputs[0], outputs[1]))
    print(
        f"{'ok' if same else 'MISMATCH':8s} schedules lockstep and warp-greedy {'bit-identical' if same else 'differ'}"
    )
    return same


def _median_ms(fn, repeats: int = 5) -> float:  # noqa: ANN001 - a thunk
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def cmd_examples(args: argparse.Namespace) -> int:
    """Compile every example for the CPU, check it against eager PyTorch, print plan and timing."""
    if Path(args.directory).is_file():
        raise AttnccError(f"{args.directory}: a file; `attncc examples` takes a directory of .attn programs")
    if not Path(args.directory).is_dir():
        raise AttnccError(f"{args.directory}: no such directory")
    files = sorted(Path(args.directory).glob("*.attn"))
    if not files:
        raise AttnccError(f"{args.directory}: no .attn programs")
    failures = errors = 0
    for path in files:
        start = time.perf_counter()
        try:  # (one broken program is reported and the others still run: it stopped them all)
            kern = attncc.compile(path)
            kern.library("float32")
        except AttnccError as exc:
            print(f"== {path.name}: error\n{exc}", flush=True)
            errors += 1
            continue
        build_s = time.perf_counter() - start
        shape = adapt(Shape(2, 4, 2, 200, 200, 64), kern)
        result = check(kern, shape, torch.float32)
        failures += not result.ok
        bench = adapt(Shape(1, 8, 8, 1024, 1024, 64), kern)
        q, k, v, runtime = make_inputs(kern, bench, requires_grad=False)
        ms = _median_ms(lambda: kern(q, k, v, **runtime))  # noqa: B023 - called immediately
        print(f"== {path.name}: build/load {build_s:.2f} s, forward {ms:.1f} ms at {bench}")
        print(plan_text(_fused(kern), bench))
        print(f"  check   {result.describe()}")
    print(f"{len(files)} examples, {failures} mismatch(es)" + (f", {errors} that did not compile" if errors else ""))
    return 1 if failures or errors else 0


def cmd_prebuild(args: argparse.Namespace) -> int:
    """Build every program's libraries for the given targets, dtypes and head dims into one
    directory that a server ships and names in ATTNCC_PREBUILT_DIR (loaded there without a
    compiler; the directory may be read-only)."""
    from attncc.runtime.build import PREBUILT_ENV, prebuilding_into
    from attncc.runtime.gpu import GpuKernel

    if "cpu" in args.targets:
        check_cpu_head_dims({f"--head-dims {d}": d for d in args.head_dims})
    output = Path(args.output)
    if output.exists() and not output.is_dir():  # (mkdir's own error: "[Errno 17] File exists")
        raise AttnccError(f"attncc prebuild: -o {args.output}: exists and is not a directory")
    output.mkdir(parents=True, exist_ok=True)
    dtypes = [DTYPES[d] for d in args.dtypes]
    kv_dtypes = [getattr(torch, d) for d in args.kv_dtypes]
    every: set[Path] = set()  # (a program named twice builds its libraries once)
    with prebuilding_into(output):
        for program in args.programs:
            for target in args.targets:
                stages = attncc.lower(program, target)
                kern = attncc.Kernel(stages, target) if target == "cpu" else GpuKernel(stages, target)
                start = time.perf_counter()
                # (a context-parallel call's chunk pairs run the kernel at global positions, its own library)
                kernels = [kern, kern.at_global_positions()] if args.context_parallel else [kern]
                paths = []
                for base in kernels:
                    if target == "cpu":
                        paths += base.prebuild(dtypes, args.head_dims, kv_dtypes)
                        continue
                    # GPU: decoding's forwards too, GQA decoding's with them (the folded ones were
                    # not prebuilt before session 67: a server without nvcc could not build them)
                    for d in args.head_dims:
                        for each in base.deployed_forwards(d):
                            paths += each.prebuild(dtypes, [d], kv_dtypes, paged=args.paged)
                paths = list(dict.fromkeys(paths))  # (head dims of one plan share libraries)
                every.update(paths)
                what = "head dims " + ",".join(map(str, args.head_dims)) if target != "cpu" else "any head dim"
                print(
                    f"{program}: {target}, {len(paths)} "
                    f"{'library' if len(paths) == 1 else 'libraries'} ({what}) in {time.perf_counter() - start:.1f} s"
                )
    print(f"{len(every)} libraries in {output}/; where the kernels run, set {PREBUILT_ENV}={output.resolve()}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """What the kernel cache holds (libraries, their objects, precompiled preambles), or clear
    or trim it."""
    from attncc.runtime.build import (
        CACHE_LIMIT_ENV,
        PRECOMPILED_DIR,
        TRIM_SPARES_SECONDS,
        cache_dir,
        cache_entries,
        trim_cache,
    )

    root = cache_dir()
    if args.trim is not None or args.clear:
        # Only attncc's entries (kernels' and precompiled preambles' directories, by their names)
        # go: an ATTNCC_CACHE_DIR shared with other files lost them all. Safe beside running
        # processes: a loaded library stays mapped; the next call rebuilds.
        if args.trim is not None and not 0 <= args.trim < math.inf:  # (inf: an OverflowError from int())
            raise AttnccError(f"--trim: expected a finite number of megabytes >= 0, got {args.trim}")
        limit, spare = (0, 0.0) if args.clear else (int(args.trim * 1e6), TRIM_SPARES_SECONDS)
        removed, freed = trim_cache(limit, spare_seconds=spare)
        kept = len(cache_entries()) if args.clear else 0
        if kept:  # (rmtree's failures were reported as removed)
            raise AttnccError(
                f"attncc cache --clear: {kept} entries of {root} could not be removed (being built by another "
                "process, or read-only)"
            )
        what = "entries" if args.clear else "least recently used entries"
        print(f"removed {removed} {what} ({freed / 1e6:.1f} MB) from {root}")
        return 0
    sizes: dict[str, list[int]] = {"libraries": [], "objects": [], "precompiled preambles": []}
    for path in root.rglob("*") if root.is_dir() else ():
        if path.is_file() and not path.is_symlink():
            kind = (
                "precompiled preambles" if PRECOMPILED_DIR in path.parts and path.suffix == ".gch"
                else "libraries" if path.name == "kernel.so" else "objects" if path.suffix == ".o" else ""
            )  # fmt: skip
            if kind:
                sizes[kind].append(path.stat().st_size)
    print(f"{root}:")
    for kind, found in sizes.items():
        print(f"  {len(found):6d} {kind:22s} {sum(found) / 1e6:10.1f} MB")
    print(
        "`attncc cache --clear` removes it all, `--trim MB` the least recently used entries down to MB (kernels "
        f"rebuild on their next call); {CACHE_LIMIT_ENV}=MB trims after every build"
    )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from attncc.runtime.profile import profile, ptxas_registers, report_text, scaled

    if not args.emulate:
        raise AttnccError(
            f"profile counts what the CUDA emulator executes for --target {args.target}: add --emulate "
            "(no GPU runs here)"
        )
    kern = attncc.compile(args.file, args.target, emulate=True)
    shape = _adapted(args.shape, kern, args.shape_given)
    dtype = DTYPES[args.dtype]
    counts = profile(kern, shape, dtype, backward=not args.forward_only)
    if args.batch_heads:
        counts = scaled(counts, shape, *args.batch_heads)
    storage = str(kern.storage_dtype(dtype)).removeprefix("torch.")
    assert kern.op.tiling is not None
    source = kern.cuda_source(storage, kern.op.tiling.for_head_dim(shape.D).head_dim)
    print(f"// {args.file} at {shape}" + (f", scaled to B x H = {args.batch_heads}" if args.batch_heads else ""))
    print(report_text(counts, args.target, source, ptxas_registers(kern, dtype, shape.D), top=args.lines))
    return 0


def _pair(text: str) -> tuple[int, int]:
    try:
        b, h = (int(x) for x in text.split(","))
        return b, h
    except ValueError:
        raise argparse.ArgumentTypeError("expected B,H such as 4,16") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attncc", description="Compile attention variants to fused kernels.")
    sub = parser.add_subparsers(dest="command", required=True)
    default_shape = Shape(1, 8, 8, 2048, 2048, 64)

    p = sub.add_parser("compile", help="emit sources, build, print the plan")
    p.add_argument("file")
    p.add_argument("--target", default="cpu")
    p.add_argument("-o", "--output", help="write the generated sources here")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--shape", type=_shape, default=default_shape, help="B,H,Hkv,N,M,D[,Dv] for the traffic estimate")
    p.add_argument(
        "--head-dim",
        type=_positive,
        nargs="+",
        default=[64, 128],
        help="head dims to emit for GPU targets (cpu: one library takes every head dim up to 576)",
    )
    p.set_defaults(fn=cmd_compile)

    p = sub.add_parser("explain", help="IR after each pass, tile classes, IO report")
    p.add_argument("file")
    p.add_argument("--target", default="cpu")
    p.add_argument("--shape", type=_shape, default=Shape(1, 1, 1, 1024, 1024, 64))
    p.add_argument("--context-parallel", type=_positive, metavar="P", help="chunk pairs and ring traffic over P ranks")
    p.add_argument(
        "--no-key-split-warps",
        action="store_true",
        help="GPU targets: calls of <= 32 query rows on the 64-row forward (kern.key_split_warps = False)",
    )
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("check", help="compare forward and backward against eager float64")
    p.add_argument("file")
    p.add_argument("--target", default="cpu")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--shape", type=_shape, default=None, help="one shape B,H,Hkv,N,M,D[,Dv] instead of the awkward set")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--emulate", action="store_true", help="run a GPU target's CUDA kernel on the host emulator")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("prebuild", help="build kernels ahead of time into a directory a server ships")
    p.add_argument("programs", nargs="+", metavar="PROGRAM")
    p.add_argument("--targets", nargs="+", default=["cpu"], choices=["cpu", *GPUS])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--kv-dtypes", nargs="+", default=[], choices=list(KV_FORMATS), help="fp8 K/V: their forwards too")
    p.add_argument("--head-dims", type=_positive, nargs="+", default=[64, 128], help="head dims for GPU targets")
    p.add_argument("--paged", action="store_true", help="GPU targets: the forwards of paged calls (Kernel.paged) too")
    p.add_argument(
        "--context-parallel", action="store_true", help="the kernels of context-parallel calls (ring attention) too"
    )
    p.add_argument("-o", "--output", required=True, help="the directory to fill")
    p.set_defaults(fn=cmd_prebuild)

    p = sub.add_parser("profile", help="performance counters of the CUDA kernels on the emulator, roofline estimate")
    p.add_argument("file")
    p.add_argument("--target", default="sm80", choices=list(GPUS))
    p.add_argument("--emulate", action="store_true", help="required: the counters come from the host emulator")
    p.add_argument("--shape", type=_shape, default=Shape(1, 1, 1, 1024, 1024, 64), help="B,H,Hkv,N,M,D[,Dv] to emulate")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--forward-only", action="store_true")
    p.add_argument(
        "--batch-heads", type=_pair, default=None, metavar="B,H",
        help="estimate for B x H: the emulated sequences' counts repeated (programs whose work is alike per (b, h))",
    )  # fmt: skip
    p.add_argument("--lines", type=_count, default=8, help="costliest source lines to show per kernel")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("cache", help="what the kernel cache holds, or clear it")
    either = p.add_mutually_exclusive_group()  # (with both, --clear was ignored silently)
    either.add_argument("--clear", action="store_true", help="remove the whole cache")
    either.add_argument(
        "--trim", type=float, default=None, metavar="MB", help="remove the least recently used entries down to MB"
    )
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("examples", help="compile, check and time every example")
    p.add_argument("directory", nargs="?", default=str(EXAMPLES_DIR))
    p.set_defaults(fn=cmd_examples)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.shape_given = getattr(args, "shape", None) is not None
    if getattr(args, "shape", None) is None:
        args.shape = AWKWARD_SHAPES[0]
    try:
        code = args.fn(args)
        if sys.stdout is not None:  # (None where started with stdout closed: `attncc explain ... >&-`)
            sys.stdout.flush()  # (here: a reader gone before the interpreter's own flush at exit is a BrokenPipeError)
        return code
    except AttnccError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except BrokenPipeError:  # (`attncc explain ... | head`: the reader left; quiet, as other tools are)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # (an output directory that cannot be made or written)
        print(f"attncc {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
