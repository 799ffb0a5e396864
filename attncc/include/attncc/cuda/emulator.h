// attncc CUDA emulator: runs the exact text of a generated .cu kernel on the host.
//
// Every CUDA thread is a user-space fiber with its own stack; a hand-written x86-64 context
// switch (ucontext elsewhere) moves between them only at synchronisation points: barriers,
// warp collectives and cp.async waits. Blocks run one after another. The schedules below, and
// each with eager copies, exist and kernels must give identical bits under all of them:
//   kLockStep   - every thread in turn (0, 1, 2, ...) runs to its next sync point;
//   kWarpGreedy - warps in reverse order, each running all its lanes to the next barrier.
// A missing __syncthreads makes some thread read shared memory before or after its writer
// depending on the schedule, so the results differ. Shared memory is poisoned (0xFF bytes,
// NaN in fp16/fp32) at the start of each block; cp.async copies land at cp.async.wait_group,
// the latest a GPU may land them, so a missing wait reads poison. With eager copies
// (kEagerCopies added to a schedule) they land as they are issued, the earliest a GPU may: a
// copy issued into a buffer that other threads have yet to read (a refill before the barrier
// that ends those reads) then changes what they read, so the bits differ from the late landing.
//
// With kRaceCheck added to a schedule, every shared-memory access is also checked against the
// other threads' accesses to its bytes that nothing orders before it (see "race check" below):
// a race is reported even where the schedules happen to give the same bits.
//
// All warp collectives (shuffles, mma, ldmatrix) go through `warp_collective`: each lane
// deposits its operands; the last lane of the mask to arrive checks that every lane called the
// same operation with the same mask, computes the results for the whole warp and releases it.
// Divergent barriers, deadlocks, lanes outside a mask and misaligned ldmatrix addresses end
// the launch with an `EmulationError` (thrown on the host stack, never an abort).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

// x86-64 uses a hand-written context switch; elsewhere (or with ATTNCC_EMULATE_UCONTEXT) ucontext.
#if defined(__x86_64__) && !defined(ATTNCC_EMULATE_UCONTEXT)
#define ATTNCC_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace attncc_emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct EmulationError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum Schedule { kLockStep = 0, kWarpGreedy = 1 };
constexpr int kEagerCopies = 2;  // added to a schedule: cp.async copies land at issue
constexpr int kRaceCheck = 4;    // added to a schedule: shared-memory accesses are checked for races
enum class State { kReady, kBarrier, kCollective, kDone };

constexpr int kWarpSize = 32;
constexpr int kMaxOperands = 12;
constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;
  int tid = 0;
  State state = State::kReady;
  unsigned collective_generation = 0;
};

// One warp's rendezvous for a collective operation.
struct WarpSlot {
  int op = -1;
  unsigned mask = 0;
  unsigned arrived = 0;
  unsigned generation = 0;
  uint32_t in[kWarpSize][kMaxOperands];
  uint32_t out[kWarpSize][kMaxOperands];
  const void* addr[kWarpSize];
};

struct PendingCopy {
  void* dst;
  int size;
  std::vector<unsigned char> bytes;  // empty where the copy landed at issue (eager copies)
  long group;
};

// The race check's record of one byte of shared memory in the current block: its last write
// and its reads since then, each with the barrier interval (epoch) and, for ordering among the
// lanes of one warp, the warp's collective generation it happened in. (Bytes, not words: two
// lanes may write the two halves of a word, or fp8 bytes of one.)
constexpr int16_t kSeveral = -2;  // reader / read_warp: more than one thread (warp) read
struct ShadowByte {
  uint32_t block = 0;  // the block serial these fields belong to (another: no access yet)
  int32_t write_epoch = -1, read_epoch = -1;
  uint32_t write_generation = 0, read_generation = 0;  // (of the reads: the latest)
  uint16_t write_line = 0, read_line = 0;  // (kernel.cu lines)
  int16_t writer = -1, reader = -1, read_warp = -1;
  int16_t pending = -1;  // the thread whose cp.async into the byte has not landed yet
};
struct RaceState {
  std::vector<ShadowByte> bytes;
  uint32_t block = 0;
  int epoch = 0;  // barriers passed by the block
};

struct BlockState {
  dim3 block_idx, block_dim, grid_dim;
  int threads = 0;
  std::vector<Fiber> fibers;
  std::vector<WarpSlot> warps;
  std::vector<std::vector<PendingCopy>> copies;  // per thread
  std::vector<long> committed;                   // per thread: groups committed so far
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  bool eager_copies = false;
  RaceState* race = nullptr;  // with kRaceCheck
  std::string error;
  void* scheduler_sp = nullptr;
  int current = -1;
  std::function<void()> body;
};

inline thread_local BlockState* tls_block = nullptr;

// ------------------------------------------------------------------------ performance counters
// With profiling on (`profile_on`), the primitives report every shared- and global-memory
// access, every mma, ldmatrix, shuffle, exp2 and barrier, with the kernel source line that
// issued it (`__builtin_LINE()` at the call). Per-lane accesses are grouped into warp requests
// as a GPU issues them: the lanes of one warp that executed the same operation on the same line
// for the same n-th time since the warp's last barrier or collective (all lanes pass those
// together). A request is then costed as Nsight Compute counts it:
//  - shared memory: 32 banks of 4 bytes; lanes go in phases of 128 / size lanes (32 for
//    accesses of up to 4 bytes, 16 for 8, 8 for 16; each 8-row matrix of an ldmatrix is one
//    phase); a phase takes as many wavefronts as the most distinct 4-byte words any one bank
//    holds among its lanes' bytes (lanes reading the same word share it);
//  - global memory: the distinct 32-byte sectors the active lanes' bytes touch.
// Each request also counts its ideal: a wavefront per phase with an active lane, and the
// sectors its distinct bytes would fill if contiguous and aligned. Per kernel, the distinct
// sectors of the whole launch (what DRAM must move at least, if L2 kept everything).
// A lane that skips an instance in divergent code (a tail `if`) shifts its later instances
// of that line until the next barrier or collective: counts there are approximate.
enum Op { kOpLdShared, kOpStShared, kOpLdGlobal, kOpStGlobal, kOpAtomicGlobal, kOpCpAsyncGlobal,
          kOpCpAsyncShared, kOpLdmatrix, kOpMma, kOpShfl, kOpExp2, kOpBarrier, kOpCount };
inline const char* const kOpNames[kOpCount] = {"ld.shared", "st.shared", "ld.global", "st.global", "atom.global",
                                               "cp.async.global", "cp.async.shared", "ldmatrix", "mma", "shfl",
                                               "ex2", "bar.sync"};
inline bool is_shared(int op) { return op == kOpLdShared || op == kOpStShared || op == kOpCpAsyncShared || op == kOpLdmatrix; }
inline bool is_global(int op) {
  return op == kOpLdGlobal || op == kOpStGlobal || op == kOpAtomicGlobal || op == kOpCpAsyncGlobal;
}

struct SiteCounter {
  long long requests = 0, lanes = 0, wavefronts = 0, ideal_wavefronts = 0, sectors = 0, ideal_sectors = 0, bytes = 0;
};
struct KernelCounters {
  long long launches = 0, blocks = 0;
  std::unordered_set<uintptr_t> distinct_sectors;
  int threads_per_block = 0;
  size_t shared_bytes = 0;
  std::map<std::pair<int, int>, SiteCounter> sites;  // (line, op)
};
struct Profile {
  std::map<std::string, KernelCounters> kernels;
};
inline Profile*& active_profile() {
  static Profile* profile = nullptr;
  return profile;
}
inline void profile_on(bool on) {
  static Profile profile;
  profile = Profile{};
  active_profile() = on ? &profile : nullptr;
}

// One warp request being gathered: lane addresses of one (line, op, occurrence).
struct PendingRequest {
  unsigned mask = 0;
  int bytes = 0;
  uintptr_t addr[32] = {};
};
struct WarpTrace {
  std::map<std::tuple<int, int, long long>, PendingRequest> pending;  // (line, op, occurrence)
  std::vector<std::map<std::pair<int, int>, long long>> occurrences = std::vector<std::map<std::pair<int, int>, long long>>(32);
};
inline thread_local std::vector<WarpTrace>* tls_traces = nullptr;
inline thread_local KernelCounters* tls_counters = nullptr;

// ------------------------------------------------------------------------ thread identity
inline int thread_index() { return tls_block->current; }
inline dim3 thread_idx() {
  BlockState* b = tls_block;
  int t = b->current;
  return dim3(t % b->block_dim.x, (t / b->block_dim.x) % b->block_dim.y, t / (b->block_dim.x * b->block_dim.y));
}
inline int lane_id() { return thread_index() % kWarpSize; }

// ------------------------------------------------------------------------ warp collectives
// Each lane passes `n_in` words (and optionally an address); `compute` runs once, in the last
// lane to arrive, and fills `out` for every lane of the mask.
using Compute = void (*)(WarpSlot& slot, unsigned mask);

// The collective operations the device primitives issue (attncc/cuda/primitives.cuh).
enum CollectiveOp { kShflXor = 1, kMmaF16, kMmaBf16, kLdmatrix, kLdmatrixTrans, kMmaF16K8, kMmaFp8, kMmaFp8E5M2 };

// The schedule, plus kEagerCopies where copies land at issue and kRaceCheck where accesses are checked.
inline int& current_schedule() {
  static int schedule = kLockStep;
  return schedule;
}

#if !defined(ATTNCC_EMU_ASM_SWITCH)
inline thread_local ucontext_t scheduler_context;  // (ucontext's switch: the scheduler's own context)
#endif

// ------------------------------------------------------------------------ the runtime
// Scheduling, collectives, cp.async, the race check and the counters are the same code in every
// emulated kernel: objects compiled with ATTNCC_SHARED_INSTANCES (runtime/build.py) declare
// them only and link the instances object compiled once per preamble, which defines them
// (ATTNCC_INSTANCES_SOURCE); without it (a source built by hand, a test harness) each
// object defines them inline (emulator_runtime.h). Variables and statics that must be one per
// process (tls_block, current_schedule, active_profile) stay inline here: the dynamic linker
// makes each one object for every library loaded.
#if defined(ATTNCC_SHARED_INSTANCES)
#define ATTNCC_EMU_RUNTIME __attribute__((visibility("hidden")))  // (each library's own: called directly, not through its PLT)
#else
#define ATTNCC_EMU_RUNTIME inline
#endif
ATTNCC_EMU_RUNTIME void record(int op, const void* addr, int bytes, int line);
ATTNCC_EMU_RUNTIME std::string counters_json();
ATTNCC_EMU_RUNTIME void fail(const std::string& message);
ATTNCC_EMU_RUNTIME void syncthreads(int line = 0);
ATTNCC_EMU_RUNTIME void warp_collective(int op, unsigned mask, const uint32_t* in, int n_in, const void* addr,
                                        uint32_t* out, int n_out, Compute compute, int line = 0);
ATTNCC_EMU_RUNTIME void cp_async(void* dst_shared, const void* src_global, int bytes, int line = 0);
ATTNCC_EMU_RUNTIME void cp_async_commit();
ATTNCC_EMU_RUNTIME void cp_async_wait(int pending);
ATTNCC_EMU_RUNTIME void launch_blocks(const char* name, dim3 grid, dim3 block, size_t smem_bytes,
                                      std::function<void()> body);

// Runs `kernel()` for every block of the grid, blocks one after another; `name` labels its
// performance counters.
template <typename Kernel>
void launch(const char* name, dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel) {
  launch_blocks(name, grid, block, smem_bytes, [&kernel]() { kernel(); });
}

}  // namespace attncc_emu

#if !defined(ATTNCC_SHARED_INSTANCES) || defined(ATTNCC_INSTANCES_SOURCE)
#include "attncc/cuda/emulator_runtime.h"
#endif
#undef ATTNCC_EMU_RUNTIME
