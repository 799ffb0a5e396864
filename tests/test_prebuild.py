"""Ahead-of-time builds (`attncc prebuild`): a directory of libraries that loads where no
compiler is installed, read-only, found by ATTNCC_PREBUILT_DIR; anything not in it is built as
before (or, without a compiler, a clear error); a damaged entry is skipped with a warning."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import attncc
from attncc.cli import main as cli_main
from attncc.errors import AttnccError
from attncc.runtime import build
from attncc.runtime.build import PREBUILT_ENV
from attncc.runtime.gpu import GpuKernel
from attncc.runtime.nvcc import find_nvcc
from attncc.targets import ISA_ENV, best_cpu_isa, cpu_features
from tests.conftest import ROOT, ROOT_FIRST_PYTHONPATH

try:
    find_nvcc()
    HAVE_NVCC = True
except AttnccError:
    HAVE_NVCC = False

ALIBI, CAUSAL = str(ROOT / "examples" / "alibi.attn"), str(ROOT / "examples" / "causal.attn")

SERVER = """
import json, sys, torch, attncc
kern = attncc.compile(sys.argv[1])
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 4, 33, 40, generator=gen, requires_grad=True) for _ in range(3))
slopes = torch.rand(4, generator=gen)
out = kern(q, k, v, slopes=slopes)
grads = torch.autograd.grad(out.sum(), (q, k, v))
torch.save([out.detach(), *grads], sys.argv[2])
try:  # bf16 was not prebuilt, and there is no compiler
    kern(q.bfloat16(), k.bfloat16(), v.bfloat16(), slopes=slopes)
    print(json.dumps("built"))
except attncc.BuildError as exc:
    print(json.dumps(str(exc)))
"""


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def test_prebuilt_kernels_load_without_a_compiler_from_a_read_only_directory(tmp_path, monkeypatch, capsys) -> None:
    prebuilt = tmp_path / "prebuilt"
    assert cli_main(["prebuild", ALIBI, CAUSAL, "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    printed = capsys.readouterr().out
    assert f"2 libraries in {prebuilt}/; where the kernels run, set {PREBUILT_ENV}=" in printed, printed
    assert len(list(prebuilt.glob("*/kernel.so"))) == 2
    before = _files(prebuilt)
    for path in [prebuilt, *prebuilt.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        env = dict(
            os.environ,
            PYTHONPATH=ROOT_FIRST_PYTHONPATH,
            ATTNCC_CACHE_DIR=str(tmp_path / "cache"),
            CXX=str(tmp_path / "no-compiler" / "g++"),  # and no fallback to g++ on PATH
            **{PREBUILT_ENV: str(prebuilt)},
        )
        proc = subprocess.run(
            [sys.executable, "-c", SERVER, ALIBI, str(tmp_path / "server.pt")],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        error = json.loads(proc.stdout.strip().splitlines()[-1])
        assert "is not an executable" in error and PREBUILT_ENV in error, error
        # (which kernel the directory lacks: the bfloat16 one of the program prebuilt for float32)
        assert re.search(
            rf"^kernel alibi-bfloat16: not among the prebuilt kernels in {re.escape(str(prebuilt))} "
            r"\(none named alibi-bfloat16: prebuild this program for this dtype\), and",
            error,
        )
        assert _files(prebuilt) == before  # nothing written: no lock, no rebuild
        assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())

        # the same libraries in this process give the same bits, and match the float64 reference
        monkeypatch.setenv(PREBUILT_ENV, str(prebuilt))
        kern = attncc.compile(ALIBI)
        assert kern.library_path("float32").parent.parent == prebuilt
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 33, 40, generator=gen, requires_grad=True) for _ in range(3))
        slopes = torch.rand(4, generator=gen)
        out = kern(q, k, v, slopes=slopes)
        served = torch.load(tmp_path / "server.pt")
        assert torch.equal(served[0], out.detach())
        assert all(torch.equal(a, b) for a, b in zip(served[1:], torch.autograd.grad(out.sum(), (q, k, v))))
        reference = kern.reference(q.double(), k.double(), v.double(), slopes=slopes.double())[0]
        assert torch.allclose(out.double(), reference, atol=1e-5)
    finally:
        for path in [prebuilt, *prebuilt.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_a_prebuild_builds_in_the_kernel_cache_and_copies_from_it(tmp_path, monkeypatch, capsys) -> None:
    """A prebuild's library is the kernel cache's, built there where it is not and copied (the
    library with its digest and sources, no objects or locks): a second prebuild and the JIT's
    calls compile nothing. A cache that cannot be written leaves the prebuild building in its
    own directory, as before (without the cache's precompiled preamble)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(cache))
    source = tmp_path / "copied.attn"
    source.write_text(
        "attention prebuild_copy_test\ns = q @ k.T * scale\ns = s * 0.5\np = softmax(s)\no = p @ v\noutput o\n"
    )
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(tmp_path / "first")]) == 0
    (built,) = cache.glob("prebuild_copy_test-float32-*/kernel.so")
    (first,) = (tmp_path / "first").glob("*/kernel.so")
    assert first.read_bytes() == built.read_bytes() and first.parent.name != built.parent.name
    copied = {f.name for f in first.parent.iterdir()}
    assert {"kernel.so", "kernel.so.sha256", "kernel.cpp", "build.ninja", build.PREBUILT_MANIFEST} <= copied
    assert not any(name.endswith((".o", ".gch", ".ninja_log")) for name in copied), copied  # (.lock: its own)
    run_ninja = build._run_ninja

    def no_compiler(directory: Path, name: str) -> None:
        raise AssertionError(f"{name} was built again")

    monkeypatch.setattr(build, "_run_ninja", no_compiler)
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(tmp_path / "second")]) == 0
    (second,) = (tmp_path / "second").glob("*/kernel.so")
    assert second.read_bytes() == built.read_bytes() and build._intact(second)
    kern = attncc.compile(source)
    assert kern.library_path("float32") == built
    q = torch.randn(1, 2, 5, 16)
    assert torch.allclose(kern(q, q, q), torch.softmax(q @ q.transpose(-1, -2) * 0.5 / 4, -1) @ q, atol=1e-5)
    monkeypatch.setattr(build, "_run_ninja", run_ninja)
    make_folder = Path.mkdir

    def read_only_cache(self: Path, *args: object, **kwargs: object) -> None:
        if self == cache or cache in self.parents:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        make_folder(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only_cache)
    monkeypatch.setattr(build, "_run_ninja", no_compiler)  # (read, not locked: the prebuild failed on its lock)
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(tmp_path / "from-read-only")]) == 0
    (from_read_only,) = (tmp_path / "from-read-only").glob("*/kernel.so")
    assert from_read_only.read_bytes() == built.read_bytes() and build._intact(from_read_only)
    monkeypatch.setattr(build, "_run_ninja", run_ninja)
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(cache / "elsewhere"))  # (nothing there to copy)
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(tmp_path / "third")]) == 0
    (third,) = (tmp_path / "third").glob("*/kernel.so")
    assert build._intact(third) and (third.parent / "part1.o").exists()  # (built there)
    assert not (cache / "elsewhere").exists()
    capsys.readouterr()


def test_a_directory_prebuilt_for_another_isa_says_so_and_a_missing_one_is_named(tmp_path, monkeypatch) -> None:
    """A server whose prebuilt directory was built for another ISA level (or torch) heard only
    "not among the prebuilt kernels"; now which fact differs. An ATTNCC_PREBUILT_DIR that is not
    a directory (a typo) built every kernel silently where a compiler exists: now a warning."""
    if "avx2" not in cpu_features() or best_cpu_isa(cpu_features()) == "avx2":
        pytest.skip("needs a machine above the avx2 level (a lower level is forced for the prebuild)")
    prebuilt = tmp_path / "prebuilt"
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert cli_main(["prebuild", CAUSAL, "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    (manifest,) = prebuilt.glob(f"*/{build.PREBUILT_MANIFEST}")
    manifest.unlink()  # (a directory prebuilt before manifests, or one lost: a second prebuild writes it)
    assert cli_main(["prebuild", CAUSAL, "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    monkeypatch.delenv(ISA_ENV)
    assert manifest.read_text() == f"built for: -march=x86-64-v3\nbuilt with: -O2\ntorch: {torch.__version__}\n"
    env = dict(
        os.environ,
        PYTHONPATH=ROOT_FIRST_PYTHONPATH,
        ATTNCC_CACHE_DIR=str(tmp_path / "cache"),
        CXX=str(tmp_path / "no-compiler" / "g++"),
        **{PREBUILT_ENV: str(prebuilt)},
    )
    call = "import torch, attncc; x = torch.randn(1, 1, 3, 8); attncc.compile(__import__('sys').argv[1])(x, x, x)"
    proc = subprocess.run([sys.executable, "-c", call, CAUSAL], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert (
        "(1 named causal-float32, for another machine: built for '-march=x86-64-v3', this machine '-march=x86-64-v4"
        in proc.stderr
    ), proc.stderr
    monkeypatch.setattr(build, "_MISSING_PREBUILT_DIRS", set())
    monkeypatch.setenv(PREBUILT_ENV, f"{prebuilt}{os.pathsep}{tmp_path / 'typo'}")
    with pytest.warns(
        UserWarning, match=f"{PREBUILT_ENV} lists {re.escape(str(tmp_path / 'typo'))}, which is not a directory"
    ):
        assert build.prebuilt_dirs() == [prebuilt, tmp_path / "typo"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once)
        build.prebuilt_dirs()


def test_a_damaged_prebuilt_library_is_skipped_with_a_warning(tmp_path, monkeypatch) -> None:
    prebuilt = tmp_path / "prebuilt"
    program = "attention prebuilt_damage_test\ns = q @ k.T * scale\ns = s * 0.75\np = softmax(s)\no = p @ v\noutput o\n"
    source = tmp_path / "damage.attn"
    source.write_text(program)
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    (library,) = prebuilt.glob("*/kernel.so")
    library.write_bytes(library.read_bytes()[:1000])
    monkeypatch.setenv(PREBUILT_ENV, str(prebuilt))
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    kern = attncc.compile(program)
    with pytest.warns(UserWarning, match=r"prebuilt kernel .* is damaged; ignoring it"):
        path = kern.library_path("float32")
    assert path.parent.parent == tmp_path / "cache"  # built by the JIT instead
    q = torch.randn(1, 2, 5, 16)
    assert torch.allclose(kern(q, q, q), torch.softmax(q @ q.transpose(-1, -2) * 0.75 / 4, -1) @ q, atol=1e-5)
    # a server without a compiler is told the library is damaged (it heard "from other sources
    # or headers"), one with another optimisation level which flags (review of session 63)
    env = dict(
        os.environ, PYTHONPATH=ROOT_FIRST_PYTHONPATH, ATTNCC_CACHE_DIR=str(tmp_path / "server"),
        CXX=str(tmp_path / "no-compiler" / "g++"), **{PREBUILT_ENV: str(prebuilt)},
    )  # fmt: skip
    call = "import torch, attncc; x = torch.randn(1, 1, 3, 8); attncc.compile(__import__('sys').argv[1])(x, x, x)"
    damaged = subprocess.run(
        [sys.executable, "-c", call, program], env=env, capture_output=True, text=True, timeout=300
    )
    assert f"{library} damaged (its digest differs or is missing): prebuild it again" in damaged.stderr, damaged.stderr
    digest = library.with_name("kernel.so.sha256")
    recorded = digest.read_text()
    digest.unlink()  # (a library without its digest was skipped silently, "from other sources or headers")
    unfinished = subprocess.run(
        [sys.executable, "-W", "always", "-c", call, program], env=env, capture_output=True, text=True, timeout=300
    )
    assert f"prebuilt kernel {library} is damaged; ignoring it" in unfinished.stderr, unfinished.stderr
    assert f"{library} damaged (its digest differs or is missing)" in unfinished.stderr, unfinished.stderr
    digest.write_text(recorded)
    # which a prebuild into the directory does (it kept the damaged library: session 67's review)
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    repaired = subprocess.run(
        [sys.executable, "-c", call, program], env=env, capture_output=True, text=True, timeout=300
    )
    assert repaired.returncode == 0 and "damaged" not in repaired.stderr, repaired.stderr
    library.parent.rename(tmp_path / "lost")
    assert cli_main(["prebuild", str(source), "--dtypes", "float32", "-o", str(prebuilt)]) == 0
    debug = subprocess.run(
        [sys.executable, "-c", call, program], env={**env, "ATTNCC_DEBUG_BUILD": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert "for another machine: built with '-O2', this machine '-O0 -g'" in debug.stderr, debug.stderr


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_gpu_targets_prebuild_per_storage_dtype_and_head_dim_plan(tmp_path, capsys) -> None:
    """fp32 and bf16 inputs share the bf16 library on sm80; head dims 64 and 60 share the d=64
    plan: one nvcc library per (storage dtype, plan), and one for each forward that decoding calls
    run (key-split warps for 16 and 32 rows, the 64-row short-query tiles), all again with a GQA
    group's query heads folded into rows, named by the same keys a GPU machine's
    `attncc.compile(..., target="cuda")` looks for; with --paged each one's paged forward too."""
    prebuilt = tmp_path / "prebuilt"
    args = ["prebuild", CAUSAL, "--targets", "sm80", "--dtypes", "float32", "bfloat16", "--head-dims", "64", "60"]
    assert cli_main([*args, "-o", str(prebuilt)]) == 0
    assert "causal.attn: sm80, 8 libraries (head dims 64,60)" in capsys.readouterr().out
    build_dirs = [p.parent for p in prebuilt.glob("*/kernel.so")]
    assert all("-arch=sm_80" in (d / "build.ninja").read_text() for d in build_dirs)
    assert sorted(d.name.rsplit("-", 1)[0] for d in build_dirs) == ["causal-sm80-gpu-bfloat16-64"] * 8
    tiles = sorted(int(re.findall(r"constexpr int kBr = (\d+);", (d / "kernel.cu").read_text())[0]) for d in build_dirs)
    # the plan's rows, the key-split forwards' and the short-query forward's, unfolded and folded
    assert tiles == [16, 16, 32, 32, 64, 64, 128, 128]
    assert cli_main([*args, "--paged", "-o", str(tmp_path / "paged")]) == 0
    assert "causal.attn: sm80, 16 libraries (head dims 64,60)" in capsys.readouterr().out
    assert len(list((tmp_path / "paged").glob("*bfloat16+paged-64*/kernel.so"))) == 8


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_gpu_libraries_prebuilt_here_load_under_another_torch(tmp_path, monkeypatch) -> None:
    """A GPU library holds nothing of torch's: one prebuilt on a CPU machine (bench/gpu_prebuild.py)
    is found on a GPU machine whose torch is another build, with nothing compiled there; a host
    library's key still changes with torch's version."""
    prebuilt = tmp_path / "prebuilt"
    assert (
        cli_main(
            ["prebuild", CAUSAL, "--targets", "sm80", "--dtypes", "bfloat16", "--head-dims", "64", "-o", str(prebuilt)]
        )
        == 0
    )
    host_key = build.portable_key("the same text")
    monkeypatch.setattr(torch, "__version__", "9.9.0+cu130")
    build._headers_fingerprint.cache_clear()
    monkeypatch.setenv(PREBUILT_ENV, str(prebuilt))
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))

    def no_compiler(directory: Path, name: str) -> None:
        raise AssertionError(f"{name} was built on the GPU machine")

    monkeypatch.setattr(build, "_run_ninja", no_compiler)
    try:
        kern = GpuKernel(attncc.lower(CAUSAL, "sm80"), "sm80")
        assert kern.library_path_for("bfloat16", 64).parent.parent == prebuilt
        # GQA decoding's forwards, a group's query heads as one head's rows: one query of a
        # group of 4 (the key-split warps' 16 rows), and chunks of 16 (the short-query tiles);
        # not prebuilt before session 67, so a server without nvcc failed its first GQA decode
        folded = kern.with_folded_query_heads()
        for rows in (4, 64):
            assert folded.for_rows(rows, 64).library_path_for("bfloat16", 64).parent.parent == prebuilt
        assert build.portable_key("the same text") != host_key
    finally:
        build._headers_fingerprint.cache_clear()


def test_context_parallel_kernels_prebuild_and_load_without_a_compiler(tmp_path, monkeypatch, capsys) -> None:
    """A context-parallel call's chunk pairs run the kernel at global positions, a library of its
    own that `attncc prebuild` did not build: a server without a compiler failed its first ring
    call (session 67's review). `--context-parallel` builds it beside the kernel's."""
    prebuilt = tmp_path / "prebuilt"
    assert cli_main(["prebuild", ALIBI, "--dtypes", "float32", "--context-parallel", "-o", str(prebuilt)]) == 0
    assert "alibi.attn: cpu, 2 libraries (any head dim)" in capsys.readouterr().out

    def no_compiler(directory: Path, name: str) -> None:
        raise AssertionError(f"{name} was built on the server")

    monkeypatch.setattr(build, "_run_ninja", no_compiler)
    monkeypatch.setenv(PREBUILT_ENV, str(prebuilt))
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    kern = attncc.compile(ALIBI)
    for each in (kern, kern.at_global_positions()):
        assert each.library_path("float32").parent.parent == prebuilt


def test_prebuild_errors_are_one_line(tmp_path, capsys) -> None:
    assert cli_main(["prebuild", str(tmp_path / "missing.attn"), "-o", str(tmp_path / "out")]) == 1
    assert "missing.attn: no such program file" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_cpu_head_dims_beyond_the_kernels_limit_are_one_line_errors(tmp_path, capsys) -> None:
    """`compile --head-dim 577` (and `--shape` D or Dv, `prebuild --head-dims`) on the cpu target
    was accepted and ignored, the kernel then refusing the call; now each says the range."""
    for args, argument in (
        (["compile", CAUSAL, "--head-dim", "64", "577"], "--head-dim 577"),
        (["compile", CAUSAL, "--shape", "1,2,2,8,8,600"], "--shape D=600"),
        (["compile", CAUSAL, "--shape", "1,2,2,8,8,64,700"], "--shape Dv=700"),
        (["prebuild", CAUSAL, "--head-dims", "64", "999", "-o", str(tmp_path / "out")], "--head-dims 999"),
    ):
        assert cli_main(args) == 1, args
        err = capsys.readouterr().err
        assert (
            err
            == f"{argument}: the cpu target's kernels take head dims in [1, 576] (one library per dtype serves them all)\n"
        )
    assert not (tmp_path / "out").exists()
    assert cli_main(["compile", CAUSAL, "--head-dim", "576", "--shape", "1,2,2,8,8,576"]) == 0


def test_cli_refusals_of_session_60s_review(capsys) -> None:
    """`check --target sm80 --emulate --dtype float32` checked float16 instead, silently; a
    `--shape` with Dv = 0 was taken ("0.2x less traffic")."""
    assert cli_main(["check", CAUSAL, "--target", "sm80", "--emulate", "--dtype", "float32"]) == 1
    assert "--dtype float32: the sm80 kernels take bfloat16 and float16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["explain", CAUSAL, "--shape", "1,1,1,4,4,8,0"])
    assert "H, Hkv, D and Dv >= 1" in capsys.readouterr().err


def test_a_shape_whose_m_the_inputs_change_is_said(capsys) -> None:
    """`check --shape` with M != N on a program whose runtime inputs run along N (a document
    mask's ids) ran M = N and said nothing (session 68's review): a note on stderr now; a shape
    kept as given, or the built-in shapes, say none."""
    document = str(Path(CAUSAL).parent / "document.attn")
    assert cli_main(["check", document, "--shape", "1,2,1,10,20,16", "--forward-only"]) == 0
    captured = capsys.readouterr()
    assert "note: --shape M=20 taken as M = N = 10: document's runtime inputs run along N or M" in captured.err
    assert "N=10 M=10" in captured.out
    assert cli_main(["check", document, "--shape", "1,2,1,10,10,16", "--forward-only"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert cli_main(["explain", CAUSAL, "--shape", "1,2,1,10,20,16"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_cli_refusals_of_session_61(tmp_path, capsys) -> None:
    """`profile --lines -2` was taken (and showed every line but the last two); `explain /dev/null`
    said "no such program file" of a file that exists; `prebuild -o FILE` said "[Errno 17] File
    exists"; a program given as a pipe (`attncc explain <(...)`) is read; a reader leaving the
    pipe early (`attncc explain ... | head`) ended in a BrokenPipeError traceback."""
    with pytest.raises(SystemExit):
        cli_main(["profile", CAUSAL, "--emulate", "--lines", "-2"])
    assert "argument --lines: expected an int >= 0, got -2" in capsys.readouterr().err
    assert cli_main(["explain", os.devnull]) == 1
    assert (
        capsys.readouterr().err
        == f"{os.devnull}: not a program file (a device or socket, not a regular file or a pipe)\n"
    )
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli_main(["prebuild", CAUSAL, "--dtypes", "float32", "-o", str(a_file)]) == 1
    assert capsys.readouterr().err == f"attncc prebuild: -o {a_file}: exists and is not a directory\n"
    fifo = tmp_path / "program"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat {CAUSAL} > {fifo}"])
    assert cli_main(["explain", str(fifo)]) == 0
    writer.wait(timeout=30)
    assert "graph causal {" in capsys.readouterr().out
    head = "import sys; from attncc.cli import main; sys.exit(main(['explain', sys.argv[1]]))"
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (as a terminal user's)
    explain = subprocess.Popen(
        [sys.executable, "-c", head, CAUSAL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=buffered
    )
    assert explain.stdout is not None
    explain.stdout.close()  # (the reader leaves before the first line: every write fails)
    assert explain.wait(timeout=120) == 141
    assert explain.stderr is not None and b"Traceback" not in explain.stderr.read()


def test_fp8_forwards_prebuild_and_load_from_the_directory(tmp_path, monkeypatch, capsys) -> None:
    """`--kv-dtypes float8_e4m3fn`: the fp8 forward of each q dtype that takes it (not float64)
    is prebuilt beside the plain libraries and an fp8 call loads it from there."""
    prebuilt = tmp_path / "prebuilt"
    args = ["prebuild", CAUSAL, "--dtypes", "float32", "float64", "--kv-dtypes", "float8_e4m3fn", "-o", str(prebuilt)]
    assert cli_main(args) == 0
    assert "causal.attn: cpu, 3 libraries" in capsys.readouterr().out
    monkeypatch.setenv(PREBUILT_ENV, str(prebuilt))
    kern = attncc.compile(CAUSAL)
    assert kern.library_path("float32+float8_e4m3fn").parent.parent == prebuilt
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    out = kern(q, k.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), k_descale=1.0, v_descale=1.0)
    assert torch.allclose(out, kern(q, k.to(torch.float8_e4m3fn).float(), k.to(torch.float8_e4m3fn).float()), atol=1e-5)


def test_a_prebuild_in_one_thread_leaves_other_threads_kernels_to_the_cache(tmp_path, monkeypatch) -> None:
    """`prebuilding_into` holds for its own thread: a kernel that another thread builds meanwhile
    goes to the kernel cache (a list for the whole process sent it into the prebuild
    directory), and the prebuild's own kernel to the prebuild directory."""
    cache, prebuilt = tmp_path / "cache", tmp_path / "prebuilt"
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(cache))
    program = "attention thread_{name}\ns = q @ k.T * scale\ns = s * {factor}\np = softmax(s)\no = p @ v\noutput o\n"
    inside, go = threading.Event(), threading.Event()
    found: dict[str, Path | BaseException] = {}

    def prebuild() -> None:
        try:
            with build.prebuilding_into(prebuilt):
                inside.set()
                assert go.wait(600)
                found["prebuild"] = attncc.compile(program.format(name="prebuilt", factor=0.5)).library_path("float32")
        except BaseException as error:  # (the assertion below names it)
            found["prebuild"] = error
        finally:
            inside.set()

    thread = threading.Thread(target=prebuild)
    thread.start()
    try:
        assert inside.wait(600)
        jit = attncc.compile(program.format(name="jit", factor=0.25)).library_path("float32")
    finally:
        go.set()
        thread.join(600)
    assert jit.parent.parent == cache and build._intact(jit)
    assert isinstance(found["prebuild"], Path), found["prebuild"]
    assert found["prebuild"].parent.parent == prebuilt and build._intact(found["prebuild"])
