"""Runtime: input validation, the build cache, the CLI and the C++ primitives one by one."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import attncc
from attncc import targets
from attncc.errors import BuildError, InputError
from attncc.runtime import build
from attncc.runtime.build import (
    DEBUG_BUILD_ENV,
    OPTIMIZED_FLAGS,
    PRECOMPILED_DIR,
    _compiler_is_gcc,
    build_library,
    cache_dir,
    load_library,
    optimization_flags,
)
from attncc.runtime.inputs import Shape, make_inputs
from attncc.runtime.philox import philox4x32_10
from tests.conftest import ROOT, ROOT_FIRST_PYTHONPATH, kernel


def qkv(B=2, H=4, Hkv=2, N=10, M=12, D=16, dtype=torch.float32):
    return (
        torch.randn(B, H, N, D, dtype=dtype),
        torch.randn(B, Hkv, M, D, dtype=dtype),
        torch.randn(B, Hkv, M, D, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda q, k, v: (q[0], k, v), r"q: expected 4 dimensions \[B, H, N, D\], got shape \(4, 10, 16\)"),
        (lambda q, k, v: (q.int(), k, v), "q: expected dtype float32, float64, bfloat16 or float16, got torch.int32"),
        (lambda q, k, v: (q, k.double(), v), "q, k, v must have one dtype"),
        (lambda q, k, v: (q, k[:1], v[:1]), r"k: expected batch size 2 \(from q\), got shape \(1, 2, 12, 16\)"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), r"k: expected head dim 16 \(from q\)"),
        (
            lambda q, k, v: (q, k, v[:, :, :5]),
            r"v: expected shape \[2, 2, 12, Dv\] \(that of k but the head dim\), got \(2, 2, 5, 16\)",
        ),
        (lambda q, k, v: (q[:, :3], k, v), "query heads H=3 must be a multiple of key/value heads Hkv=2"),
        (
            lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0]),
            r"k: expected at least one key/value head, got shape \(2, 0, 12, 16\)",
        ),
        (lambda q, k, v: (q, k, v.to("meta")), r"v: expected device cpu \(that of q\), got meta"),
        (
            lambda q, k, v: (torch.randn(1, 1, 2, 600), torch.randn(1, 1, 2, 600), torch.randn(1, 1, 2, 600)),
            r"q: head dim D=600 must be in \[1, 576\] on target cpu",
        ),
    ],
)
def test_tensor_errors_name_argument_expected_and_actual(mutate, message: str) -> None:
    kern = kernel("vanilla")
    with pytest.raises(InputError, match=message):
        kern(*mutate(*qkv()))


def test_runtime_input_errors() -> None:
    kern = kernel("alibi")
    q, k, v = qkv()
    with pytest.raises(
        InputError, match=r"missing runtime input `slopes` \(float\[H\]\); alibi takes slopes: float\[H\]"
    ):
        kern(q, k, v)
    with pytest.raises(InputError, match=r"slopes: expected shape float\[H\] with H=4, got \(3,\)"):
        kern(q, k, v, slopes=torch.rand(3))
    with pytest.raises(InputError, match=r"slopes: expected a float tensor, got dtype torch\.int64"):
        kern(q, k, v, slopes=torch.ones(4, dtype=torch.long))
    with pytest.raises(InputError, match=r"slopes: expected a tensor on cpu \(that of q\), got device meta"):
        kern(q, k, v, slopes=torch.rand(4, device="meta"))
    with pytest.raises(InputError, match=r"unknown runtime input\(s\) slope;"):
        kern(q, k, v, slopes=torch.rand(4), slope=1.0)
    with pytest.raises(InputError, match=r"doc\[b, j\]: index 1 \(j\) ranges over \[0, 11\].*size 10"):
        kernel("document")(q, k, v, doc=torch.zeros(2, 10, dtype=torch.long))


WINDOWED_DROPOUT = """attention windowed_dropout
input window: int
input tau: float
input on: bool
s = q @ k.T * scale
s = s - tau * abs(i - j)
mask (j <= i and i - j < window) or not on
p = softmax(s)
p = dropout(p, 0.2)
o = p @ v
output o
"""


def test_numpy_scalars_are_the_numbers_they_hold_and_train_is_a_bool() -> None:
    """np.int64(5), np.float32(0.25), np.True_ as scalar inputs and seeds run as 5, 0.25 and
    True (bit-equal, padded and packed); `train="no"` (truthy: dropout on) is refused."""
    np = pytest.importorskip("numpy")
    kern = attncc.compile(WINDOWED_DROPOUT)
    q = torch.randn(2, 2, 33, 16, dtype=torch.float64)
    given = dict(window=5, tau=0.25, on=True, seed=7)
    as_numpy = dict(window=np.int64(5), tau=np.float32(0.25), on=np.True_, seed=np.int64(7))
    assert torch.equal(kern(q, q, q, **as_numpy), kern(q, q, q, **given))
    packed, cu = q[0].transpose(0, 1).contiguous(), torch.tensor([0, 10, 33], dtype=torch.int32)
    assert torch.equal(
        kern.varlen(packed, packed, packed, cu, cu, **as_numpy), kern.varlen(packed, packed, packed, cu, cu, **given)
    )
    cache = q[0].transpose(0, 1).reshape(33, 1, 2, 16)  # (one key per page)
    table, lengths = torch.arange(33, dtype=torch.int32).view(1, 33).expand(2, 33), torch.tensor([33, 33])
    for train in ("no", 1, None):
        with pytest.raises(InputError, match=f"train: expected True or False, got {train!r}"):
            kern(q, q, q, window=5, tau=0.25, on=True, train=train)
        with pytest.raises(InputError, match="train: expected True or False"):
            kern.varlen(packed, packed, packed, cu, cu, window=5, tau=0.25, on=True, train=train)
        # (session 67's review: `return_lse="no"` returned the lse; a paged call's too)
        with pytest.raises(InputError, match=f"return_lse: expected True or False, got {train!r}"):
            kern(q, q, q, window=5, tau=0.25, on=True, return_lse=train)
        with pytest.raises(InputError, match="return_lse: expected True or False"):
            kern.varlen(packed, packed, packed, cu, cu, window=5, tau=0.25, on=True, return_lse=train)
        with pytest.raises(InputError, match="return_lse: expected True or False"):
            kern.paged(q[:, :, :1], cache, cache, table, lengths, window=5, tau=0.25, on=True, return_lse=train)
    assert len(kern(q, q, q, window=5, tau=0.25, on=True, return_lse=np.True_)) == 2


def test_tensors_of_other_layouts_and_unreadable_numbers_are_named() -> None:
    """Sparse and mkldnn operands, sparse runtime tensors, a scalar input on the meta device and
    a scale beyond float's range raised from inside torch (session 67's review): InputErrors."""
    kern = attncc.compile(WINDOWED_DROPOUT)
    q = torch.randn(1, 2, 5, 8)
    given = dict(window=5, tau=0.25, on=True)
    with pytest.raises(InputError, match=r"^q: expected a dense \(strided\) tensor, got layout torch.sparse_coo$"):
        kern(q.to_sparse(), q, q, **given)
    with pytest.raises(InputError, match=r"^k: expected a dense \(strided\) tensor, got layout torch._mkldnn$"):
        kern(q, q.to_mkldnn(), q, **given)
    with pytest.raises(InputError, match=r"^tau: a scalar on the meta device has no value; pass a number$"):
        kern(q, q, q, **{**given, "tau": torch.tensor(0.25, device="meta")})
    for huge in (10**400, 10**5000):  # (float() raised OverflowError; the second's repr, ValueError)
        with pytest.raises(InputError, match=r"^scale: expected a finite number, got an int beyond float's range$"):
            kern(q, q, q, scale=huge, **given)
    slopes = attncc.compile(ROOT / "examples" / "alibi.attn")
    with pytest.raises(InputError, match=r"^slopes: expected a dense \(strided\) tensor float\[H\], got layout torch"):
        slopes(q, q, q, slopes=torch.ones(2).to_sparse())


def test_out_of_range_block_mask_is_reported() -> None:
    kern = kernel("local_blocks")
    q, k, v = qkv(N=130, M=130)
    with pytest.raises(InputError, match=r"block_mask.*index 1 \(i // 64\) ranges over \[0, 2\].*size 2"):
        kern(q, k, v, block_mask=torch.ones(4, 2, 3, dtype=torch.bool))


def test_empty_problems() -> None:
    kern = kernel("causal")
    q, k, v = qkv(N=0)
    assert kern(q, k, v).shape == (2, 4, 0, 16)
    q, k, v = qkv(M=0)
    out, lse = kern(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    q, k, v = (t.requires_grad_() for t in qkv(B=0, N=12))  # a mask reading a runtime tensor at b
    out, lse = kernel("document")(q, k, v, doc=torch.zeros(0, 12, dtype=torch.long), return_lse=True)
    assert out.shape == (0, 4, 12, 16) and lse.shape == (0, 4, 12)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_include_dir_has_the_headers() -> None:
    assert (Path(attncc.include_dir()) / "attncc" / "cpu" / "primitives.h").is_file()


# ---------------------------------------------------------------------------- build cache
SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, attncc
    start = time.perf_counter()
    kern = attncc.compile(sys.argv[1])
    q = torch.randn(1, 2, 8, 16)
    kern(q, q, q)
    print(f"{time.perf_counter() - start:.3f}")
    """
)


def _run(env: dict, program: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(program)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_concurrent_builds_succeed_once_and_reload_from_disk(tmp_path) -> None:
    program = tmp_path / "unique.attn"
    program.write_text(
        "attention unique_cache_test\ns = q @ k.T * scale\ns = s * 0.5 + 0.25\np = softmax(s)\no = p @ v\noutput o\n"
    )
    # debug builds (-O0, seconds less each): the cache's locking is under test, not the code
    env = dict(
        os.environ, ATTNCC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT_FIRST_PYTHONPATH, ATTNCC_DEBUG_BUILD="1"
    )
    procs = [_run(env, program) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    (build_dir,) = [library.parent for library in (tmp_path / "cache").glob("*/kernel.so")]
    log = (build_dir / ".ninja_log").read_text().splitlines()
    assert sum("kernel.so" in line for line in log) == 1  # built exactly once
    stamp = (build_dir / "kernel.so").stat().st_mtime_ns
    p = _run(env, program)
    _out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert (build_dir / "kernel.so").stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_child_forked_while_a_thread_holds_a_kernel_s_lock_can_call_it() -> None:
    """A child forked while another thread held a kernel's lock (a build of a new dtype took it
    for seconds) hung on its first call of that kernel: the child's locks are new."""
    import threading

    vanilla = kernel("vanilla")
    q = torch.randn(1, 2, 9, 8)
    want = vanilla(q, q, q)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with vanilla._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: the kernel's lock and its new plans, within 60 s or killed below)
        os.close(read)
        try:
            torch.set_num_threads(1)
            ok = vanilla._lock.acquire(timeout=20)
            if ok:
                vanilla._lock.release()
                ok = bool(torch.allclose(vanilla(q.clone(), q, q), want))
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + 60
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        answer = os.read(read, 1)
    finally:
        os.close(read)
        release.set()
        holder.join()
    assert answer == b"1"


def test_a_build_does_not_stall_the_kernel_s_other_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """While one thread builds a library of a kernel (its first bf16 call: seconds of compiler),
    calls that use the kernel's loaded libraries go on (they waited for the whole build)."""
    import threading

    kern = attncc.compile(ROOT / "examples" / "causal.attn")
    q = torch.randn(1, 2, 9, 8)
    kern(q, q, q)  # (fp32 loaded)
    building, finish = threading.Event(), threading.Event()
    library_path = type(kern).library_path

    def slow_build(self: attncc.Kernel, dtype: str) -> Path:
        if dtype == "bfloat16":
            building.set()
            finish.wait(60)
        return library_path(self, dtype)

    monkeypatch.setattr(type(kern), "library_path", slow_build)
    builder = threading.Thread(target=lambda: kern(q.bfloat16(), q.bfloat16(), q.bfloat16()))
    builder.start()
    try:
        assert building.wait(30)
        start = time.monotonic()
        for n in (9, 13, 21):  # (new shapes: new plans, prepared under the kernel's lock)
            x = torch.randn(1, 2, n, 8)
            kern(x, x, x)
        assert time.monotonic() - start < 20
    finally:
        finish.set()
        builder.join()


def test_generated_source_changes_with_the_program() -> None:
    a, b = kernel("causal").source(), kernel("sliding_window").source()
    assert a != b and "(j <= i)" in a and "int64_t(256)" in b
    assert "torch" not in a.split("#include", 1)[1]  # no torch headers in the translation unit


def test_dsl_names_reach_cpp_only_as_prefixed_identifiers() -> None:
    kern = attncc.compile(
        "attention evil\ninput system: float[H]\ninput n: int\ns = q @ k.T * scale\ns = s + system[h]\nmask i - j < n\np = softmax(s)\no = p @ v\noutput o\n"
    )
    src = kern.source()
    assert "x.t_system[" in src and "x.u_n" in src
    assert " system(" not in src


# ---------------------------------------------------------------------------- CLI
def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attncc.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


def test_cli_compile_writes_sources_that_build_standalone(tmp_path) -> None:
    proc = cli("compile", "examples/alibi.attn", "--target", "cpu", "-o", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "Br=64 Bc=128" in proc.stdout and "on-chip" in proc.stdout and "less traffic" in proc.stdout
    source = tmp_path / "alibi_float32.cpp"
    result = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-fopenmp",
            "-fPIC",
            "-shared",
            "-I",
            attncc.include_dir(),
            str(source),
            "-o",
            str(tmp_path / "a.so"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_cli_compile_gpu_target_prints_plan() -> None:
    proc = cli("compile", "examples/causal.attn", "--target", "sm80")
    assert proc.returncode == 0 and "sm80 d=64" in proc.stdout and "warps" in proc.stdout


def test_cli_explain_shows_passes_tiles_and_io() -> None:
    proc = cli("explain", "examples/sliding_window.attn", "--shape", "1,1,1,1024,1024,64")
    assert proc.returncode == 0, proc.stderr
    for needle in ("// after parse", "// after fuse_attention", "// after cost", "tile classes", "#", "IO at", "fused"):
        assert needle in proc.stdout


def test_cli_explain_shows_the_split_kv_decision_for_gpu_targets() -> None:
    """Decoding with GQA 8/2: the group's 4 query heads as one head's rows, so 2 query blocks
    (not 8) of the key-split forward (16 rows, 4 warps, three K/V buffers; 2 resident per SM,
    1 counted), each split 64 ways; with dropout (gpt2 in training) no fold: 8 blocks, 16
    splits (2 slots per SM would give 32); without key-split warps the 64-row forward."""
    proc = cli("explain", "examples/gqa.attn", "--target", "sm90", "--shape", "1,8,2,1,4096,128")  # decoding
    assert proc.returncode == 0, proc.stderr
    assert "// GQA decoding on sm90: each group's 4 query heads run as the rows of one head" in proc.stdout
    key_split = (
        "// split-KV on sm90 (132 SMs x 2 resident blocks of 16 x 64, 4 warps of 16 keys per 16 rows, 1 counted)"
    )
    assert f"{key_split}: 2 query blocks, 64 key tiles: 64 block(s) per query tile" in proc.stdout
    proc = cli("explain", "examples/gpt2.attn", "--target", "sm90", "--shape", "1,8,2,1,4096,128")
    assert proc.returncode == 0, proc.stderr
    assert "GQA decoding" not in proc.stdout
    assert f"{key_split}: 8 query blocks, 64 key tiles: 16 block(s) per query tile" in proc.stdout
    proc = cli(
        "explain", "examples/gqa.attn", "--target", "sm90", "--shape", "1,8,2,1,4096,128", "--no-key-split-warps"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "// split-KV on sm90 (132 SMs x 2 resident blocks of 64 x 64, 1 counted): 2 query blocks, 64 key tiles: "
        "64 block(s) per query tile"
    ) in proc.stdout


def test_cli_edges_of_shapes_names_and_dtypes(tmp_path, capsys) -> None:
    """Session 65's review of the command line: --shape sizes beyond 2^31 - 1 (a TypeError, a
    RuntimeError) and tensors beyond the machine's memory (an allocation's RuntimeError) were
    tracebacks; M = 0 crashed the float64 reference (amax of no keys); a variant name longer
    than a file name failed `compile -o`; `compile --target sm75 --dtype bfloat16` emitted a
    float16 kernel, silently."""
    from attncc.cli import main

    for command in ("explain", "check"):
        with pytest.raises(SystemExit):
            main([command, "examples/causal.attn", "--shape", f"{2**31},1,1,4,4,16"])
        assert f"expected sizes up to {2**31 - 1}" in capsys.readouterr().err
    huge = ",".join(["2147483647"] * 2 + ["1"] + ["2147483647"] * 3)  # (sizes whose product overflows: never allocated)
    assert main(["check", "examples/causal.attn", "--dtype", "float32", "--shape", huge]) == 1
    assert "too large for this machine's memory" in capsys.readouterr().err
    assert main(["check", "examples/causal.attn", "--dtype", "float32", "--shape", "1,2,1,5,0,16"]) == 0
    assert "all ok" in capsys.readouterr().out
    long_name = tmp_path / "long.attn"
    long_name.write_text("attention " + "n" * 300 + "\ns = q @ k.T * scale\np = softmax(s)\no = p @ v\noutput o\n")
    assert main(["compile", str(long_name), "-o", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert [f.name for f in (tmp_path / "out").iterdir()] == ["n" * 120 + "_float32.cpp"]
    args = ["compile", "examples/causal.attn", "--target", "sm75", "--dtype", "bfloat16", "--head-dim", "64"]
    assert main(args) == 1 and "--dtype bfloat16: the sm75 kernels take float16" in capsys.readouterr().err


def test_cli_check_passes_and_fails(monkeypatch, capsys) -> None:
    """`attncc check` exits 0 on a correct kernel and 1, saying MISMATCH, on a kernel planted
    wrong in its forward (one output element) or its backward (one dk element)."""
    proc = cli("check", "examples/softcap.attn", "--shape", "1,2,1,33,40,24", "--dtype", "float32")
    assert proc.returncode == 0 and "all ok" in proc.stdout, proc.stdout + proc.stderr
    from attncc.cli import main
    from attncc.runtime.kernel import Kernel

    args = ["check", "examples/softcap.attn", "--shape", "1,2,1,33,40,24", "--dtype", "float32"]
    forward, backward = Kernel.forward_impl, Kernel.backward_impl

    def wrong_forward(self, *a, **kw):
        out, lse = forward(self, *a, **kw)
        out.view(-1)[17] += 1e-3
        return out, lse

    def wrong_backward(self, *a, **kw):
        dq, dk, dv, rest = backward(self, *a, **kw)
        dk.view(-1)[5] += 1e-2
        return dq, dk, dv, rest

    for name, planted, wrong in (("forward_impl", wrong_forward, "out "), ("backward_impl", wrong_backward, "dk ")):
        with monkeypatch.context() as patch:
            patch.setattr(Kernel, name, planted)
            assert main(args) == 1
        report = capsys.readouterr().out
        assert "MISMATCH" in report and "1 mismatch(es)" in report, report
        assert f"{wrong}inf" not in report and report.count("/") >= 5, report  # errors printed per tensor
    assert main(args) == 0 and "all ok" in capsys.readouterr().out


def test_cli_check_in_float64_holds_a_learnable_table_to_its_own_dtype(capsys) -> None:
    """`attncc check --dtype float64` of a program with a float table made the table float32, so
    its gradient (float32, right to 1e-8) failed float64's 1e-9 limit: MISMATCH for a correct
    kernel (session 66's review, examples/alibi.attn at every shape)."""
    from attncc.cli import main

    assert main(["check", "examples/alibi.attn", "--shape", "1,2,1,33,40,16", "--dtype", "float64"]) == 0
    assert "all ok" in capsys.readouterr().out


# ---------------------------------------------------------------------------- primitives
HARNESS = """
#define ATTNCC_ACC_T float
#define ATTNCC_STORAGE_T float
#include "attncc/cpu/primitives.h"
#include <thread>
using namespace attncc;
extern "C" void to_bf16(const float* x, uint16_t* y, int n) { for (int i = 0; i < n; ++i) y[i] = from_float_bf16(x[i]).bits; }
extern "C" void to_fp16(const float* x, uint16_t* y, int n) { for (int i = 0; i < n; ++i) y[i] = from_float_fp16(x[i]).bits; }
extern "C" void from_fp16(const uint16_t* x, float* y, int n) { for (int i = 0; i < n; ++i) y[i] = to_acc_float(fp16_t{x[i]}); }
// (as in a kernel's threads: denormals flushed while the exponentials run)
extern "C" void vector_exp(const float* x, float* y, int n) {
  const FlushDenormals flush;
  for (int i = 0; i < n; i += VL) vstore(y + i, vexp2_nonpositive(vload(x + i)));
}
extern "C" void vector_exp_bf16(const float* x, float* y, int n) {
  const FlushDenormals flush;
  for (int i = 0; i < n; i += VL) vstore(y + i, vexp2_nonpositive<true>(vload(x + i)));
}
// x * y computed before, inside and after a FlushDenormals scope (x, y chosen by the caller)
extern "C" void products_around_flush(float x, float y, float* out) {
  volatile float a = x, b = y;
  out[0] = a * b;
  { const FlushDenormals flush; out[1] = a * b; }
  out[2] = a * b;
}
extern "C" void scalar_math(const float* x, float* e, float* th, int n) {
  for (int i = 0; i < n; ++i) { e[i] = math_exp(x[i]); th[i] = math_tanh(x[i]); }
}
extern "C" void matmul(float* c, const float* a, const float* b, int r, int n, int k) { gemm<false>(c, n, a, k, b, n, r, n, k); }
static void block_pool_on_this_thread(long* out) {
  size_t small_cap, large_cap, cap;
  void* small = BlockPool::take(1000, small_cap);
  void* large = BlockPool::take(100000, large_cap);
  BlockPool::give(small, small_cap);
  BlockPool::give(large, large_cap);
  void* a = BlockPool::take(900, cap);  // the smallest free block that fits
  out[0] = a == small && cap == small_cap;
  size_t mid_cap;
  void* mid = BlockPool::take(5000, mid_cap);  // not the large block: over kPoolSlack times its size
  out[5] = mid != large;
  BlockPool::give(mid, mid_cap);
  void* b = BlockPool::take(30000, cap);  // within kPoolSlack times its size
  out[1] = b == large && cap == large_cap;
  out[2] = reinterpret_cast<uintptr_t>(a) % 64 == 0 && reinterpret_cast<uintptr_t>(b) % 64 == 0;
  BlockPool::give(a, small_cap);
  BlockPool::give(b, large_cap);
  float* first;
  { Buffer<float> x(200); first = x.data; for (int i = 0; i < 200; ++i) x.data[i] = 1.0f; }
  long nonzero = 0;
  { Buffer<float> y(200); out[3] = y.data == first; for (int i = 0; i < 200; ++i) nonzero += y.data[i] != 0.0f; }
  out[4] = nonzero;
}
extern "C" void block_pool(long* out) {  // on a new thread: its pool starts empty
  std::thread fresh(block_pool_on_this_thread, out);
  fresh.join();
}
extern "C" void philox(const uint32_t* ctr, uint32_t k0, uint32_t k1, uint32_t* out) {
  Philox4 p = philox4x32_10(ctr[0], ctr[1], ctr[2], ctr[3], k0, k1);
  for (int i = 0; i < 4; ++i) out[i] = p.x[i];
}
"""


@pytest.fixture(scope="module")
def harness() -> ctypes.CDLL:
    return load_library(build_library(HARNESS, "primitives-test"))


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def test_half_conversions_round_like_torch(harness) -> None:
    x = torch.cat(
        [
            torch.randn(100000) * 10 ** torch.randint(-8, 6, (100000,)).float(),
            torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e-8, 6e-8, float("inf"), -float("inf")]),
        ]
    )
    for fn, dtype in ((harness.to_bf16, torch.bfloat16), (harness.to_fp16, torch.float16)):
        y = torch.empty(x.shape, dtype=torch.int16)
        fn(ptr(x), ptr(y), x.numel())
        assert torch.equal(y, x.to(dtype).view(torch.int16))
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    back = torch.empty(bits.shape)
    harness.from_fp16(ptr(bits), ptr(back), bits.numel())
    want = bits.view(torch.float16).float()
    assert torch.equal(back.isnan(), want.isnan()) and torch.equal(back[~want.isnan()], want[~want.isnan()])


def test_vector_exp_accuracy(harness) -> None:
    """The softmax's exponential, 2^t for t = (s - max) log2(e) <= 0 (the AVX-512 polynomial and
    vscalefps where the harness is built for AVX-512, the Cody-Waite one elsewhere), run as the
    kernels run it, with denormals flushed: accurate from 2^-125 up, below it 0 or a subnormal
    under 2^-125 (AVX-512: exactly 0, never a subnormal, whose microcode assists cost more than
    the rest of the softmax), exactly 0 for -inf (masked scores) and far below the range, NaN for
    NaN (a NaN score must reach the row sum); as exact up to t = 8 (the forward's lazy rescaling
    lets P reach 256)."""
    special = [-float("inf")] * 16 + [-126.0] * 16 + [float("nan")] * 16 + [-125.99, -150.0, -200.0, -0.0] * 4
    x = torch.cat([torch.linspace(-130, 8, 16000), torch.tensor(special)])
    y = torch.empty_like(x)
    harness.vector_exp(ptr(x), ptr(y), x.numel())
    ref = torch.exp2(x.double())
    rel = ((y.double() - ref).abs() / ref.clamp_min(1e-300))[ref >= 2.0**-125]
    assert rel.max() < 3e-7
    assert (y[ref < 2.0**-125] <= 2.0**-125).all() and (y[~x.isnan()] >= 0).all()
    if "avx512f" in targets.cpu_features():  # the harness is built with -march=native
        assert not ((y > 0) & (y < 2.0**-126)).any()
    assert torch.equal(y[x <= -150], torch.zeros_like(y[x <= -150]))
    assert torch.equal(y.isnan(), x.isnan())


def test_flush_denormals_is_scoped(harness) -> None:
    """FlushDenormals flushes a subnormal product to 0 inside its scope only: the kernels run on
    OpenMP threads that torch's own operators use next."""
    if "sse" not in targets.cpu_features():
        pytest.skip("FlushDenormals sets the SSE control register; this CPU has none")
    out = torch.empty(3)
    harness.products_around_flush(ctypes.c_float(2.0**-70), ctypes.c_float(2.0**-70), ptr(out))
    assert out[0].item() == out[2].item() == 2.0**-140 and out[1].item() == 0.0


def test_vector_exp_for_bf16_accuracy(harness) -> None:
    """The forward's exponential where P is rounded to bf16 next (degree 4): relative error under
    2.7e-6 (the row sum and lse keep it), with the same range handling as the full one."""
    special = [-float("inf")] * 16 + [float("nan")] * 16 + [-150.0, -0.0] * 8
    x = torch.cat([torch.linspace(-130, 8, 16000), torch.tensor(special)])
    y = torch.empty_like(x)
    harness.vector_exp_bf16(ptr(x), ptr(y), x.numel())
    ref = torch.exp2(x.double())
    rel = ((y.double() - ref).abs() / ref.clamp_min(1e-300))[ref >= 2.0**-125]
    assert 1e-6 < rel.max() < 2.7e-6  # (above 1e-6: the harness did call the short polynomial)
    assert torch.equal(y[x <= -150], torch.zeros_like(y[x <= -150]))
    assert torch.equal(y.isnan(), x.isnan())


def test_scalar_exp_and_tanh_accuracy(harness) -> None:
    """The call-free exp/tanh used by generated score maps (so their loops vectorise)."""
    x = torch.cat([torch.linspace(-100, 80, 20001), torch.linspace(-0.2, 0.2, 4001), torch.tensor([0.0, -0.0, 1e-30])])
    e, th = torch.empty_like(x), torch.empty_like(x)
    harness.scalar_math(ptr(x), ptr(e), ptr(th), x.numel())
    ref_e, ref_th = torch.exp(x.double()), torch.tanh(x.double())
    normal = ref_e > 1.2e-38
    assert ((e.double() - ref_e).abs() / ref_e)[normal].max() < 3e-7
    assert torch.equal(e[ref_e < 1e-38], torch.zeros_like(e[ref_e < 1e-38]))
    assert (th.double() - ref_th).abs().max() < 3e-7
    assert ((th.double() - ref_th).abs() / ref_th.abs().clamp_min(1e-30))[x.abs() > 1e-6].max() < 1e-6


def test_scratch_blocks_come_back_from_the_pool_zeroed(harness) -> None:
    """Kernel scratch (K/V panels, tiles) is recycled per thread: the smallest free block that
    fits is taken again, unless it is over 4 times the request (a large buffer after it would
    fault in a fresh block), 64-byte aligned, and a Buffer on a reused block starts zeroed."""
    out = (ctypes.c_long * 6)()
    harness.block_pool(out)
    assert list(out) == [1, 1, 1, 1, 0, 1]


def test_gemm_matches_matmul(harness) -> None:
    for r, n, k in ((4, 16, 1), (8, 48, 37), (64, 128, 64), (12, 80, 256)):
        a, b = torch.randn(r, k), torch.randn(k, n)
        c = torch.empty(r, n)
        harness.matmul(ptr(c), ptr(a), ptr(b), r, n, k)
        assert torch.allclose(c, a @ b, atol=1e-4)


#: Random123's published known answers for Philox4x32-10 (its tests/kat_vectors): counter, key, output.
PHILOX_KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
)


@pytest.mark.parametrize("ctr, key, want", PHILOX_KNOWN_ANSWERS, ids=["zeros", "ones", "pi"])
def test_philox_known_answers(harness, ctr: tuple[int, ...], key: tuple[int, int], want: tuple[int, ...]) -> None:
    """The torch implementation (the reference for every dropout mask) and the C++ header (which
    the CPU kernels and, compiled by nvcc or the emulator, the CUDA kernels include) give
    Random123's answers; test_cuda checks the emulated kernels' bits against the torch mask."""
    assert tuple(int(w) for w in philox4x32_10(ctr, key)) == want
    c32 = torch.tensor(ctr, dtype=torch.int64).to(torch.int32)  # same bits
    out = torch.empty(4, dtype=torch.int32)
    harness.philox(ptr(c32), ctypes.c_uint32(key[0]), ctypes.c_uint32(key[1]), ptr(out))
    assert tuple(int(x) & 0xFFFFFFFF for x in out) == want


def test_philox_cpp_matches_torch(harness) -> None:
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        ctr = torch.randint(0, 2**32, (4,), generator=rng, dtype=torch.int64)
        key = [int(x) for x in torch.randint(0, 2**32, (2,), generator=rng)]
        out = torch.empty(4, dtype=torch.int32)
        c32 = torch.tensor(
            [int(x) - (1 << 32) if x >= 1 << 31 else int(x) for x in ctr], dtype=torch.int32
        )  # same bits
        harness.philox(ptr(c32), ctypes.c_uint32(key[0]), ctypes.c_uint32(key[1]), ptr(out))
        want = philox4x32_10(tuple(ctr), (key[0], key[1]))
        assert [int(x) & 0xFFFFFFFF for x in out] == [int(w) for w in want]


def test_cold_build_is_seconds(tmp_path, monkeypatch) -> None:
    """Not a benchmark: a guard that no heavy header sneaks into the translation unit. The CPU
    kernel builds as two objects, the forward (ATTNCC_PART=1) and the backward (2), that ninja
    compiles in parallel; each holds only its own entry points, and the library has all of them."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    library = attncc.compile(ROOT / "examples" / "document.attn").library("float32")
    assert time.perf_counter() - start < 30
    (build_dir,) = [library.parent for library in tmp_path.glob("*/kernel.so")]
    assert "-DATTNCC_PART=$part -c" in (build_dir / "build.ninja").read_text()
    symbols = {}
    for part in ("part1.o", "part2.o"):
        listing = subprocess.run(["nm", "--defined-only", str(build_dir / part)], capture_output=True, text=True)
        symbols[part] = {line.split()[-1] for line in listing.stdout.splitlines() if " T attncc_" in line}
    assert symbols["part1.o"] == {"attncc_forward", "attncc_variant"}
    assert symbols["part2.o"] == {
        "attncc_backward_delta",
        "attncc_backward_dkdv",
        "attncc_backward_dq",
        "attncc_backward_fused",
    }
    assert all(hasattr(library, name) for name in symbols["part1.o"] | symbols["part2.o"])
    q, k, v, rt = make_inputs(kernel("document"), Shape(1, 1, 1, 8, 8, 16))
    assert kernel("document")(q, k, v, **rt).shape == q.shape


def _text_disassembly(obj: Path) -> str:
    listing = subprocess.run(["objdump", "-d", "--section=.text", str(obj)], capture_output=True, text=True)
    return listing.stdout.split("\n\n", 1)[1]  # (past the line naming the file)


@pytest.mark.skipif(not _compiler_is_gcc(), reason="precompiled preambles are given to GCC only")
@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emulator"])
def test_a_shared_preamble_is_precompiled_from_its_second_kernel_on(tmp_path, monkeypatch, emulated: bool) -> None:
    """The first kernel of a preamble (dtype and ISA, or emulated architecture) builds without a
    precompiled header and leaves the preamble's text in the cache; the second builds the header
    and reads it (-include, a link beside the kernel removed after the build), the third reuses
    it; the objects are the instructions a build without it gives, and a rebuild without the
    link (a damaged library) reads the text."""

    def build(name: str, cache: Path) -> Path:
        monkeypatch.setenv("ATTNCC_CACHE_DIR", str(cache))
        kern = attncc.compile(
            ROOT / "examples" / f"{name}.attn", target="sm80" if emulated else "cpu", emulate=emulated
        )
        library = kern.library_path_for("float16", 64) if emulated else kern.library_path("float32")
        return library.parent

    shared = tmp_path / "shared"
    first, second, third = (build(name, shared) for name in ("vanilla", "causal", "softcap"))
    (precompiled,) = (shared / PRECOMPILED_DIR).iterdir()
    assert (precompiled / "preamble.h.gch").stat().st_size > 1e6
    assert "-include preamble.h" not in (first / "build.ninja").read_text()
    for directory in (second, third):
        assert "-include preamble.h -DATTNCC_PART=$part" in (directory / "build.ninja").read_text()
        assert (directory / "preamble.h").exists() and not (directory / "preamble.h.gch").exists()
    alone = build("causal", tmp_path / "alone")  # (a cache's first kernel: no precompiled header)
    assert "-include preamble.h" not in (alone / "build.ninja").read_text()
    for part in ("part1.o", "part2.o"):
        assert _text_disassembly(second / part) == _text_disassembly(alone / part)
    library = second / "kernel.so"
    library.write_bytes(library.read_bytes()[:1000])  # damaged, its objects gone: rebuilt from the text
    for part in ("part1.o", "part2.o"):
        (second / part).unlink()
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(shared))
    with pytest.warns(UserWarning, match="rebuilding it"):
        load_library(library)
    assert _text_disassembly(second / "part2.o") == _text_disassembly(alone / "part2.o")
    header = precompiled / "preamble.h.gch"  # damaged: every later build of the preamble failed on it
    header.write_bytes(header.read_bytes()[:5000])
    with pytest.warns(UserWarning, match="precompiled preamble .* is unreadable; deleting it"):
        fourth = build("alibi", shared)
    assert (fourth / "kernel.so").exists() and not header.exists()
    assert "-include preamble.h" not in (fourth / "build.ninja").read_text()
    # bits flipped inside it (not truncated): GCC crashed on it, every later build failed, it stayed
    # a half-written header of a build killed while GCC wrote it (~60 MB each, kept for good
    # until session 65): removed by the next build of the preamble, which holds its lock
    stale = precompiled / "preamble.h.gch.tmp4194305"
    stale.write_bytes(b"x" * 1000)
    build("sliding_window", shared)  # (the preamble's next kernel precompiles it again)
    assert not stale.exists() and header.exists()
    damaged = bytearray(header.read_bytes())
    for at in random.Random(3).sample(range(4096, len(damaged)), 200):
        damaged[at] ^= 0x5A
    header.write_bytes(bytes(damaged))
    with pytest.warns(UserWarning, match="precompiled preamble .* is unreadable; deleting it"):
        sixth = build("strided", shared)
    assert (sixth / "kernel.so").exists() and not header.exists()


def _symbols(obj: Path, kinds: str, name: str) -> set[str]:
    """The symbols of an object or library whose nm kind is one of `kinds` and whose demangled name
    contains `name`."""
    listing = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    symbols = re.findall(rf"^\s*(?:[0-9a-f]+\s+)?([A-Za-z])\s+(.*{re.escape(name)}.*)$", listing, re.MULTILINE)
    return {symbol for kind, symbol in symbols if kind in kinds}


def _gemm_blocks(obj: Path, defined: bool) -> set[str]:
    """The gemm_block instances an object or library defines (or, `defined` False, leaves undefined)."""
    return _symbols(obj, "TtWw" if defined else "U", "gemm_block<")


#: The buffer pool's functions that primitives.h compiles once per preamble, beside gemm's blocks
POOL_FUNCTIONS = {
    "attncc::BlockPool::take(unsigned long, unsigned long&)",
    "attncc::BlockPool::give(void*, unsigned long)",
}


def _causal_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Top-left causal attention (examples/causal.attn: j <= i) in float64, from its meaning."""
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    n, m = s.shape[-2:]
    s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v.double()


def _check_causal_at_row_tails(causal: attncc.Kernel, dtype: torch.dtype, out_tol: float, grad_tol: float) -> None:
    """examples/causal.attn's forward and q, k, v gradients against float64 at N = 1, 13, 77 and
    D = 16, 48, 80: row tails 1..5 of a 6-row register block, one and two vector widths."""
    for n, d in ((1, 16), (13, 48), (77, 80)):
        q, k, v = (torch.randn(2, 3, n, d).to(dtype).requires_grad_() for _ in range(3))
        out = causal(q, k, v)
        expected = _causal_float64(*(t.detach().double().requires_grad_() for t in (q, k, v)))
        torch.testing.assert_close(out.double(), expected, atol=out_tol, rtol=out_tol)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
        wanted = torch.autograd.grad(_causal_float64(*reference), reference, torch.ones_like(expected))
        for got, want in zip(grads, wanted):
            torch.testing.assert_close(got.double(), want, atol=grad_tol, rtol=grad_tol)


def test_kernels_of_a_preamble_link_its_shared_instances_object(tmp_path, monkeypatch) -> None:
    """A preamble's first CPU kernel compiles gemm's register blocks (cpu/primitives.h) beside
    its two parts and leaves them to the preamble's directory; the next kernels' parts declare
    them only and their libraries link that object (its copy, removed after the link), forward
    and backward right against float64 at shapes whose tails reach every row count of the
    blocks; a damaged object is deleted with a warning, the kernel builds its own and shares it.
    A source written alone (`attncc compile -o`) still holds them (test_cli_compile_...)."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    first = attncc.compile(ROOT / "examples" / "vanilla.attn").library_path("float32").parent
    (shared,) = (tmp_path / PRECOMPILED_DIR).glob("*/instances.o")
    assert "instances.o" in (first / ".ninja_log").read_text() and not (first / "instances.o").exists()
    blocks = _gemm_blocks(shared, defined=True)
    assert len(blocks) >= 3 * 3 * 2 and blocks <= _gemm_blocks(first / "kernel.so", defined=True)
    causal = attncc.compile(ROOT / "examples" / "causal.attn")
    second = causal.library_path("float32").parent
    assert "instances.o" not in (second / ".ninja_log").read_text() and not (second / "instances.o").exists()
    for part in ("part1.o", "part2.o"):
        assert not _gemm_blocks(second / part, defined=True) and _gemm_blocks(second / part, defined=False) <= blocks
        # the buffers' pool: called, not compiled (nor inlined) into the part
        assert _symbols(second / part, "U", "BlockPool::") == POOL_FUNCTIONS
        assert not _symbols(second / part, "TtWw", "BlockPool::") & POOL_FUNCTIONS
    assert _gemm_blocks(second / "part2.o", defined=False)  # (the backward's products call them)
    assert _symbols(shared, "T", "BlockPool::") == POOL_FUNCTIONS
    # in the library: its own, called directly (local); the free lists' thread_local one per
    # process (a GNU unique symbol), as when each library inlined the pool (GCC's: clang emits no
    # unique symbols, so there each library had its own free lists before as after)
    assert _symbols(second / "kernel.so", "t", "BlockPool::") >= POOL_FUNCTIONS
    if build._compiler_is_gcc():
        assert _symbols(second / "kernel.so", "u", "BlockPool::free_list()::f")
    _check_causal_at_row_tails(causal, torch.float32, out_tol=2e-5, grad_tol=2e-4)
    damaged = bytearray(shared.read_bytes())
    for at in random.Random(5).sample(range(64, len(damaged)), 50):
        damaged[at] ^= 0x5A
    shared.write_bytes(bytes(damaged))
    with pytest.warns(UserWarning, match="shared instances object .* is damaged; deleting it"):
        third = attncc.compile(ROOT / "examples" / "softcap.attn").library_path("float32").parent
    assert "instances.o" in (third / ".ninja_log").read_text()
    assert shared.exists() and _gemm_blocks(shared, defined=True) == blocks  # (the third kernel's, shared)
    # a damaged library rebuilt by `ninja -C` alone (no sources given in this process) builds its
    # own instances object: the copy it was linked with is gone (review of session 72)
    library = second / "kernel.so"
    # (a new file: this process has the library mapped, and truncating it in place made the
    # process die of SIGBUS at exit)
    damaged = library.read_bytes()[:1000]
    library.unlink()
    library.write_bytes(damaged)
    rebuild = (
        f"from attncc.runtime.build import load_library; load_library(__import__('pathlib').Path({str(library)!r}))"
    )
    env = {**os.environ, "PYTHONPATH": ROOT_FIRST_PYTHONPATH}
    proc = subprocess.run([sys.executable, "-c", rebuild], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "rebuilding it" in proc.stderr, proc.stderr
    assert "instances.o" in (second / ".ninja_log").read_text() and not _gemm_blocks(second / "part1.o", defined=True)
    assert build._intact(library)


@pytest.mark.skipif(
    not targets.runs_cpu_isa("avx512bf16", targets.cpu_features()),
    reason="the vdpbf16ps register blocks need a machine with avx512_bf16",
)
def test_bf16_kernels_link_the_vdpbf16ps_blocks_from_the_shared_instances_object(tmp_path, monkeypatch) -> None:
    """On the avx512bf16 level a bf16 kernel's forward and backward products (gemm_dpbf16) call
    register blocks that their objects declare only: the preamble's instances object defines
    every row count and width they reach, in the forward's and the backward's forms; forward and
    backward right against float64 at shapes whose row tails reach every block."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(targets.ISA_ENV, "avx512bf16")
    attncc.compile(ROOT / "examples" / "vanilla.attn").library_path("bfloat16")  # (builds and shares the instances)
    (shared,) = (tmp_path / PRECOMPILED_DIR).glob("*/instances.o")
    blocks = _symbols(shared, "TtWw", "gemm_dpbf16_wide_block<")
    assert len(blocks) >= 3 * 6, blocks  # (forms x rows)
    causal = attncc.compile(ROOT / "examples" / "causal.attn")
    directory = causal.library_path("bfloat16").parent
    for part in ("part1.o", "part2.o"):
        assert not _symbols(directory / part, "TtWw", "gemm_dpbf16_wide_block<")
        assert _symbols(directory / part, "U", "gemm_dpbf16_wide_block<") <= blocks
        assert _symbols(directory / part, "U", "gemm_dpbf16_wide_block<")  # (both halves' products call them)
    _check_causal_at_row_tails(causal, torch.bfloat16, out_tol=2e-2, grad_tol=6e-2)


def test_a_shared_file_is_intact_once_its_digest_is_there_and_a_vanished_one_is_built_again(
    tmp_path, monkeypatch
) -> None:
    """A preamble's file found without its digest (another process about to record it) is not
    intact, and that is not kept: once the digest is there it is (a kept False made the check
    under the lock delete a sound precompiled header, session 72's review). A shared instances
    object removed between its check and its copy (`attncc cache --clear` in another process)
    leaves the kernel building its own, where it raised a FileNotFoundError."""
    shared = tmp_path / "instances.o"
    shared.write_bytes(b"object")
    assert not build._intact_shared(shared)
    build._digest_path(shared).write_text(build._digest(shared))
    assert build._intact_shared(shared)
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    attncc.compile(ROOT / "examples" / "vanilla.attn").library_path("float32")  # (shares its instances)
    copy = shutil.copyfile

    def cleared_meanwhile(source: object, target: object) -> object:
        if Path(str(source)).name == "instances.o":
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source))
        return copy(source, target)

    monkeypatch.setattr(build.shutil, "copyfile", cleared_meanwhile)
    kern = attncc.compile(ROOT / "examples" / "causal.attn")
    directory = kern.library_path("float32").parent
    assert "instances.o" in (directory / ".ninja_log").read_text()  # (its own)
    q = torch.randn(1, 2, 9, 16)
    expected = _causal_float64(q, q, q)
    torch.testing.assert_close(kern(q, q, q).double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not _compiler_is_gcc(), reason="precompiled preambles are given to GCC only")
def test_a_build_failing_for_another_reason_keeps_the_precompiled_preamble(tmp_path, monkeypatch) -> None:
    """A kernel build that fails with the precompiled preamble is built again without it; the
    shared header is deleted only where the compiler named it or crashed (a build killed for
    memory or interrupted deleted a healthy one: review of session 63)."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    for name in ("vanilla", "causal"):  # (the second precompiles the shared preamble)
        attncc.compile(ROOT / "examples" / f"{name}.attn").library_path("float32")
    (header,) = (tmp_path / PRECOMPILED_DIR).glob("*/preamble.h.gch")
    run_ninja, failures = build._run_ninja, []

    def once_interrupted(directory: Path, name: str) -> None:
        if not failures:
            failures.append(name)
            raise BuildError(f"building {name} failed: ninja: build stopped: interrupted by user.")
        run_ninja(directory, name)

    monkeypatch.setattr(build, "_run_ninja", once_interrupted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        library = attncc.compile(ROOT / "examples" / "softcap.attn").library_path("float32")
    assert failures and library.exists() and header.exists()


def test_an_unwritable_kernel_cache_is_a_clear_error(tmp_path, monkeypatch) -> None:
    """A read-only cache (root's bind mount in the review; simulated here: root may write
    anywhere) was a bare OSError from pathlib; now it says which setting to change."""
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn")
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(
        BuildError, match=r"cannot write to the kernel cache .*\(Read-only file system\): set ATTNCC_CACHE_DIR"
    ):
        kern(q, q, q)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if line.startswith("pip install"))
    assert f"\n{command}\n" in readme


def test_each_kernel_object_gets_its_own_op_dispatch_key() -> None:
    a = attncc.compile(ROOT / "examples" / "causal.attn")
    b = attncc.compile(ROOT / "examples" / "causal.attn")
    assert a.key == b.key and a.call_key != b.call_key  # same build, separate objects
    q = torch.randn(1, 1, 5, 16)
    assert torch.equal(a(q, q, q), b(q, q, q))


def test_debug_builds_are_unoptimised_with_debug_info_and_cached_apart(monkeypatch) -> None:
    """ATTNCC_DEBUG_BUILD=1 builds -O0 -g (to step through generated code) into its own cache
    entry; unset or "0" builds with the optimised flags (OPTIMIZED_FLAGS)."""
    source = 'extern "C" int debug_build_probe() { return 7; }'
    paths = {}
    for value in ("", "0", "1"):
        monkeypatch.setenv(DEBUG_BUILD_ENV, value)
        paths[value] = build_library(source, "debug-build-probe")
        command = next(
            line for line in (paths[value].parent / "build.ninja").read_text().splitlines() if "command" in line
        )
        optimised = f" {' '.join(OPTIMIZED_FLAGS)} " in command
        assert (" -O0 -g " in command) == (value == "1") and optimised == (value != "1"), command
        assert load_library(paths[value]).debug_build_probe() == 7
    assert paths[""] == paths["0"] != paths["1"]
    # the usual spellings of off are off (`false` built -O0 kernels, ~7x slower), of on on; others an error
    for value, flags in (
        ("false", OPTIMIZED_FLAGS),
        ("Off", OPTIMIZED_FLAGS),
        ("no", OPTIMIZED_FLAGS),
        ("yes", ("-O0", "-g")),
    ):
        monkeypatch.setenv(DEBUG_BUILD_ENV, value)
        assert optimization_flags() == flags, value
    monkeypatch.setenv(DEBUG_BUILD_ENV, "maybe")
    with pytest.raises(attncc.BuildError, match=r"ATTNCC_DEBUG_BUILD: expected 1, true, yes or on .*got 'maybe'"):
        build_library(source, "debug-build-probe")


def test_a_relative_cache_directory_is_made_absolute(tmp_path, monkeypatch) -> None:
    """A relative ATTNCC_CACHE_DIR: the precompiled preamble's compile runs in its own
    directory, where the relative header path named nothing, so every build ran without it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNCC_CACHE_DIR", "relative/cache")
    assert cache_dir() == tmp_path / "relative" / "cache"


def test_calls_skip_the_op_dispatch_only_where_nothing_observes_it() -> None:
    """A plain inference call runs the kernel without the custom op's dispatch (host time); a
    dispatch mode, the profiler and autograd still see attncc::attention, with the same result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    kern = kernel("vanilla")
    q, k, v = (torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    plain = kern(q, k, v)
    with Record() as mode:
        recorded = kern(q, k, v)
    assert any(op.startswith("attncc.attention") for op in mode.ops), mode.ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = kern(q, k, v)
    assert any(e.name == "attncc::attention" for e in prof.events())
    qg = q.clone().requires_grad_()
    graded = kern(qg, k, v)
    assert graded.grad_fn is not None
    for other in (recorded, profiled, graded):
        assert torch.equal(plain, other.detach())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the sizes become constants
        traced = torch.jit.trace(lambda q, k, v: kern(q, k, v), (q, k, v), check_trace=False)
    assert "attncc::attention" in str(traced.graph)
    assert torch.equal(traced(k, v, q), kern(k, v, q))  # new inputs: the trace calls the kernel


def test_build_keys_follow_the_headers_their_kernels_include(monkeypatch) -> None:
    """A library's key covers the attncc headers its text includes, through each other too, and
    no others: an edit of the CUDA primitives rebuilds (and re-prebuilds) the emulated and GPU
    kernels, not the CPU ones; an edit of the CPU primitives the reverse; a shared header both."""
    from attncc.codegen.cuda import emulation_wrapper
    from attncc.runtime import build

    cpu_text = attncc.compile(ROOT / "examples" / "causal.attn").source("float32")
    emulated = attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True)
    cuda_text = emulation_wrapper("sm80") + emulated.cuda_source("bfloat16", 64)

    def keys() -> tuple[str, str, str]:
        return build.cache_key(cpu_text), build.cache_key(cuda_text), build.portable_key(cuda_text, gpu=True)

    before, original = keys(), build._header_text

    def edited(header: str) -> tuple[str, str, str]:
        monkeypatch.setattr(
            build, "_header_text", lambda name: original(name) + ("// edit\n" if name == header else "")
        )
        return keys()

    cuda_edit = edited("attncc/cuda/emulator.h")  # (included by cuda/primitives.cuh)
    assert cuda_edit[0] == before[0] and cuda_edit[1] != before[1] and cuda_edit[2] != before[2]
    cpu_edit = edited("attncc/cpu/primitives.h")
    assert cpu_edit[0] != before[0] and cpu_edit[1:] == before[1:]
    shared_edit = edited("attncc/halfbits.h")
    assert all(edit != key for edit, key in zip(shared_edit, before))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "examples/causal.attn", "--shape=-1,2,2,10,10,16"], "expected sizes >= 0"),
        (["explain", "examples/causal.attn", "--shape=1,3,2,10,10,16"], "H a multiple of Hkv"),
        (["explain", "examples/causal.attn", "--context-parallel", "0"], "--context-parallel: expected an int >= 1"),
        (["compile", "examples/causal.attn", "--target", "sm80", "--head-dim", "64", "-1"], "expected an int >= 1"),
        (["compile", "examples/causal.attn", "-o", "{file}"], "attncc compile: [Errno 17] File exists"),
        (["examples", "{missing}"], "no such directory"),
        (["examples", "{file}"], "a file; `attncc examples` takes a directory of .attn programs"),
    ],
)
def test_cli_misuse_is_one_line_and_a_failing_status(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    """Nonsense sizes are argument errors and an output path that cannot be a directory is a
    one-line error (they were tracebacks, or accepted with status 0)."""
    from attncc.cli import main

    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", missing=tmp_path / "missing") for a in argv]
    try:
        status = main(argv)
    except SystemExit as exit_:  # (argparse)
        status = exit_.code
    err = capsys.readouterr().err
    assert status != 0 and message in err and "Traceback" not in err, err


def test_cli_examples_reports_a_broken_program_and_checks_the_others(tmp_path: Path, capsys) -> None:
    """`attncc examples DIR` stopped at the first program that did not compile (the later ones
    were never checked); each is reported, the others run, and the status fails."""
    from attncc.cli import main

    (tmp_path / "a_broken.attn").write_text(
        "attention broken\ns = q @ k.T * scale\np = softmax(s\no = p @ v\noutput o\n"
    )
    (tmp_path / "b_plain.attn").write_text((ROOT / "examples" / "vanilla.attn").read_text())
    status = main(["examples", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 1
    assert "== a_broken.attn: error" in out and "a_broken.attn:3:14: error: unexpected end of line" in out
    assert "== b_plain.attn: build/load" in out and "check   ok" in out
    assert out.rstrip().endswith("2 examples, 0 mismatch(es), 1 that did not compile")


def test_cli_explain_at_empty_and_production_shapes(capsys) -> None:
    """N = 0 or B = 0 divided by zero in the traffic report; 4 x 32 heads x 128K tokens made
    12.9 GB of random q, k, v for a report that needs only their sizes."""
    from attncc.cli import main

    for shape in ("1,1,1,0,5,1", "0,1,1,5,5,1", "4,32,8,131072,131072,128"):
        assert main(["explain", str(ROOT / "examples" / "causal.attn"), "--shape", shape]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # (a Dv the kernels refuse was planned; N = M = 1e11 was killed for memory: review of session 63)
    for shape, message in (
        ("1,1,1,1,1,64,100000", "--shape Dv=100000: v's head dim must be in [1, 576] on target cpu"),
        ("1,1,1,2000000000,2000000000,64", "tiles of 64 x 128 to classify, more than attncc maps"),
    ):
        assert main(["explain", str(ROOT / "examples" / "causal.attn"), "--shape", shape]) != 0
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error


def test_cli_cache_reports_and_clears_the_kernel_cache(tmp_path, monkeypatch, capsys) -> None:
    from attncc.cli import main

    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn")
    kern.library("float64")
    assert main(["cache"]) == 0
    report = capsys.readouterr().out
    assert f"{tmp_path / 'cache'}:" in report and "     1 libraries" in report, report
    assert main(["cache", "--clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out  # (the kernel's directory and its preamble's)
    assert not any(d.is_dir() and d.name.startswith("vanilla-") for d in (tmp_path / "cache").iterdir())


def test_the_cache_is_trimmed_least_recently_used_first(tmp_path, monkeypatch, capsys) -> None:
    """ATTNCC_CACHE_LIMIT_MB / `attncc cache --trim`: entries (kernel directories, precompiled
    preambles; a link to a preamble not counted) go oldest use first until the cache fits,
    those used in the last TRIM_SPARES_SECONDS stay; loading a library marks it used."""
    import os
    import time

    from attncc.cli import main
    from attncc.runtime import build

    root = tmp_path / "cache"
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(root))

    def entry(path, size: int, age: float):
        path.mkdir(parents=True)
        (path / "kernel.so").write_bytes(b"x" * size)
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    key = "0123456789abcdef0123"  # (a cache key's 20 hex digits: what marks an entry as attncc's)
    oldest = entry(root / f"alibi-{key}", 3000, 5000)
    preamble = entry(root / build.PRECOMPILED_DIR / key, 2000, 4000)
    newer = entry(root / f"causal-{key}", 1000, 3000)
    # another program's files in a shared cache directory (set to ~/.cache, say), older than
    # every entry: trimmed and cleared with the cache's, until session 60
    foreign = [entry(root / "my_project", 7000, 9000), entry(root / "alibi-1", 10, 9000)]
    (newer / "preamble.h.gch").symlink_to(preamble / "kernel.so")
    os.utime(newer, (time.time() - 3000, time.time() - 3000))  # (the link's creation touched it)
    recent = entry(root / f"vanilla-{key}", 4000, 10)
    assert [size for _, size, _ in build.cache_entries()] == [3000, 2000, 1000, 4000]
    assert build.trim_cache(6000) == (2, 5000)  # the oldest two; 5000 bytes left
    assert not oldest.exists() and not preamble.exists() and newer.exists()
    assert build.trim_cache(0) == (1, 1000) and recent.exists()  # (used 10 s ago: spared)
    # an entry a process builds into now (its lock held) is spared too: `attncc cache --clear`
    # in another process removed a building kernel's folder ("can't create part1.o", session 65)
    held = entry(root / f"held-{key}", 500, 9000)
    with build._file_lock(held / ".lock"):
        assert build.trim_cache(0, spare_seconds=0) == (1, 4000) and held.exists() and not recent.exists()
    assert build.trim_cache(0, spare_seconds=0) == (1, 500) and not held.exists()
    # a build waiting on an entry's lock while another process clears the entry takes the lock
    # of the folder made again, not the removed file's (it went on into a deleted folder)
    import threading

    taken: list[bool] = []

    def waiter() -> None:
        with build._file_lock(held / ".lock"):
            taken.append(held.joinpath(".lock").exists())

    with build._file_lock(held / ".lock"):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)  # (waiting on the lock now)
        shutil.rmtree(held)
    thread.join(30)
    assert taken == [True] and held.is_dir()
    shutil.rmtree(held)
    assert main(["cache", "--trim", "0"]) == 0 and "removed 0 least recently used entries" in capsys.readouterr().out
    # one line, not a traceback (inf overflowed int()); --clear with --trim was ignored silently
    assert main(["cache", "--trim", "inf"]) != 0
    assert "--trim: expected a finite number of megabytes >= 0, got inf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cache", "--clear", "--trim", "5"])
    assert "argument --trim: not allowed with argument --clear" in capsys.readouterr().err

    # a build with the limit set trims the cache; the kernel it built is marked used and stays
    stale = entry(root / f"stale-{key}", 5000, 9000)
    monkeypatch.setenv(build.CACHE_LIMIT_ENV, "0.001")
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn")
    q = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(kern(q, q, q), kern.reference(q, q, q)[0])
    assert not stale.exists() and any(d.name.startswith("vanilla") and d != recent for d in root.iterdir())
    monkeypatch.setenv(build.CACHE_LIMIT_ENV, "lots")
    with pytest.raises(
        attncc.BuildError, match="ATTNCC_CACHE_LIMIT_MB: expected a number of megabytes >= 0, got 'lots'"
    ):
        build.cache_limit_bytes()
    monkeypatch.delenv(build.CACHE_LIMIT_ENV)
    assert main(["cache", "--clear"]) == 0 and "removed " in capsys.readouterr().out
    assert build.cache_entries() == [] and all(path.exists() for path in foreign)


NO_NUMPY_SCRIPT = """
import sys
sys.modules["numpy"] = None  # (as where it is not installed: torch then has no numpy interop)
import torch, attncc
kern = attncc.compile(
    "attention no_numpy\\ninput L: int[B]\\ns = q @ k.T * scale\\nmask j < L[b] and j <= i\\n"
    "p = softmax(s)\\no = p @ v\\noutput o\\n"
)
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 2, 9, 16, generator=gen) for _ in range(3))
lengths = torch.tensor([4, 9])
keep = (torch.arange(9).view(1, 1, 1, -1) < lengths.view(-1, 1, 1, 1)) & torch.ones(9, 9, dtype=torch.bool).tril()
s = (q.double() @ k.double().transpose(-1, -2) / 4.0).masked_fill(~keep, float("-inf"))
expected = torch.softmax(s, -1) @ v.double()
for _ in range(2):  # (the second call repeats the first's kept launch)
    out = kern(q, k, v, L=lengths)
    assert (out.double() - expected).abs().max() < 1e-5, (out.double() - expected).abs().max()
print("ok")
"""


def test_runs_without_numpy() -> None:
    """numpy is not among attncc's dependencies (torch's CPU wheel does not pull it either):
    the values of a runtime tensor that the host reads (a padding mask's lengths) are keyed
    without it; they were read through numpy, and every such call raised "Numpy is not
    available" where it was not installed (session 58)."""
    env = dict(os.environ, PYTHONPATH=ROOT_FIRST_PYTHONPATH, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", NO_NUMPY_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
