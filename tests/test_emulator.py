"""The CUDA emulator and the device primitives, one by one, against host references.

Each test kernel is CUDA text compiled with ATTNCC_EMULATE. The primitive probes come from
bench/probe_primitives.cu, the same text bench/probe_primitives.py runs and diffs on a GPU.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest
import torch

import attncc
from attncc.codegen import PREAMBLE_END
from attncc.runtime.build import PRECOMPILED_DIR, SHARED_INSTANCES, build_library, cache_dir, load_library
from tests.conftest import ROOT

HARNESS = r"""
#define ATTNCC_EMULATE 1
#include <string>
#include "probe_primitives.cu"
using namespace attncc;

static std::string error_text;
template <typename F> int run(int schedule, F launch) {
  attncc_emu::current_schedule() = attncc_emu::Schedule(schedule);
  try { launch(); return 0; } catch (const attncc_emu::EmulationError& e) { error_text = e.what(); return 1; }
}
extern "C" const char* last_error() { return error_text.c_str(); }

extern "C" int mma_f16(const void* a, const void* bt, float* c, int s) { return run(s, [&] { probe_mma_f16(a, bt, c); }); }
#if ATTNCC_ARCH >= 80
extern "C" int mma_bf16(const void* a, const void* bt, float* c, int s) { return run(s, [&] { probe_mma_bf16(a, bt, c); }); }
#endif
extern "C" int ldmatrix_trans(const void* src, uint32_t* out, int s) { return run(s, [&] { probe_ldmatrix(src, out, 1); }); }
extern "C" int shuffles(const float* in, float* out, int s) { return run(s, [&] { probe_shuffles(in, out); }); }

// Thread 0 of each warp writes its warp's slot; lane 5 of the next warp reads it. With the
// barrier the result is deterministic; without it, it depends on the schedule.
template <bool kBarrier>
__global__ void neighbour_kernel(float* out) {
  float* sm = shared_memory<float>();
  const int warp = warp_id(), lane = lane_id();
  if (lane == 0) sm[warp] = float(warp + 1);
  if (kBarrier) block_sync();
  if (lane == 5) out[warp] = sm[(warp + 1) % 4];
}
extern "C" int neighbours(float* out, int barrier, int s) {
  return run(s, [&] {
    if (barrier) ATTNCC_LAUNCH(neighbour_kernel<true>, dim3(2), dim3(128), 16, nullptr, out);
    else ATTNCC_LAUNCH(neighbour_kernel<false>, dim3(2), dim3(128), 16, nullptr, out);
  });
}

__global__ void divergent_barrier_kernel() { if (thread_id() < 64) block_sync(); }
__global__ void partial_warp_shuffle_kernel(float* out) { if (lane_id() < 16) out[lane_id()] = shfl_xor(1.0f, 1); }
__global__ void misaligned_ldmatrix_kernel() {
  uint32_t r[4];
  ldmatrix_x4<false>(r, shared_memory<char>() + 2 + 16 * lane_id());
}
__global__ void mixed_collective_kernel(float* out) {
  uint32_t r[4];
  if (lane_id() == 3) ldmatrix_x4<false>(r, shared_memory<char>());
  else out[0] = shfl_xor(1.0f, 1);
}
// A block that exits with a copy in flight (on a GPU it would land in the next block's memory).
__global__ void exit_with_copy_in_flight_kernel(const f16* src) {
  cp_async_16(shared_memory<f16>(), src);
  cp_async_commit();
}
extern "C" int bad_kernel(int which, float* out, int s) {
  return run(s, [&] {
    if (which == 0) ATTNCC_LAUNCH(divergent_barrier_kernel, dim3(1), dim3(128), 0, nullptr);
    if (which == 1) ATTNCC_LAUNCH(partial_warp_shuffle_kernel, dim3(1), dim3(32), 0, nullptr, out);
    if (which == 2) ATTNCC_LAUNCH(misaligned_ldmatrix_kernel, dim3(1), dim3(32), 1024, nullptr);
    if (which == 3) ATTNCC_LAUNCH(mixed_collective_kernel, dim3(1), dim3(32), 1024, nullptr, out);
    if (which == 4) ATTNCC_LAUNCH(partial_warp_shuffle_kernel, dim3(1, 65536), dim3(32), 0, nullptr, out);
    if (which == 5) ATTNCC_LAUNCH(partial_warp_shuffle_kernel, dim3(0), dim3(32), 0, nullptr, out);
    if (which == 6) ATTNCC_LAUNCH(divergent_barrier_kernel, dim3(1), dim3(1056), 0, nullptr);
    if (which == 7) ATTNCC_LAUNCH(exit_with_copy_in_flight_kernel, dim3(1), dim3(1), 64, nullptr, reinterpret_cast<const f16*>(out));
  });
}

// cp.async lands at the wait: without the wait the reader sees the poisoned shared memory.
template <bool kWait>
__global__ void copy_kernel(const f16* src, float* out) {
  f16* sm = shared_memory<f16>();
  cp_async_16(sm + 8 * thread_id(), src + 8 * thread_id());
  cp_async_commit();
  if (kWait) cp_async_wait<0>();
  block_sync();
  out[thread_id()] = to_float(sm[8 * ((thread_id() + 1) % 32)]);
  if (!kWait) {  // read too early above (after every thread's read); still, no copy may outlive the block
    block_sync();
    cp_async_wait<0>();
  }
}
extern "C" int async_copy(const f16* src, float* out, int wait, int s) {
  return run(s, [&] {
    if (wait) ATTNCC_LAUNCH(copy_kernel<true>, dim3(1), dim3(32), 512, nullptr, src, out);
    else ATTNCC_LAUNCH(copy_kernel<false>, dim3(1), dim3(32), 512, nullptr, src, out);
  });
}

// Race-check probes (run with kRaceCheck in the schedule): case 0, 4, 7 and 10 have no race;
// each other case one kind of race, whose outcome the schedules need not show.
template <int kCase>
__global__ void race_kernel(const f16* src, float* out) {
  float* sm = shared_memory<float>();  // 64 floats, then 64 rows of 8 halves from byte 1024
  f16* rows = shared_memory<f16>() + 512;
  const int tid = thread_id(), lane = lane_id(), other = (tid + 32) % 64;  // `other`: the other warp's
  if constexpr (kCase == 0 || kCase == 1) {  // a read of another warp's write, after a barrier or not
    st_shared(sm + tid, float(tid));
    if (kCase == 0) block_sync();
    out[tid] = ld_shared(sm + other);
  } else if constexpr (kCase == 2) {  // a word rewritten while the other warp reads it: no barrier after the reads
    st_shared(sm + tid, 1.0f);
    block_sync();
    out[tid] = ld_shared(sm + other);
    st_shared(sm + tid, 2.0f);
    block_sync();
  } else if constexpr (kCase == 3 || kCase == 4) {  // lanes of one warp, without and with a collective between
    st_shared(sm + tid, float(tid));
    const float sum = kCase == 4 ? shfl_xor(1.0f, 1) : 0.0f;
    out[tid] = ld_shared(sm + (tid ^ 1)) + sum;
  } else if constexpr (kCase == 5) {  // a copy's destination read before its wait
    cp_async_16(rows + 8 * tid, src + 8 * tid);
    cp_async_commit();
    out[tid] = to_float(ld_shared(rows + 8 * tid));
    cp_async_wait<0>();
  } else if constexpr (kCase == 6 || kCase == 7) {  // another warp's landed copy, read without and with a barrier
    cp_async_16(rows + 8 * tid, src + 8 * tid);
    cp_async_commit();
    cp_async_wait<0>();
    if (kCase == 7) block_sync();
    out[tid] = to_float(ld_shared(rows + 8 * other));
  } else if constexpr (kCase == 8) {  // past the block's shared memory
    out[tid] = ld_shared(sm + 1024);
  } else if constexpr (kCase == 9 || kCase == 10) {  // ldmatrix of rows the other warp wrote, without and with a barrier
    for (int e = 0; e < 8; ++e) st_shared(rows + 8 * tid + e, src[8 * tid + e]);
    if (kCase == 10) block_sync();
    uint32_t r[4];
    ldmatrix_x4<false>(r, rows + 8 * ((lane + 32 * (1 - tid / 32)) % 64));
    out[tid] = float(r[0] & 0xffu);
  } else if constexpr (kCase == 11) {  // a copy into a row the other warp reads in the same interval
    st_shared(rows + 8 * tid, src[0]);
    block_sync();
    out[tid] = to_float(ld_shared(rows + 8 * other));
    cp_async_16(rows + 8 * tid, src + 8 * tid);
    cp_async_commit();
    cp_async_wait<0>();
  }
}
template <int kCase> void launch_race(const f16* src, float* out) {
  ATTNCC_LAUNCH(race_kernel<kCase>, dim3(2), dim3(64), 2048, nullptr, src, out);
}
using RaceLaunch = void (*)(const f16*, float*);
static const RaceLaunch kRaceCases[] = {launch_race<0>, launch_race<1>, launch_race<2>, launch_race<3>,
                                        launch_race<4>, launch_race<5>, launch_race<6>, launch_race<7>,
                                        launch_race<8>, launch_race<9>, launch_race<10>, launch_race<11>};
extern "C" int race_case(int which, const f16* src, float* out, int s) {
  return run(s, [&] { kRaceCases[which](src, out); });
}
"""


#: The emulated kernels' preamble (templates/cuda/emulator.cpp.jinja): a source that starts with
#: one is built with the emulator's runtime declared only, linked from its preamble's instances object
SHARED_RUNTIME_PREAMBLE = f"""#define ATTNCC_EMULATE 1
#include <string>
#include "attncc/cuda/primitives.cuh"
{PREAMBLE_END}
"""


@pytest.fixture(scope="module", params=["asm", "ucontext", "shared-runtime"])
def emu(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The harness on both context switches, x86-64 assembly and the portable ucontext, each
    object with the emulator's runtime inline; and as generated kernels are built, the runtime
    in the instances object that the library links once (runtime/build.py SHARED_INSTANCES)."""
    probe = (ROOT / "bench" / "probe_primitives.cu").read_text()
    first = {"ucontext": "#define ATTNCC_EMULATE_UCONTEXT 1\n", "shared-runtime": SHARED_RUNTIME_PREAMBLE}
    source = first.get(request.param, "") + HARNESS
    path = build_library(source, f"emulator-test-{request.param}", {"probe_primitives.cu": probe})
    if request.param == "shared-runtime":  # (the source declares the runtime; the library holds the object's, hidden)
        ninja = (path.parent / "build.ninja").read_text()
        assert re.search(rf"rule compile_shared\n  command = [^\n]*{SHARED_INSTANCES}", ninja)
        assert _runtime_symbols(path, "t") == RUNTIME and not _runtime_symbols(path, "W") & RUNTIME
    else:
        assert _runtime_symbols(path, "W") >= {"attncc_emu::launch_blocks", "attncc_emu::warp_collective"}
    lib = load_library(path)
    lib.last_error.restype = ctypes.c_char_p
    return lib


def _runtime_symbols(obj: Path, kind: str) -> set[str]:
    """The emulator's functions (namespace attncc_emu, by name without arguments or ABI tags)
    that `obj` lists in `nm` with symbol type `kind` (T defined, W defined inline, t local, U undefined)."""
    listing = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    symbols = re.findall(
        r"^\s*(?:[0-9a-f]+\s+)?([A-Za-z])\s+(attncc_emu::\w+)(?:\[abi:\w+\])*\(", listing, re.MULTILINE
    )
    return {name for letter, name in symbols if letter == kind}


#: The runtime's functions: those emulator_runtime.h defines (ATTNCC_EMU_RUNTIME), by name
RUNTIME = {
    "attncc_emu::" + name
    for name in re.findall(
        r"^(?:extern \"C\" )?ATTNCC_EMU_RUNTIME [\w:<>*& ]+?\b(\w+)\(",
        (ROOT / "attncc" / "include" / "attncc" / "cuda" / "emulator_runtime.h").read_text(),
        re.MULTILINE,
    )
    if name != "attncc_emu_entry"  # (extern "C": outside the namespace's names)
}


@pytest.fixture(scope="module")
def turing() -> ctypes.CDLL:
    """The harness with sm75's instruction choice: m16n8k16 as two m16n8k8, synchronous copies."""
    probe = (ROOT / "bench" / "probe_primitives.cu").read_text()
    lib = load_library(
        build_library("#define ATTNCC_ARCH 75\n" + HARNESS, "emulator-test-sm75", {"probe_primitives.cu": probe})
    )
    lib.last_error.restype = ctypes.c_char_p
    return lib


def test_a_generated_kernels_objects_leave_the_emulator_runtime_to_its_preamble_instances_object() -> None:
    """An emulated kernel's two objects call the runtime (scheduling, collectives, the race check,
    counters: two thirds of an object's code, 1.6-1.9 -> 0.6 s a part) and define none of it; its
    library links it once, from the instances object its preamble's first kernel compiled."""
    kern = attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True)
    library = kern.library_path_for("float16", 64)
    assert len(RUNTIME) >= 20 and {"attncc_emu::run_block", "attncc_emu::counters_json"} <= RUNTIME
    for part in ("part1.o", "part2.o"):
        defined = _runtime_symbols(library.parent / part, "T") | _runtime_symbols(library.parent / part, "W")
        assert not defined & RUNTIME
        assert _runtime_symbols(library.parent / part, "U") >= {"attncc_emu::launch_blocks", "attncc_emu::record"}
    assert "attncc_emu::counters_json" in _runtime_symbols(library.parent / "part1.o", "U")
    assert _runtime_symbols(library, "t") == RUNTIME
    preamble = (library.parent / "instances.cpp").read_text().removeprefix("#define ATTNCC_INSTANCES_SOURCE 1\n")
    own = [
        d
        for d in (cache_dir() / PRECOMPILED_DIR).glob("*/")
        if (d / "instances.o").exists() and (d / "preamble.h").exists() and (d / "preamble.h").read_text() == preamble
    ]
    assert any(_runtime_symbols(d / "instances.o", "T") == RUNTIME for d in own)


def p(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("schedule", [0, 1])
def test_mma_fragments_give_the_matrix_product(emu, dtype: torch.dtype, schedule: int) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    bt = torch.randn(8, 16, generator=gen).to(dtype)
    c = torch.empty(16, 8)
    fn = emu.mma_f16 if dtype == torch.float16 else emu.mma_bf16
    assert fn(p(a), p(bt), p(c), schedule) == 0
    assert torch.allclose(c, a.float() @ bt.float().T, atol=1e-5)


@pytest.mark.parametrize("schedule", [0, 1])
def test_turing_mma_decomposition_gives_the_matrix_product(turing, schedule: int) -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 16, generator=gen).to(torch.float16)
    bt = torch.randn(8, 16, generator=gen).to(torch.float16)
    c = torch.empty(16, 8)
    assert turing.mma_f16(p(a), p(bt), p(c), schedule) == 0
    assert torch.allclose(c, a.float() @ bt.float().T, atol=1e-5)
    assert not hasattr(turing, "mma_bf16")  # no bf16 tensor cores before sm80


def test_turing_copies_are_synchronous(turing) -> None:
    src = torch.randn(32 * 8).to(torch.float16)
    out = torch.empty(32)
    assert turing.async_copy(p(src), p(out), 0, 0) == 0  # no wait needed: the data is there
    assert torch.equal(out, src.float().view(32, 8)[:, 0].roll(-1))


def test_ldmatrix_trans_layout(emu) -> None:
    src = torch.arange(256, dtype=torch.float32).to(torch.float16).view(16, 16)
    out = torch.empty(32, 4, dtype=torch.int32)
    assert emu.ldmatrix_trans(p(src), p(out), 0) == 0
    halves = out.view(torch.int16).view(torch.float16).view(32, 4, 2)
    mats = [src[:8, :8], src[8:, :8], src[:8, 8:], src[8:, 8:]]
    for lane in range(32):
        for m in range(4):
            assert halves[lane, m, 0] == mats[m][2 * (lane % 4), lane // 4]
            assert halves[lane, m, 1] == mats[m][2 * (lane % 4) + 1, lane // 4]


@pytest.mark.parametrize("schedule", [0, 1])
def test_shuffles_in_all_modes(emu, schedule: int) -> None:
    x = torch.randn(32)
    out = torch.empty(5, 32)
    assert emu.shuffles(p(x), p(out), schedule) == 0
    for k in range(5):
        assert torch.equal(out[k], x[torch.arange(32) ^ (1 << k)])


def test_planted_missing_barrier_changes_the_result_between_schedules(emu) -> None:
    with_barrier = [torch.full((4,), -1.0) for _ in range(2)]
    without = [torch.full((4,), -1.0) for _ in range(2)]
    for s in (0, 1):
        assert emu.neighbours(p(with_barrier[s]), 1, s) == 0
        assert emu.neighbours(p(without[s]), 0, s) == 0
    assert torch.equal(with_barrier[0], with_barrier[1])
    assert torch.equal(with_barrier[0], torch.tensor([2.0, 3.0, 4.0, 1.0]))
    assert not torch.equal(without[0].nan_to_num(-7), without[1].nan_to_num(-7))  # the bug shows


@pytest.mark.parametrize(
    ("which", "message"),
    [
        (0, "divergent __syncthreads"),
        (1, "deadlock"),
        (2, "not 16-byte aligned"),
        (3, "while other lanes are in"),
        (4, "invalid launch configuration: grid (1, 65536, 1)"),  # gridDim.y stops at 65535
        (5, "invalid launch configuration: grid (0, 1, 1)"),
        (6, "block (1056, 1, 1)"),  # at most 1024 threads
        (7, "thread 0 exited with 1 cp.async copies in flight"),
    ],
)
def test_kernel_bugs_are_reported_not_aborted(emu, which: int, message: str) -> None:
    out = torch.zeros(32)
    assert emu.bad_kernel(which, p(out), 0) == 1
    assert message in emu.last_error().decode()


def test_cp_async_lands_at_the_wait(emu) -> None:
    src = torch.randn(32 * 8).to(torch.float16)
    ok, missing = torch.empty(32), torch.empty(32)
    assert emu.async_copy(p(src), p(ok), 1, 0) == 0
    assert torch.equal(ok, src.float().view(32, 8)[:, 0].roll(-1))
    assert emu.async_copy(p(src), p(missing), 0, 0) == 0
    assert torch.isnan(missing).all()  # poisoned shared memory, not the data


RACE_CHECK = 4  # added to a schedule (include/attncc/cuda/emulator.h kRaceCheck)


@pytest.mark.parametrize(
    ("which", "message"),
    [
        (0, None),
        (1, "shared-memory race"),
        (2, "shared-memory race"),
        (3, "shared-memory race"),
        (4, None),
        (5, "in flight (no cp.async.wait_group of its thread before)"),
        (6, "shared-memory race"),
        (7, None),
        (8, "outside the block's 2048 bytes"),
        (9, "shared-memory race"),
        (10, None),
        (11, "shared-memory race"),
    ],
)
@pytest.mark.parametrize("schedule", [0, 1, 3])
def test_race_check_reports_each_kind_of_race(emu, which: int, message: str | None, schedule: int) -> None:
    """Each probe under the race check: the race-free ones run, each racy one fails naming the
    race (a read of another warp's or lane's write, a rewrite under another warp's read, a copy
    read before its wait or rewritten while read, ldmatrix rows, an access past the block),
    whichever the schedule; without the check, every one of them runs to its end."""
    src = torch.randn(64 * 8).to(torch.float16)
    out = torch.zeros(64)
    status = emu.race_case(which, p(src), p(out), schedule | RACE_CHECK)
    if message is None:
        assert status == 0, emu.last_error().decode()
    else:
        assert status == 1
        assert message in emu.last_error().decode()
        if which != 8:
            assert emu.race_case(which, p(src), p(out), schedule) == 0
