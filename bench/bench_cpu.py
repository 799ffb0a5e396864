"""CPU benchmark: attncc against torch SDPA, eager attention and FlexAttention, side by side.

Every comparison runs in this one process on the same inputs; each time is the median of
`--repeats` runs after a warm-up, and the table prints ratios (anchor time / attncc time, so
> 1 means attncc is faster). The grid's dense cases alternate attncc and its anchors within each
repeat, in batches of calls of about 5 ms (a noisy machine's drift falls on both alike; single
sub-millisecond calls swing by 10-20% there). Memory is the peak resident-set growth of a fresh
subprocess.

    python bench/bench_cpu.py                 # everything (FlexAttention compiles for ~1 min)
    python bench/bench_cpu.py --quick --no-flex
    python bench/bench_cpu.py --sweep         # tile sizes for the dense forward
    python bench/bench_cpu.py --grid --json bench/results/cpu-<family>.json
                                              # the issue's targets: N = 512..16K, D = 64/128, fp32/bf16,
                                              # fwd and fwd+bwd, decoding, masked variants; % of the
                                              # machine's peak (bench/peak_cpu.py) and of the GEMM rate
                                              # measured here; a PNG plot beside the JSON
    python bench/bench_cpu.py --serving --no-flex --json bench/results/cpu-<family>-serving.json
                                              # packed (varlen) vs SDPA on the padded batch, paged decoding
    python bench/bench_cpu.py --models --no-flex --json bench/results/cpu-<family>-models.json
                                              # issue 12's features: MLA's D=192, Dv=128; rope in the
                                              # kernel; fp8 K/V (--fp8: those alone)
    python bench/bench_cpu.py --flex-api --long-n 4096 --json bench/results/cpu-<family>-flex-api.json
    python bench/bench_cpu.py --flash-api --long-n 4096 --json bench/results/cpu-<family>-flash-api.json
    python bench/bench_cpu.py --sdpa-api --long-n 4096 --json bench/results/cpu-<family>-sdpa-api.json
                                              # FlexAttention's calls (score_mod, block_mask) on attncc
    python bench/bench_cpu.py --fp16 --no-flex --max-n 4096 --max-n-backward 2048 --json bench/results/cpu-<family>-fp16.json
                                              # fp16 inputs: the forward on the bf16 unit as bf16 terms

The JSON's meta records the CPU model, its ISA features and the kernel ISA attncc chose (set
ATTNCC_CPU_ISA to measure another level the machine runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
# child processes find this checkout first, then the caller's path (the device machine's lark)
ROOT_FIRST_PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc.runtime.kernel import PackedSequences  # noqa: E402
from bench.peak_cpu import peak_rates  # noqa: E402

EX = ROOT / "examples"


def median_s(fn, repeats: int) -> float:
    start = time.perf_counter()
    fn()  # warm-up (and build)
    if time.perf_counter() - start > 2.0:  # long runs: 3 repeats keep the grid within minutes
        repeats = min(repeats, 3)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cpu_meta() -> dict:
    """The machine and the kernel ISA attncc chose on it."""
    from attncc.passes.tiling import choose_micro_kernel
    from attncc.targets import cpu

    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "vendor_id", "cpu family", "model") and key.strip() not in info:
            info[key.strip()] = value.strip()
    target = cpu()
    return {
        "cpu_model": info.get("model name", platform.processor()),
        "cpu_vendor": info.get("vendor_id", ""),
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "cpu_features": list(target.features),
        "attncc_isa": choose_micro_kernel(target).describe(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def gemm_rates(repeats: int) -> dict[str, float]:
    """torch.mm GFLOP/s at 2048^3 in fp32 and bf16, measured in this process (the yardstick for
    the attention rates)."""
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        rates[str(dtype).removeprefix("torch.")] = 2 * 2048**3 / median_s(lambda a=a, b=b: a @ b, repeats) / 1e9
    return rates


def eager(q, k, v, mask=None, scale=None):
    s = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def fwd_bwd(fn, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    return run


class Flex:
    """FlexAttention compiled for the CPU (forward only: its CPU backward is not implemented)."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # one compilation per shape and mask: beyond dynamo's default 8, Flex would fall back to
        # its unfused eager implementation and the grid would time that instead
        torch._dynamo.config.recompile_limit = 64
        self.create_block_mask = create_block_mask
        self.fn = torch.compile(flex_attention, dynamic=False)

    def __call__(self, q, k, v, mask_mod=None):
        block_mask = None
        if mask_mod is not None:
            block_mask = self.create_block_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device="cpu")
        return lambda: self.fn(q, k, v, block_mask=block_mask)


def duration(seconds: float) -> str:
    """`seconds` as ms with one decimal, or us below 1 ms (host-bound calls)."""
    return f"{seconds * 1e3:8.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:8.1f} us"


class SavedRows(list):
    """The rows measured so far, written to the JSON file (when one is asked for) as each is
    added: a run cut off by a time limit (gpu_session.sh's `cpu` mode on a lease host; session
    64's grid stopped at its limit with no JSON) keeps what it measured."""

    def __init__(self, path: Path | None, meta: dict) -> None:
        super().__init__()
        self.path, self.meta = path, meta
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, item: object) -> None:
        super().append(item)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps({"meta": self.meta, "results": list(self)}, indent=1))


def row(results: list, name: str, attncc_s: float, anchors: dict[str, float], extra: str = "") -> None:
    ratios = "  ".join(f"{k} {duration(v)} ({v / attncc_s:5.2f}x)" for k, v in anchors.items())
    line = f"{name:44s} attncc {duration(attncc_s)}  {ratios} {extra}"
    print(line, flush=True)
    results.append({"case": name, "attncc_s": attncc_s, **{f"{k}_s": v for k, v in anchors.items()}, "note": extra})


def two_pass(kern, fn, repeats: int) -> float:
    """The same call with the backward forced into its two passes (dK/dV, then dQ)."""
    kern.backward = "two-pass"
    try:
        return median_s(fn, repeats)
    finally:
        kern.backward = "auto"


def dense_cases(results: list, args, flex) -> None:
    B, H, N, D = 1, 8, 2048, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))
    vanilla, causal = attncc.compile(EX / "vanilla.attn"), attncc.compile(EX / "causal.attn")
    r = args.repeats
    anchors = {
        "sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v), r),
        "eager": median_s(lambda: eager(q, k, v), r),
    }
    if flex:
        anchors["flex"] = median_s(flex(q, k, v), r)
    row(results, f"dense fwd fp32 B={B} H={H} N={N} D={D}", median_s(lambda: vanilla(q, k, v), r), anchors)
    causal_mask = torch.ones(N, N, dtype=torch.bool).tril()
    anchors = {
        "sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), r),
        "eager": median_s(lambda: eager(q, k, v, causal_mask), r),
    }
    if flex:
        anchors["flex"] = median_s(flex(q, k, v, lambda b, h, i, j: j <= i), r)
    row(results, f"causal fwd fp32 N={N}", median_s(lambda: causal(q, k, v), r), anchors)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    anchors = {
        "sdpa": median_s(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), qg, kg, vg), r),
        "eager": median_s(fwd_bwd(eager, qg, kg, vg), r),
        "attncc_two_pass_bwd": two_pass(vanilla, fwd_bwd(vanilla, qg, kg, vg), r),
    }
    row(results, f"dense fwd+bwd fp32 N={N}", median_s(fwd_bwd(vanilla, qg, kg, vg), r), anchors)
    anchors = {
        "sdpa": median_s(
            fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), qg, kg, vg), r
        ),
        "eager": median_s(fwd_bwd(lambda a, b, c: eager(a, b, c, causal_mask), qg, kg, vg), r),
        "attncc_two_pass_bwd": two_pass(causal, fwd_bwd(causal, qg, kg, vg), r),
    }
    row(results, f"causal fwd+bwd fp32 N={N}", median_s(fwd_bwd(causal, qg, kg, vg), r), anchors)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    anchors = {"sdpa": median_s(lambda: F.scaled_dot_product_attention(qb, kb, vb), r)}
    row(results, f"dense fwd bf16 N={N}", median_s(lambda: vanilla(qb, kb, vb), r), anchors)


def decode_cases(results: list, args) -> None:
    """One query per sequence against a long K/V (a KV-cache step): memory-bound, N < 4 rows."""
    vanilla = attncc.compile(EX / "vanilla.attn")
    gen = torch.Generator().manual_seed(0)
    for B, H, M, D in ((1, 32, 8192, 128), (8, 32, 4096, 128)):
        q = torch.randn(B, H, 1, D, generator=gen)
        k, v = (torch.randn(B, H, M, D, generator=gen) for _ in range(2))
        anchors = {"sdpa": median_s(partial(F.scaled_dot_product_attention, q, k, v), args.repeats)}
        ours = median_s(partial(vanilla, q, k, v), args.repeats)
        row(results, f"decode fwd fp32 B={B} H={H} N=1 M={M} D={D}", ours, anchors)


def flex_api_cases(results: list, args, flex) -> None:
    """FlexAttention's own calls on attncc (`attncc.integrations.flex.flex_attention`: the score
    and mask functions traced into a program on every call) against torch's compiled
    flex_attention with the same functions and a BlockMask made once, SDPA with the mask as a
    dense bool [N, N] where there is no score function, and the traced program's kernel called
    directly (what the tracing costs per call). B=1 H=8 D=64, forward; fp32 and bf16."""
    slopes = torch.tensor([2.0 ** (-(h + 1)) for h in range(8)])

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    def window_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 30) * 30

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    cases = [("softcap causal", softcap, causal), ("alibi causal", alibi, causal),
             ("document causal", None, document_causal), ("window 256 causal", None, window_causal)]  # fmt: skip
    for N, dtype, (label, score_mod, mask_mod) in itertools.product(
        (2048, args.long_n), (torch.float32, torch.bfloat16), cases
    ):
        docs = torch.arange(N) * 4 // N  # four documents of equal length (at --long-n, N=2048 read past it)
        seconds = flex_api_times(N, dtype, score_mod, mask_mod, flex, args.repeats)
        row(results, f"flex api {label} {str(dtype)[6:]} N={N}", seconds.pop("attncc-flex"), seconds)


def flex_api_times(N: int, dtype: torch.dtype, score_mod, mask_mod, flex, repeats: int) -> dict[str, float]:
    """Alternating medians of one flex_api_cases case: name -> seconds."""
    from attncc.integrations.flex import flex_attention

    q, k, v = (torch.randn(1, 8, N, 64).to(dtype) for _ in range(3))
    program = attncc.flex_program(score_mod, mask_mod)
    kern = attncc.compile(program.source)
    calls = {
        "attncc-flex": lambda: flex_attention(q, k, v, score_mod, mask_mod=mask_mod),
        "kernel": lambda: kern(q, k, v, **program.inputs),
    }
    if flex is not None:
        block_mask = flex.create_block_mask(mask_mod, 1, 1, N, N, device="cpu")
        calls["flex"] = lambda: flex.fn(q, k, v, score_mod=score_mod, block_mask=block_mask)
    if score_mod is None:
        positions = torch.arange(N)
        keep = mask_mod(0, 0, positions[:, None], positions[None, :])
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return dict(zip(calls, alternating_medians(list(calls.values()), repeats)))


def flash_api_cases(results: list, args) -> None:
    """FlashAttention's calls on attncc (`attncc.integrations.flash_attn`: q, k, v [B, N, H, D],
    the program made from the call's options) against the program's kernel called directly on
    [B, H, N, D] views (what the wrapper costs: its checks and the output's copy to [B, N, H, D])
    and SDPA on the same views (is_causal; a window as a dense bool mask; none for softcap).
    B=1 H=8 Hkv=8 D=64, forward; fp32 and bf16; N = 2048 and --long-n."""
    from attncc.integrations.flash_attn import _kernel, _options_and_inputs, flash_attn_func

    cases = [("causal", {"causal": True}), ("window 256 causal", {"causal": True, "window_size": (255, 0)}),
             ("softcap 30 causal", {"causal": True, "softcap": 30.0})]  # fmt: skip
    for N, dtype, (label, options) in itertools.product((2048, args.long_n), (torch.float32, torch.bfloat16), cases):
        q, k, v = (torch.randn(1, N, 8, 64).to(dtype) for _ in range(3))
        made, inputs = _options_and_inputs(
            q, 1, 8, 0.0, True, options.get("window_size", (-1, -1)), options.get("softcap", 0.0), None
        )  # fmt: skip
        kern = _kernel(made, q.device)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        calls = {
            "attncc-flash": partial(flash_attn_func, q, k, v, **options),
            "kernel": partial(kern, qt, kt, vt, **inputs),
        }
        if "window_size" in options:  # (SDPA with the window as a dense bool mask)
            i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
            keep = (j <= i) & (i - j <= options["window_size"][0])
            calls["sdpa"] = partial(F.scaled_dot_product_attention, qt, kt, vt, attn_mask=keep)
        elif "softcap" not in options:
            calls["sdpa"] = partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
        seconds = dict(zip(calls, alternating_medians(list(calls.values()), args.repeats)))
        row(results, f"flash api {label} {str(dtype)[6:]} N={N}", seconds.pop("attncc-flash"), seconds)


def sdpa_api_cases(results: list, args) -> None:
    """torch's SDPA call on attncc (`attncc.integrations.sdpa.scaled_dot_product_attention`, the
    same arguments) against torch's SDPA: is_causal, a bool mask (a 256-key causal window as a
    dense [N, N] bool) and a float mask ([N, N] ALiBi-like bias). B=1 H=8 D=64, forward; fp32
    and bf16; N = 2048 and --long-n."""
    from attncc.integrations.sdpa import scaled_dot_product_attention

    for N, dtype in itertools.product((2048, args.long_n), (torch.float32, torch.bfloat16)):
        q, k, v = (torch.randn(1, 8, N, 64).to(dtype) for _ in range(3))
        i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
        window = (j <= i) & (i - j < 256)
        bias = (-(i - j).abs() * 0.01).to(dtype)
        for label, options in (("is_causal", {"is_causal": True}), ("bool window 256", {"attn_mask": window}),
                               ("float bias", {"attn_mask": bias})):  # fmt: skip
            calls = [partial(scaled_dot_product_attention, q, k, v, **options),
                     partial(F.scaled_dot_product_attention, q, k, v, **options)]  # fmt: skip
            ours, sdpa = alternating_medians(calls, args.repeats)
            row(results, f"sdpa api {label} {str(dtype)[6:]} N={N}", ours, {"sdpa": sdpa})


def sparse_cases(results: list, args, flex) -> None:
    B, H, N, D = 1, 8, args.long_n, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))
    r = max(3, args.repeats // 2)
    vanilla = attncc.compile(EX / "vanilla.attn")
    dense_s = median_s(lambda: vanilla(q, k, v), r)
    row(
        results,
        f"dense fwd fp32 N={N} (baseline for sparsity)",
        dense_s,
        {"sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v), r)},
    )
    window = attncc.compile(EX / "sliding_window.attn")
    classes = window.tile_classes(q, k)
    density = (classes != 0).float().mean().item()
    i = torch.arange(N).view(-1, 1)
    j = torch.arange(N).view(1, -1)
    bool_mask = (j <= i) & (i - j < 256)
    anchors = {"sdpa+mask": median_s(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), r)}
    if flex:
        anchors["flex"] = median_s(flex(q, k, v, lambda b, h, i, j: (j <= i) & (i - j < 256)), r)
    t = median_s(lambda: window(q, k, v), r)
    row(
        results,
        f"sliding window 256 fwd N={N}",
        t,
        anchors,
        f"tiles {density:.3f} of dense, time {t / dense_s:.3f} of dense",
    )
    butterfly = attncc.compile(EX / "blocksparse_butterfly.attn")
    density = (butterfly.tile_classes(q, k) != 0).float().mean().item()
    t = median_s(lambda: butterfly(q, k, v), r)
    row(
        results,
        f"butterfly block-sparse fwd N={N}",
        t,
        {},
        f"tiles {density:.3f} of dense, time {t / dense_s:.3f} of dense",
    )


MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, torch, attncc
    def rss_kb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])
    which, N = sys.argv[1], int(sys.argv[2])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, N, 64, generator=gen).requires_grad_() for _ in range(3))
    kern = attncc.compile(sys.argv[3])
    if which == "attncc":
        fn = lambda: kern(q, k, v)
    elif which == "sdpa":
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = torch.ones(N, N, dtype=torch.bool).tril()
        fn = lambda: torch.softmax((q @ k.transpose(-1, -2) / 8).masked_fill(~mask, float("-inf")), -1) @ v
    fn().sum().backward()  # build, warm up allocators
    q.grad = k.grad = v.grad = None
    base = rss_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    fn().sum().backward()
    print((rss_kb("VmHWM") - base) / 1024)
    """
)


MEMORY_RUNS = (("attncc", 8192), ("sdpa", 8192), ("attncc", 4096), ("eager", 4096))
MEMORY_GRID = tuple(
    (which, n)
    for n in (1024, 2048, 4096, 8192)
    for which in ("attncc", "sdpa", "eager")
    if which != "eager" or n <= 4096
)


def memory_cases(results: list, args, runs: tuple = MEMORY_RUNS) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT_FIRST_PYTHONPATH)
    for which, n in runs:
        proc = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, which, str(n), str(EX / "causal.attn")],
            capture_output=True,
            text=True,
            env=env,
        )
        mb = float(proc.stdout.strip() or "nan")
        grads = 3 * 8 * n * 64 * 4 / 2**20
        line = f"peak extra memory causal fwd+bwd {which:6s} N={n}: {mb:8.1f} MiB (q/k/v grads alone {grads:.0f} MiB; one N x N fp32 {8 * n * n * 4 / 2**20:.0f} MiB)"
        print(line, flush=True)
        results.append(
            {
                "case": f"memory {which} N={n}",
                "which": which,
                "N": n,
                "peak_extra_mib": mb,
                "stderr": proc.stderr[-300:],
            }
        )


def build_cases(results: list) -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, ATTNCC_CACHE_DIR=cache, PYTHONPATH=ROOT_FIRST_PYTHONPATH)
        script = "import sys, time, attncc\nt = time.perf_counter()\nk = attncc.compile(sys.argv[1])\nk.library('float32')\nprint(time.perf_counter() - t)"
        for label in ("cold build", "cached load (new process)"):
            proc = subprocess.run(
                [sys.executable, "-c", script, str(EX / "alibi.attn")], capture_output=True, text=True, env=env
            )
            seconds = float(proc.stdout.strip() or "nan")
            print(
                f"{label:28s} alibi fp32: {seconds:.2f} s (compile + pipeline, excluding Python start-up)", flush=True
            )
            results.append({"case": label, "seconds": seconds})


def padded_lengths(batch: int, longest: int, padding: float) -> list[int]:
    """Sequence lengths, evenly spread, that leave `padding` of the padded batch empty."""
    low = 1.0 - 2.0 * padding  # lengths from low..1 of the longest, mean 1 - padding
    return [max(1, round(longest * (low + (1.0 - low) * (b + 0.5) / batch))) for b in range(batch)]


def alternating_medians(fns: list, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, timed in turn within every repeat (a noisy machine's
    drift falls on all of them alike), the order rotated each repeat: on the Sapphire
    Rapids-class Xeon whichever kernel ran right after SDPA was ~4% slower (session 30: two
    attncc tilings traded places when their order was swapped), so none always follows the same."""
    for fn in fns:
        fn()  # warm-up (and build)
    times: list[list[float]] = [[] for _ in fns]
    for repeat in range(repeats):
        for index in range(len(fns)):
            turn = (index + repeat) % len(fns)
            start = time.perf_counter()
            fns[turn]()
            times[turn].append(time.perf_counter() - start)
    return [sorted(kept)[len(kept) // 2] for kept in times]


def batched(fn: Callable[[], object], seconds: float = 5e-3, most: int = 20) -> tuple[Callable[[], None], int, float]:
    """`fn` repeated enough times per call to take about `seconds` (at most `most`), that count,
    and the seconds one call of `fn` took: a noisy machine's timer and scheduler jitter swamp
    single sub-millisecond calls."""
    fn()  # (build, warm-up)
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    calls = max(1, min(most, round(seconds / max(once, 1e-6))))

    def run() -> None:
        for _ in range(calls):
            fn()

    return run, calls, once


def alternating_per_call(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds per call of each of `fns` (name -> callable), alternating batches of calls of
    each within every repeat (alternating_medians), the median per call; 3 repeats where a
    call takes over 2 s (as median_s)."""
    runs = {name: batched(fn) for name, fn in fns.items()}
    if max(once for _, _, once in runs.values()) > 2.0:
        repeats = min(repeats, 3)
    medians = alternating_medians([run for run, _, _ in runs.values()], repeats)
    return {name: median / calls for (name, (_, calls, _)), median in zip(runs.items(), medians)}


def short_cases(results: list, args) -> None:
    """Many short sequences (a padded batch of 1024 tokens per head, N = M = 16 .. 128, H=8
    D=64): key tiles fitted to the key count (TilePlan.for_few_keys), against SDPA; fp32 and
    bf16, dense and causal, forward and forward+backward. Then one short sequence (B=1 H=8
    N = M = 16 .. 256 D=64, dense), where the host's work per call (checks, autograd, kept
    launches) is most of the time."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(program, 1024 // n, n) for program in ("vanilla", "causal") for n in (16, 32, 64, 128)]
    shapes += [("vanilla", 1, n) for n in (16, 64, 256)]
    for program, batch, n in shapes:
        kern = attncc.compile(EX / f"{program}.attn")
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(batch, 8, n, 64, generator=gen).to(dtype) for _ in range(3))

            def sdpa(q_, k_, v_, causal=program == "causal"):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)

            name = f"short {program} {str(dtype).removeprefix('torch.')} B={batch} H=8 N=M={n} D=64"
            # (batches of calls, the median per call: single sub-millisecond calls are jitter)
            times = alternating_per_call(
                {"attncc": partial(kern, q, k, v), "sdpa": partial(sdpa, q, k, v)}, args.repeats
            )
            row(results, f"{name} fwd", times["attncc"], {"sdpa": times["sdpa"]})
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            times = alternating_per_call(
                {"attncc": fwd_bwd(kern, *leaves), "sdpa": fwd_bwd(sdpa, *leaves)}, args.repeats
            )
            row(results, f"{name} fwd+bwd", times["attncc"], {"sdpa": times["sdpa"]})
    short_packed_cases(results, args)


def short_packed_cases(results: list, args) -> None:
    """Small packed batches (causal, H=8 D=64, 4 sequences of 64 tokens in all and 16 of 8..64),
    where the host's work per call is most of the time: varlen through an `attncc.plan_varlen`
    plan (calls repeating a checked one repeat its kept launches, forward and backward) against
    SDPA and attncc on the padded batch (SDPA with the key padding and causal mask) and varlen
    given the offsets each call (read and checked per call)."""
    gen = torch.Generator().manual_seed(6)
    kern = attncc.compile(EX / "causal.attn")
    for lens in ([16, 24, 8, 16], [8 + (b * 37) % 57 for b in range(16)]):
        batch, longest, total = len(lens), max(lens), sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        plan = attncc.plan_varlen(cu, cu)
        keys = torch.arange(longest).view(1, -1) < torch.tensor(lens).view(-1, 1)
        mask = keys.view(batch, 1, 1, longest) & torch.ones(longest, longest, dtype=torch.bool).tril()
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(total, 8, 64, generator=gen).to(dtype) for _ in range(3))
            padded = [torch.randn(batch, 8, longest, 64, generator=gen).to(dtype) for _ in range(3)]

            def sdpa(q_, k_, v_, mask=mask):
                return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)

            def planned(q_, k_, v_, plan=plan):
                return kern.varlen(q_, k_, v_, plan=plan)

            def offsets(q_, k_, v_, cu=cu):
                return kern.varlen(q_, k_, v_, cu, cu)

            tag = str(dtype).removeprefix("torch.")
            name = f"short packed causal {tag} B={batch} H=8 {total} tokens D=64"
            note = f"lengths {min(lens)}..{longest}"
            runs = {
                "attncc": partial(planned, q, k, v), "varlen_offsets": partial(offsets, q, k, v),
                "attncc_padded": partial(kern, *padded), "sdpa_padded": partial(sdpa, *padded),
            }  # fmt: skip
            times = alternating_per_call(runs, args.repeats)
            row(results, f"{name} fwd", times.pop("attncc"), times, note)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            padded_leaves = [t.clone().requires_grad_() for t in padded]
            runs = {
                "attncc": fwd_bwd(planned, *leaves), "varlen_offsets": fwd_bwd(offsets, *leaves),
                "attncc_padded": fwd_bwd(kern, *padded_leaves), "sdpa_padded": fwd_bwd(sdpa, *padded_leaves),
            }  # fmt: skip
            times = alternating_per_call(runs, args.repeats)
            row(results, f"{name} fwd+bwd", times.pop("attncc"), times, note)


def backward_with(kern, mode: str, q, k, v, dout) -> object:
    """A grad-recording call of `kern` and its backward with `kern.backward = mode`."""
    kern.backward = mode
    try:
        return torch.autograd.grad(kern(q, k, v), (q, k, v), dout)
    finally:
        kern.backward = "auto"


def kv_heads_cases(results: list, args) -> None:
    """Training with few kv heads (B=1 H=8, MQA and GQA 8/2, N = 512 and 2048, D = 64 and 128,
    fp32 and bf16, dense and causal): forward+backward against SDPA (enable_gqa), and the
    backward alone against attncc's own two-pass backward. With fewer (b, kv head) tasks than
    twice the threads the fused backward cuts each into key chunks (`Kernel.backward_passes`)."""
    gen = torch.Generator().manual_seed(9)
    for program in ("vanilla", "causal"):
        kern = attncc.compile(EX / f"{program}.attn")

        def sdpa(q_, k_, v_, causal=program == "causal"):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=True)

        for dtype, hkv, n, d in itertools.product((torch.float32, torch.bfloat16), (1, 2), (512, 2048), (64, 128)):
            q = torch.randn(1, 8, n, d, generator=gen).to(dtype).requires_grad_()
            k, v = (torch.randn(1, hkv, n, d, generator=gen).to(dtype).requires_grad_() for _ in range(2))
            passes, chunks = kern.backward_passes(kern.plan(q, k, None, backward=True))
            tag = f"{len(passes)} pass{'es' if len(passes) > 1 else ''}, {chunks} key chunk{'s' if chunks > 1 else ''}"
            name = f"kv heads {program} {str(dtype).removeprefix('torch.')} H=8/{hkv} N={n} D={d}"
            times = alternating_per_call(
                {"attncc": fwd_bwd(kern, q, k, v), "sdpa": fwd_bwd(sdpa, q, k, v)}, args.repeats
            )
            row(results, f"{name} fwd+bwd", times["attncc"], {"sdpa": times["sdpa"]}, tag)
            dout = torch.randn_like(q)
            runs = {mode: partial(backward_with, kern, mode, q, k, v, dout) for mode in ("auto", "two-pass")}
            times = alternating_per_call(runs, args.repeats)
            row(results, f"{name} fwd+bwd, two-pass backward", times["auto"], {"two-pass": times["two-pass"]}, tag)
    packed_kv_heads_cases(results, args)


def packed_kv_heads_cases(results: list, args) -> None:
    """Packed batches whose (sequence, kv head) tasks are few or unequal (causal MQA, H=8 D=64):
    forward+backward with the backward's choice (`packed_key_chunks`) against the same call
    with the fused pass forced unchunked (the choice before session 45 where tasks were two per
    thread) and the two passes, and against SDPA on the padded batch with its mask."""
    gen = torch.Generator().manual_seed(10)
    kern = attncc.compile(EX / "causal.attn")
    for lens, dtype in itertools.product(
        ([2048, 64, 64, 64], [1024, 1024, 1024], [2048]), (torch.float32, torch.bfloat16)
    ):
        batch, longest, total = len(lens), max(lens), sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(total, 8, 64, generator=gen).to(dtype).requires_grad_()
        k, v = (torch.randn(total, 1, 64, generator=gen).to(dtype).requires_grad_() for _ in range(2))
        dout = torch.randn_like(q)
        view = PackedSequences.of(cu.tolist(), cu.tolist(), torch.device("cpu"))
        batch_q, batch_k = view.as_batch(q.detach(), False), view.as_batch(k.detach(), True)
        passes, chunks = kern.backward_passes(kern.plan(batch_q, batch_k, None, backward=True), lengths=view.lengths)
        tag = f"{len(passes)} pass{'es' if len(passes) > 1 else ''}, {chunks} key chunk{'s' if chunks > 1 else ''}"

        def step(mode: str, q=q, k=k, v=v, cu=cu, dout=dout) -> None:
            chosen = attncc.Kernel.backward_passes
            forced = {
                "fused, unchunked": (("attncc_backward_fused",), 1),
                "two-pass": (("attncc_backward_dkdv", "attncc_backward_dq"), 1),
            }
            if mode in forced:
                attncc.Kernel.backward_passes = lambda *a, **kw: forced[mode]
            try:  # (seed=: the full path each call, so the forced choice is taken)
                torch.autograd.grad(kern.varlen(q, k, v, cu, cu, seed=0), (q, k, v), dout)
            finally:
                attncc.Kernel.backward_passes = chosen

        padded = [torch.zeros(batch, heads, longest, 64, dtype=dtype, requires_grad=True) for heads in (8, 1, 1)]
        keys = torch.arange(longest).view(1, -1) < torch.tensor(lens).view(-1, 1)
        mask = keys.view(batch, 1, 1, longest) & torch.ones(longest, longest, dtype=torch.bool).tril()

        def sdpa(padded=padded, mask=mask) -> None:
            out = F.scaled_dot_product_attention(*padded, attn_mask=mask, enable_gqa=True)
            torch.autograd.grad(out, padded, torch.ones_like(out))

        runs = {mode: partial(step, mode) for mode in ("auto", "fused, unchunked", "two-pass")}
        times = alternating_per_call({**runs, "sdpa_padded": sdpa}, args.repeats)
        name = f"packed MQA causal {str(dtype).removeprefix('torch.')} H=8/1 lengths {lens} D=64 fwd+bwd"
        row(results, name, times.pop("auto"), times, tag)


def fp16_cases(results: list, args) -> None:
    """fp16 inputs (B=1 H=8, dense and causal, D = 64 and 128, N = 512 .. --max-n) against SDPA
    on the same fp16 tensors: the forward, whose products run on the machine's bf16 unit as two
    bf16 terms per value (templates/cpu `kFp16Split`), and forward+backward (the backward
    widened to fp32) up to --max-n-backward."""
    gen = torch.Generator().manual_seed(7)
    sizes = [n for n in (512, 1024, 2048, 4096, 8192, 16384) if args.min_n <= n <= args.max_n]
    for program in ("vanilla", "causal"):
        kern = attncc.compile(EX / f"{program}.attn")

        def sdpa(q_, k_, v_, causal=program == "causal"):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)

        for D in (64, 128):
            for n in sizes:
                q, k, v = (torch.randn(1, 8, n, D, generator=gen).half() for _ in range(3))
                name = f"fp16 {program} H=8 N={n} D={D}"
                ours, anchor = alternating_medians([partial(kern, q, k, v), partial(sdpa, q, k, v)], args.repeats)
                row(results, f"{name} fwd", ours, {"sdpa": anchor})
                if n <= args.max_n_backward:
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    ours, anchor = alternating_medians([fwd_bwd(kern, *leaves), fwd_bwd(sdpa, *leaves)], args.repeats)
                    row(results, f"{name} fwd+bwd", ours, {"sdpa": anchor})


def on_jagged(call: Callable, offsets: torch.Tensor, q, k, v) -> torch.Tensor:
    """`call` on jagged nested views [B, H, j, D] of packed q, k, v [total, H, D]; out's values."""
    nested = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))
    return call(*nested).transpose(1, 2).values()


def serving_cases(results: list, args) -> None:
    """Issue 11's targets: packed (varlen) batches against SDPA on the padded batch with its
    padding mask, at 25% and 50% padding (8 sequences up to --serving-n, and 64 short ones up to
    256: one launch for all, where a call per sequence would cost its host work 64 times), fwd
    and fwd+bwd, and the vanilla batches as jagged nested tensors against SDPA's nested path;
    paged decoding against SDPA on contiguous K/V, pages in order and shuffled, all sequences of
    M keys or of lengths spread over M/2..M."""
    gen = torch.Generator().manual_seed(3)
    H, D = 8, 64
    for program, causal in (("vanilla", False), ("causal", True)):
        kern = attncc.compile(EX / f"{program}.attn")
        for batch, longest, padding in ((8, args.serving_n, 0.25), (8, args.serving_n, 0.5), (64, 256, 0.5)):
            lens = padded_lengths(batch, longest, padding)
            total = sum(lens)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            q, k, v = (torch.randn(total, H, D, generator=gen) for _ in range(3))
            padded = [torch.zeros(batch, H, longest, D) for _ in range(3)]
            for b in range(batch):
                for dst, src in zip(padded, (q, k, v)):
                    dst[b, :, : lens[b]] = src[cu[b] : cu[b + 1]].transpose(0, 1)
            keys = torch.arange(longest).view(1, -1) < torch.tensor(lens).view(-1, 1)  # [B, M]
            mask = keys.view(batch, 1, 1, longest)
            if causal:
                mask = mask & torch.ones(longest, longest, dtype=torch.bool).tril()
            work = sum(n * n for n in lens) / (batch * longest * longest)
            note = f"lengths {min(lens)}..{max(lens)}, {total} tokens, real score work {work:.0%} of padded"
            name = f"varlen {program} pad {padding:.0%} B={batch} H={H} Nmax={longest} D={D}"

            def sdpa(q_, k_, v_, mask=mask):
                return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask)

            def ours(q_, k_, v_, kern=kern, cu=cu):
                return kern.varlen(q_, k_, v_, cu, cu)

            anchors = {"sdpa_padded": median_s(partial(sdpa, *padded), args.repeats)}
            anchors["attncc_padded"] = median_s(partial(kern, *padded), args.repeats)
            row(results, f"{name} fwd", median_s(partial(ours, q, k, v), args.repeats), anchors, note)
            grads = [t.requires_grad_() for t in padded]
            leaves = [t.requires_grad_() for t in (q, k, v)]
            anchors = {"sdpa_padded": median_s(fwd_bwd(sdpa, *grads), args.repeats)}
            row(results, f"{name} fwd+bwd", median_s(fwd_bwd(ours, *leaves), args.repeats), anchors, note)
            if not causal:  # jagged nested tensors, SDPA's [B, H, j, D], against SDPA's nested path
                sdpa_nested, ours_nested = (
                    partial(on_jagged, call, cu.long()) for call in (F.scaled_dot_product_attention, kern)
                )
                with torch.no_grad():
                    anchors = {"sdpa_nested": median_s(partial(sdpa_nested, q, k, v), args.repeats)}
                    seconds = median_s(partial(ours_nested, q, k, v), args.repeats)
                row(results, f"{name.replace('varlen', 'nested')} fwd", seconds, anchors, note)
                anchors = {"sdpa_nested": median_s(fwd_bwd(sdpa_nested, *leaves), args.repeats)}
                seconds = median_s(fwd_bwd(ours_nested, *leaves), args.repeats)
                row(results, f"{name.replace('varlen', 'nested')} fwd+bwd", seconds, anchors, note)
    decode = attncc.compile(EX / "vanilla.attn")  # the new query is the last position: every key visible
    B, H, Hkv, M, D = 8, 32, 8, 4096, 128
    for dtype, page_size in itertools.product((torch.float32, torch.bfloat16), (16, 256)):
        pages = M // page_size
        k_cache, v_cache = (torch.randn(B * pages, page_size, Hkv, D, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(B, 1, H, D, generator=gen).to(dtype)
        k, v = (c.view(B, M, Hkv, D).transpose(1, 2).contiguous() for c in (k_cache, v_cache))

        def sdpa_decode(k=k, v=v, q=q):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)

        anchors = {"sdpa_contiguous": median_s(sdpa_decode, args.repeats)}
        full, spread = torch.full((B,), M, dtype=torch.int32), torch.tensor(padded_lengths(B, M, 0.25)).int()
        shuffled = [torch.randperm(B * pages, generator=gen).view(B, pages) for _ in range(2)]
        for order, table, lengths in (
            ("pages in order", torch.arange(B * pages).view(B, pages), full),
            ("pages shuffled", shuffled[0], full),
            ("pages shuffled, lengths M/2..M", shuffled[1], spread),  # one launch (CPU)
        ):
            table = table.int()

            def paged(table=table, k_cache=k_cache, v_cache=v_cache, q=q, lengths=lengths):
                return decode.paged(q, k_cache, v_cache, table, lengths)

            tag = "bf16" if dtype == torch.bfloat16 else "fp32"
            name = f"paged decode GQA {H}/{Hkv} {tag} B={B} M={M} D={D} page {page_size}, {order}"
            note = "SDPA on contiguous K/V of M keys per sequence" if lengths is spread else ""
            row(results, name, median_s(paged, args.repeats), anchors, note)
        # a chunk of 16 queries (chunked prefill, a speculative draft) against the cache: 64 rows per
        # kv head, by rows with tile products on AVX-512; the same call on contiguous K/V beside it
        chunk = torch.randn(B, 16, H, D, generator=gen).to(dtype)
        table = shuffled[0].int()

        def sdpa_chunk(k=k, v=v, q=chunk):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)

        anchors = {
            "sdpa_contiguous": median_s(sdpa_chunk, args.repeats),
            "attncc_contiguous": median_s(partial(decode, chunk.transpose(1, 2), k, v), args.repeats),
        }
        name = f"paged chunk of 16 GQA {H}/{Hkv} {tag} B={B} M={M} D={D} page {page_size}, pages shuffled"
        row(results, name, median_s(partial(decode.paged, chunk, k_cache, v_cache, table, full), args.repeats), anchors)


def medians_of(calls: dict, qkv: tuple, backward: bool, repeats: int) -> dict[str, float]:
    """Median seconds of each call on q, k, v: the forward, or with `backward` forward and
    backward on fresh leaves (shared by the calls, in dict order)."""
    if backward:
        leaves = [t.clone().requires_grad_() for t in qkv]
        return {name: median_s(fwd_bwd(fn, *leaves), repeats) for name, fn in calls.items()}
    return {name: median_s(partial(fn, *qkv), repeats) for name, fn in calls.items()}


def model_cases(results: list, args) -> None:
    """Issue 12's head shapes: DeepSeek's MLA prefill (q, k 192 wide, v 128; causal, H=16)
    forward and forward+backward, fp32 and bf16, against SDPA (which takes a value head dim of
    its own, on the CPU by its unfused math path), SDPA on v zero-padded to 192 (its flash
    kernel; the output cut back: what users of a one-head-dim kernel do) and attncc on the same
    padded v (what a kernel with one head dim costs: 25% more P V products, 50% more V and O
    traffic)."""
    causal = attncc.compile(EX / "causal.attn")
    r = args.repeats
    H, D, Dv = 16, 192, 128
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for N, backward in ((1024, False), (4096, False), (1024, True), (2048, True)):
            gen = torch.Generator().manual_seed(4)
            q, k = (torch.randn(1, H, N, D, generator=gen).to(dtype) for _ in range(2))
            v = torch.randn(1, H, N, Dv, generator=gen).to(dtype)

            def sdpa(a, b, c):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True)

            def padded(a, b, c):
                return causal(a, b, F.pad(c, (0, D - Dv)))[..., :Dv]

            def sdpa_padded(a, b, c):
                return sdpa(a, b, F.pad(c, (0, D - Dv)))[..., :Dv]

            calls = {"attncc": causal, "sdpa": sdpa, "sdpa_v_padded": sdpa_padded, "attncc_v_padded": padded}
            anchors = medians_of(calls, (q, k, v), backward, r)
            ours = anchors.pop("attncc")
            pass_name = "fwd+bwd" if backward else "fwd"
            row(results, f"MLA prefill causal {pass_name} {name} H={H} N={N} D={D} Dv={Dv}", ours, anchors)
    rope_cases(results, args)
    fp8_cases(results, args)


def prefill_calls(causal, q, k8, v8, k_descale, v_descale, widened) -> dict:
    """fp8_cases' prefill calls on these operands."""
    k16, v16 = widened(k8, k_descale), widened(v8, v_descale)
    return {
        "attncc_fp8": lambda: causal(q, k8, v8, k_descale=k_descale, v_descale=v_descale),
        "attncc_bf16": lambda: causal(q, k16, v16),
        "attncc_dequantised_in_torch": lambda: causal(q, widened(k8, k_descale), widened(v8, v_descale)),
        "sdpa_bf16": lambda: F.scaled_dot_product_attention(q, k16, v16, is_causal=True),
    }


def fp8_cases(results: list, args) -> None:
    """fp8 K/V (e4m3, a descale factor per token and head) widened in the kernel, bf16 q: paged
    decoding (GQA 32/8, B=8, M=4096, D=128, pages of 16) and a causal prefill forward (H=8,
    D=128), against the same call on a bf16 cache / bf16 k and v, dequantising in torch before
    the bf16 call (what a kernel without fp8 asks of its user), and SDPA on contiguous bf16."""
    decode, causal = attncc.compile(EX / "vanilla.attn"), attncc.compile(EX / "causal.attn")
    gen = torch.Generator().manual_seed(6)
    fmt = torch.float8_e4m3fn

    def widened(x8, descale):
        return (x8.float() * descale.unsqueeze(-1)).bfloat16()

    B, H, Hkv, M, D, page = 8, 32, 8, 4096, 128, 16
    pages = B * M // page
    k_descale, v_descale = (torch.rand(pages, page, Hkv, generator=gen) * 0.02 + 0.005 for _ in range(2))
    k8, v8 = (
        (torch.randn(pages, page, Hkv, D, generator=gen) / d.unsqueeze(-1)).to(fmt) for d in (k_descale, v_descale)
    )
    k16, v16 = widened(k8, k_descale), widened(v8, v_descale)
    q = torch.randn(B, 1, H, D, generator=gen).bfloat16()
    table, lengths = torch.randperm(pages, generator=gen).view(B, -1).int(), torch.full((B,), M, dtype=torch.int32)
    k_flat, v_flat = (c[table.long()].flatten(1, 2).transpose(1, 2) for c in (k16, v16))
    calls = {
        "attncc_fp8": lambda: decode.paged(q, k8, v8, table, lengths, k_descale=k_descale, v_descale=v_descale),
        "attncc_bf16_cache": lambda: decode.paged(q, k16, v16, table, lengths),
        "attncc_dequantised_in_torch": lambda: decode.paged(
            q, widened(k8, k_descale), widened(v8, v_descale), table, lengths
        ),
        "sdpa_contiguous_bf16": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k_flat, v_flat, enable_gqa=True
        ),
    }
    anchors = {name: median_s(fn, args.repeats) for name, fn in calls.items()}
    row(
        results,
        f"fp8 e4m3 paged decode GQA {H}/{Hkv} B={B} M={M} D={D} page {page}",
        anchors.pop("attncc_fp8"),
        anchors,
    )
    H = 8
    for N in (2048, 8192):
        k_descale, v_descale = (torch.rand(1, H, N, generator=gen) * 0.02 + 0.005 for _ in range(2))
        k8, v8 = ((torch.randn(1, H, N, D, generator=gen) / d.unsqueeze(-1)).to(fmt) for d in (k_descale, v_descale))
        q = torch.randn(1, H, N, D, generator=gen).bfloat16()
        calls = prefill_calls(causal, q, k8, v8, k_descale, v_descale, widened)
        anchors = {name: median_s(fn, args.repeats) for name, fn in calls.items()}
        row(results, f"fp8 e4m3 causal prefill fwd H={H} N={N} D={D}", anchors.pop("attncc_fp8"), anchors)


ROPE_CAUSAL = """attention rope_causal
q = rope(q, theta=10000)
k = rope(k, theta=10000)
s = q @ k.T * scale
mask j <= i
p = softmax(s)
o = p @ v
output o
"""


def rope_cases(results: list, args) -> None:
    """Rotary embeddings (Llama's half-split form, theta 10000) in the kernel against the same
    rotation in torch (transformers' apply_rotary_pos_emb: cos/sin tables, rotate_half) before
    attncc's causal kernel and before SDPA; B=1 H=8 D=128, causal."""
    ours, causal = attncc.compile(ROPE_CAUSAL), attncc.compile(EX / "causal.attn")
    r = args.repeats
    H, D = 8, 128
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for N, backward in ((2048, False), (8192, False), (2048, True)):
            gen = torch.Generator().manual_seed(5)
            q, k, v = (torch.randn(1, H, N, D, generator=gen).to(dtype) for _ in range(3))
            angle = torch.arange(N, dtype=torch.float64).view(-1, 1) * 10000.0 ** (-torch.arange(0, D, 2) / D)
            cos, sin = (torch.cat([f(angle), f(angle)], -1).to(dtype) for f in (torch.cos, torch.sin))

            def rotated(x, cos=cos, sin=sin):
                return x * cos + torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1) * sin

            def torch_rope_attncc(a, b, c, rotated=rotated):
                return causal(rotated(a), rotated(b), c)

            def torch_rope_sdpa(a, b, c, rotated=rotated):
                return F.scaled_dot_product_attention(rotated(a), rotated(b), c, is_causal=True)

            calls = {"attncc": ours, "sdpa_torch_rope": torch_rope_sdpa, "attncc_torch_rope": torch_rope_attncc}
            anchors = medians_of(calls, (q, k, v), backward, r)
            mine = anchors.pop("attncc")
            pass_name = "fwd+bwd" if backward else "fwd"
            row(results, f"rope causal {pass_name} {name} H={H} N={N} D={D}", mine, anchors)


def attention_flops(B: int, H: int, N: int, M: int, D: int, causal: bool, backward: bool) -> float:
    """Matmul FLOPs (2 products forward, 5 more backward), halved for causal."""
    flops = 4 * B * H * N * M * D * (3.5 if backward else 1.0)
    return flops / 2 if causal else flops


def rate_note(flops_per_s: float, rates: dict[str, float], peaks: dict[str, float], dtype: str) -> str:
    """GFLOP/s, the share of the machine's peak on the unit that multiplies `dtype` here (measured
    by bench/peak_cpu.py; none on AMX) and of the best torch.mm rate measured here (attncc may
    multiply bf16 in fp32, and on CPUs without bf16 instructions torch's bf16 mm is far below its
    fp32 one)."""
    gflops = flops_per_s / 1e9
    note = f"{gflops:.0f} GFLOP/s = "
    if dtype in peaks:
        note += f"{100 * gflops / peaks[dtype]:.0f}% of the {dtype} peak, "
    return note + f"{100 * gflops / max(rates.values()):.0f}% of the best torch.mm rate"


def grid_cases(results: list, args, flex, rates: dict[str, float], peaks: dict[str, float]) -> None:
    """The CPU issue's target grid: B=1 H=8, D=64/128, N=512..max_n; dense and causal, fp32 and
    bf16, forward and forward+backward; GQA decoding; masked variants against FlexAttention."""
    if args.grid_part in ("all", "dense"):
        grid_dense_cases(results, args, flex, rates, peaks)
    if args.grid_part in ("all", "extra"):
        grid_extra_cases(results, args, flex)


def grid_dense_cases(results: list, args, flex, rates: dict[str, float], peaks: dict[str, float]) -> None:
    vanilla, causal = attncc.compile(EX / "vanilla.attn"), attncc.compile(EX / "causal.attn")
    r = args.repeats
    for D in (64, 128):
        for N in (n for n in (512, 1024, 2048, 4096, 8192, 16384) if args.min_n <= n <= args.max_n):
            gen = torch.Generator().manual_seed(0)
            base = [torch.randn(1, 8, N, D, generator=gen) for _ in range(3)]
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = (t.to(dtype) for t in base)
                tag = str(dtype).removeprefix("torch.")
                for is_causal, kern in ((False, vanilla), (True, causal)):
                    name = f"{'causal' if is_causal else 'dense'} fwd {tag} D={D} N={N}"
                    calls = {
                        "attncc": partial(kern, q, k, v),
                        "sdpa": partial(F.scaled_dot_product_attention, q, k, v, is_causal=is_causal),
                    }
                    if flex and dtype == torch.float32 and N <= 8192:
                        calls["flex"] = flex(q, k, v, (lambda b, h, i, j: j <= i) if is_causal else None)
                    anchors = alternating_per_call(calls, r)
                    ours = anchors.pop("attncc")
                    flops = attention_flops(1, 8, N, N, D, is_causal, False)
                    row(results, name, ours, anchors, rate_note(flops / ours, rates, peaks, tag))
                    results[-1].update(N=N, D=D, dtype=tag, causal=is_causal, backward=False)
                    if N > args.max_n_backward:
                        continue
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    sdpa = partial(F.scaled_dot_product_attention, is_causal=is_causal)
                    anchors = alternating_per_call(
                        {"attncc": fwd_bwd(kern, qg, kg, vg), "sdpa": fwd_bwd(sdpa, qg, kg, vg)}, r
                    )
                    ours = anchors.pop("attncc")
                    flops = attention_flops(1, 8, N, N, D, is_causal, True)
                    note = rate_note(flops / ours, rates, peaks, tag)
                    row(results, name.replace(" fwd ", " fwd+bwd "), ours, anchors, note)
                    results[-1].update(N=N, D=D, dtype=tag, causal=is_causal, backward=True)


def grid_extra_cases(results: list, args, flex) -> None:
    """GQA decoding over a whole KV cache (no mask: the one query is the last position) and a
    few queries against it, MHA decoding (H=8 D=64, a small model's: one query row per kv head,
    sub-millisecond calls timed in batches), and masked variants against FlexAttention."""
    r = args.repeats
    vanilla = attncc.compile(EX / "vanilla.attn")
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for N, M in ((1, 256), (1, 1024), (1, 4096), (1, 16384), (3, 1024)):
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(1, 8, N, 64, generator=gen).to(dtype)
            # a model's layers: each call reads the next layer's K/V, so that, as in a decoding
            # step, a layer's cache has left the caches (L3 here: 32 MiB) before it is read again
            layers = max(1, min(64, -(-128 * 2**20 // (2 * 8 * M * 64 * dtype.itemsize))))
            caches = [[torch.randn(1, 8, M, 64, generator=gen).to(dtype) for _ in range(2)] for _ in range(layers)]
            for name, picked in (("one layer's cache", caches[:1]), (f"{layers} layers' caches in turn", caches)):
                turns = [itertools.cycle(picked), itertools.cycle(picked)]

                def ours(turn=turns[0], q=q):
                    return vanilla(q, *next(turn))

                def sdpa(turn=turns[1], q=q):
                    return F.scaled_dot_product_attention(q, *next(turn))

                times = alternating_per_call({"attncc": ours, "sdpa": sdpa}, r)
                row(results, f"decode MHA {tag} H=8 N={N} M={M} D=64", times.pop("attncc"), times, name)
        for M in (4096, 16384, 32768):
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(1, 32, 1, 128, generator=gen).to(dtype)
            k, v = (torch.randn(1, 8, M, 128, generator=gen).to(dtype) for _ in range(2))
            anchors = {"sdpa": median_s(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True), r)}
            row(results, f"decode GQA 32/8 {tag} N=1 M={M} D=128", median_s(partial(vanilla, q, k, v), r), anchors)
        for N in (3, 4, 16, 64):  # speculative decoding's drafts, short chunks: by rows or grouped query tiles
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(8, 32, N, 128, generator=gen).to(dtype)
            k, v = (torch.randn(8, 8, 4096, 128, generator=gen).to(dtype) for _ in range(2))
            anchors = {"sdpa": median_s(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True), r)}
            name = f"short queries GQA 32/8 {tag} B=8 N={N} M=4096 D=128"
            row(results, name, median_s(partial(vanilla, q, k, v), r), anchors)
    N = min(args.max_n, 4096)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, N, 64, generator=gen) for _ in range(3))
    window, alibi = attncc.compile(EX / "sliding_window.attn"), attncc.compile(EX / "alibi.attn")
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 8) for h in range(8)])
    anchors = {}
    if flex:
        anchors["flex"] = median_s(flex(q, k, v, lambda b, h, i, j: (j <= i) & (i - j < 256)), r)
    row(results, f"sliding window 256 fwd fp32 N={N}", median_s(partial(window, q, k, v), r), anchors)
    anchors = {}
    if flex:
        from torch.nn.attention.flex_attention import flex_attention

        def alibi_mod(score, b, h, i, j):
            return score - slopes[h] * (i - j)

        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = flex.create_block_mask(lambda b, h, i, j: j <= i, 1, 1, N, N, device="cpu")
        anchors["flex"] = median_s(lambda: compiled(q, k, v, score_mod=alibi_mod, block_mask=block_mask), r)
    row(results, f"alibi causal fwd fp32 N={N}", median_s(lambda: alibi(q, k, v, slopes=slopes), r), anchors)


def plot_grid(results: list, path: Path) -> None:
    """Runtime vs N (log-log) per D and dtype, attncc against SDPA (and Flex), like the paper's Fig. 3."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    panels = [(D, dtype, bwd) for D in (64, 128) for dtype in ("float32", "bfloat16") for bwd in (False, True)]
    fig, axes = plt.subplots(3, 4, figsize=(20, 13))
    memory = axes.flat[len(panels)]
    for which, color in (("attncc", "C0"), ("sdpa", "C1"), ("eager", "C3")):
        # (a child that failed to measure reports NaN, and a log scale takes no value <= 0: on it
        # alone the plot stopped)
        pts = [(x["N"], x["peak_extra_mib"]) for x in results if x.get("which") == which and x["peak_extra_mib"] > 0]
        if pts:
            memory.plot(*zip(*pts), "o-", color=color, label=which)
    memory.set(
        xscale="log", yscale="log", xlabel="N", ylabel="MiB", title="peak extra memory, causal fwd+bwd fp32 D=64"
    )
    if memory.has_data():  # (a run without memory measurements: no legend to draw)
        memory.legend(fontsize=7)
    for ax in axes.flat[len(panels) + 1 :]:
        ax.axis("off")
    for ax, (D, dtype, bwd) in zip(axes.flat, panels):
        for is_causal, style in ((False, "-"), (True, "--")):
            rows = [
                x
                for x in results
                if x.get("D") == D
                and x.get("dtype") == dtype
                and x.get("backward") == bwd
                and x.get("causal") == is_causal
            ]
            if not rows:
                continue
            ns = [x["N"] for x in rows]
            label = "causal" if is_causal else "dense"
            ax.plot(ns, [x["attncc_s"] * 1e3 for x in rows], "o" + style, color="C0", label=f"attncc {label}")
            ax.plot(ns, [x["sdpa_s"] * 1e3 for x in rows], "s" + style, color="C1", label=f"SDPA {label}")
            if any("flex_s" in x for x in rows):
                pts = [(x["N"], x["flex_s"] * 1e3) for x in rows if "flex_s" in x]
                ax.plot(*zip(*pts), "^" + style, color="C2", label=f"Flex {label}")
        ax.set(
            xscale="log", yscale="log", xlabel="N", ylabel="ms", title=f"{'fwd+bwd' if bwd else 'fwd'} {dtype} D={D}"
        )
        if ax.has_data():  # (fwd+bwd panels of a run without the backward: empty)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"plot: {path}")


def sweep(args) -> None:
    B, H, N, D = 1, 8, 2048, args.sweep_d
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    sdpa = median_s(lambda: F.scaled_dot_product_attention(q, k, v), args.repeats)
    for br in (32, 64, 128):
        for bc in (32, 64, 128, 256):
            kern = attncc.compile(EX / "vanilla.attn", tiles=(br, bc))
            t = median_s(lambda kern=kern: kern(q, k, v), args.repeats)
            print(
                f"d={D} Br={br:3d} Bc={bc:3d}: {t * 1e3:7.1f} ms  sdpa/attncc {sdpa / t:.2f}  {4 * B * H * N * N * D / t / 1e9:.0f} GFLOP/s",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--long-n", type=int, default=8192)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats, N=4096 for the sparse cases, no memory runs"
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-d", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write raw results here (and the grid's plot beside it)")
    parser.add_argument("--grid", action="store_true", help="the target grid (see above) instead of the default cases")
    parser.add_argument("--min-n", type=int, default=512, help="the dense grid's smallest N (long-N runs alone)")
    parser.add_argument("--max-n", type=int, default=16384)
    parser.add_argument("--max-n-backward", type=int, default=4096)
    parser.add_argument("--grid-part", choices=("all", "dense", "extra"), default="all")
    parser.add_argument("--serving", action="store_true", help="varlen and paged-KV cases (issue 11) only")
    parser.add_argument("--serving-n", type=int, default=2048, help="the longest sequence of the varlen cases")
    parser.add_argument("--models", action="store_true", help="the models' head shapes (issue 12) only")
    parser.add_argument("--fp8", action="store_true", help="the fp8 K/V cases (part of --models) only")
    parser.add_argument(
        "--short", action="store_true", help="many short sequences (N = M = 16 .. 128), small packed batches, only"
    )
    parser.add_argument("--kv-heads", action="store_true", help="fwd+bwd with one or two kv heads (key chunks) only")
    parser.add_argument("--flex-api", action="store_true", help="FlexAttention's calls on attncc (flex_attention) only")
    parser.add_argument(
        "--flash-api", action="store_true", help="FlashAttention's calls on attncc (flash_attn_func) only"
    )
    parser.add_argument("--sdpa-api", action="store_true", help="torch's SDPA call on attncc (integrations.sdpa) only")
    parser.add_argument(
        "--fp16", action="store_true", help="fp16 inputs, dense and causal, N = --min-n .. --max-n, only"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        sweep(args)
        return
    if args.quick:
        args.repeats, args.long_n = 3, 4096
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; ratios are anchor/attncc (>1: attncc faster)"
    )
    flex = None
    if not args.no_flex:
        try:
            flex = Flex()
        except Exception as exc:  # report, do not hide: FlexAttention may be unavailable
            print(f"FlexAttention unavailable: {exc}")
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        **cpu_meta(),
    }
    rates, peaks = gemm_rates(args.repeats), peak_rates()
    meta["torch_mm_gflops"], meta["peak_gflops"] = rates, peaks
    results = SavedRows(args.json, meta)
    print(
        f"{meta['cpu_model']} ({meta['cpu_family_model']}), attncc {meta['attncc_isa']}; "
        f"torch.mm GFLOP/s: {rates}; peak GFLOP/s (bench/peak_cpu.py): {peaks}"
    )
    if args.serving:
        serving_cases(results, args)
    elif args.short:
        short_cases(results, args)
    elif args.kv_heads:
        kv_heads_cases(results, args)
    elif args.fp16:
        fp16_cases(results, args)
    elif args.flex_api:
        flex_api_cases(results, args, flex)
    elif args.flash_api:
        flash_api_cases(results, args)
    elif args.sdpa_api:
        sdpa_api_cases(results, args)
    elif args.models:
        model_cases(results, args)
    elif args.fp8:
        fp8_cases(results, args)
    elif args.grid:
        grid_cases(results, args, flex, rates, peaks)
        if args.grid_part != "extra":
            memory_cases(results, args, MEMORY_GRID)
    else:
        dense_cases(results, args, flex)
        decode_cases(results, args)
        sparse_cases(results, args, flex)
        if not args.quick:
            memory_cases(results, args)
        build_cases(results)
    if args.json:
        results.save()  # (with the updates of the last rows)
        if args.grid and args.grid_part != "extra":
            plot_grid(results, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
