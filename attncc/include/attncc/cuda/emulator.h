// attncc CUDA emulator: runs the exact text of a generated .cu kernel on the host.
//
// Every CUDA thread is a user-space fiber with its own stack; a hand-written x86-64 context
// switch (ucontext elsewhere) moves between them only at synchronisation points: barriers,
// warp collectives and cp.async waits. Blocks run one after another. Two schedules exist and
// kernels must give identical bits under both:
//   kLockStep   - every thread in turn (0, 1, 2, ...) runs to its next sync point;
//   kWarpGreedy - warps in reverse order, each running all its lanes to the next barrier.
// A missing __syncthreads makes some thread read shared memory before or after its writer
// depending on the schedule, so the results differ. Shared memory is poisoned (0xFF bytes,
// NaN in fp16/fp32) at the start of each block; cp.async copies land at cp.async.wait_group,
// so a missing wait reads poison.
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
#include <functional>
#include <stdexcept>
#include <string>
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
  std::vector<unsigned char> bytes;
  long group;
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
  std::string error;
  void* scheduler_sp = nullptr;
  int current = -1;
  std::function<void()> body;
};

inline thread_local BlockState* tls_block = nullptr;

// ------------------------------------------------------------------------ context switch
#if defined(ATTNCC_EMU_ASM_SWITCH)
extern "C" void attncc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.hidden attncc_emu_switch
.globl attncc_emu_switch
.type attncc_emu_switch,@function
attncc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size attncc_emu_switch, .-attncc_emu_switch
)");
#endif

inline void fiber_main();

#if defined(ATTNCC_EMU_ASM_SWITCH)
extern "C" inline void attncc_emu_entry() {
  fiber_main();
  __builtin_unreachable();
}

inline void prepare_stack(Fiber& f) {
  // Layout read by attncc_emu_switch: six callee-saved registers, then the return address.
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;  // fake return address of the entry function (keeps 16-byte alignment)
  *--sp = reinterpret_cast<void*>(&attncc_emu_entry);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  f.sp = sp;
}
inline void switch_to(void** save, void* load) { attncc_emu_switch(save, load); }
#else
// Portable fallback: ucontext (slower: every switch saves the signal mask with a syscall).
// A fiber's `sp` points at its ucontext_t, kept at the top of its stack.
extern "C" inline void attncc_emu_entry() { fiber_main(); }

inline void prepare_stack(Fiber& f) {
  auto* ctx = reinterpret_cast<ucontext_t*>(f.stack + kStackBytes - sizeof(ucontext_t) - 64);
  getcontext(ctx);
  ctx->uc_stack.ss_sp = f.stack;
  ctx->uc_stack.ss_size = kStackBytes - sizeof(ucontext_t) - 128;
  ctx->uc_link = nullptr;
  makecontext(ctx, reinterpret_cast<void (*)()>(&attncc_emu_entry), 0);
  f.sp = ctx;
}
inline thread_local ucontext_t scheduler_context;
inline void switch_to(void** save, void* load) {
  // the scheduler saves into its own context; fibers save into the ucontext at their `sp`
  ucontext_t* from = *save ? static_cast<ucontext_t*>(*save) : &scheduler_context;
  *save = from;
  swapcontext(from, static_cast<ucontext_t*>(load));
}
#endif

inline void yield_to_scheduler() {
  BlockState* b = tls_block;
  Fiber& f = b->fibers[b->current];
  switch_to(&f.sp, b->scheduler_sp);
}

inline void fail(const std::string& message) {
  BlockState* b = tls_block;
  if (b->error.empty()) b->error = message;
  b->fibers[b->current].state = State::kDone;
  yield_to_scheduler();
  __builtin_unreachable();
}

inline void fiber_main() {
  BlockState* b = tls_block;
  b->body();
  // On a GPU an exited block's shared memory goes to the next block: a copy still in flight
  // would land in it.
  if (const size_t pending = b->copies[b->current].size())
    fail("thread " + std::to_string(b->current) + " exited with " + std::to_string(pending) +
         " cp.async copies in flight (no cp.async.wait_group covers them)");
  b->fibers[b->current].state = State::kDone;
  yield_to_scheduler();
}

// ------------------------------------------------------------------------ thread identity
inline int thread_index() { return tls_block->current; }
inline dim3 thread_idx() {
  BlockState* b = tls_block;
  int t = b->current;
  return dim3(t % b->block_dim.x, (t / b->block_dim.x) % b->block_dim.y, t / (b->block_dim.x * b->block_dim.y));
}
inline int lane_id() { return thread_index() % kWarpSize; }

// ------------------------------------------------------------------------ barrier
inline void syncthreads() {
  BlockState* b = tls_block;
  b->fibers[b->current].state = State::kBarrier;
  yield_to_scheduler();
}

// ------------------------------------------------------------------------ warp collectives
// Each lane passes `n_in` words (and optionally an address); `compute` runs once, in the last
// lane to arrive, and fills `out` for every lane of the mask.
using Compute = void (*)(WarpSlot& slot, unsigned mask);

// The collective operations the device primitives issue (attncc/cuda/primitives.cuh).
enum CollectiveOp { kShflXor = 1, kMmaF16, kMmaBf16, kLdmatrix, kLdmatrixTrans, kMmaF16K8 };

inline const char* op_name(int op) {
  switch (op) {
    case kShflXor: return "shfl.xor";
    case kMmaF16: return "mma.m16n8k16.f16";
    case kMmaBf16: return "mma.m16n8k16.bf16";
    case kMmaF16K8: return "mma.m16n8k8.f16";
    case kLdmatrix: return "ldmatrix.x4";
    case kLdmatrixTrans: return "ldmatrix.x4.trans";
    default: return "no operation";
  }
}

inline void warp_collective(int op, unsigned mask, const uint32_t* in, int n_in, const void* addr, uint32_t* out,
                            int n_out, Compute compute) {
  BlockState* b = tls_block;
  const int tid = b->current, lane = tid % kWarpSize, warp = tid / kWarpSize;
  WarpSlot& slot = b->warps[warp];
  if (!((mask >> lane) & 1u)) {
    fail("lane " + std::to_string(lane) + " of warp " + std::to_string(warp) + " called " + op_name(op) +
         " outside its mask 0x" + std::to_string(mask));
  }
  if (slot.arrived != 0 && (slot.op != op || slot.mask != mask)) {
    fail(std::string("warp ") + std::to_string(warp) + ": lane " + std::to_string(lane) + " called " + op_name(op) +
         " while other lanes are in " + op_name(slot.op) + " (masks " + std::to_string(mask) + " vs " +
         std::to_string(slot.mask) + ")");
  }
  slot.op = op;
  slot.mask = mask;
  std::memcpy(slot.in[lane], in, sizeof(uint32_t) * n_in);
  slot.addr[lane] = addr;
  slot.arrived |= 1u << lane;
  const unsigned my_generation = slot.generation;
  if (slot.arrived == mask) {
    compute(slot, mask);
    slot.arrived = 0;
    slot.op = -1;
    ++slot.generation;
  } else {
    Fiber& f = b->fibers[tid];
    f.state = State::kCollective;
    f.collective_generation = my_generation;
    while (slot.generation == my_generation) yield_to_scheduler();
    f.state = State::kReady;
  }
  std::memcpy(out, slot.out[lane], sizeof(uint32_t) * n_out);
}

// ------------------------------------------------------------------------ cp.async
inline void cp_async(void* dst_shared, const void* src_global, int bytes) {
  BlockState* b = tls_block;
  PendingCopy copy{dst_shared, std::vector<unsigned char>(bytes), b->committed[b->current]};
  std::memcpy(copy.bytes.data(), src_global, bytes);  // the source is read at issue
  b->copies[b->current].push_back(std::move(copy));
}
inline void cp_async_commit() { ++tls_block->committed[tls_block->current]; }
// Land every copy except those in the `pending` most recent committed groups.
inline void cp_async_wait(int pending) {
  BlockState* b = tls_block;
  auto& list = b->copies[b->current];
  const long limit = b->committed[b->current] - pending;
  std::vector<PendingCopy> keep;
  for (auto& c : list) {
    if (c.group < limit) std::memcpy(c.dst, c.bytes.data(), c.bytes.size());
    else keep.push_back(std::move(c));
  }
  list.swap(keep);
}

// ------------------------------------------------------------------------ launch
inline std::string describe_states(const BlockState& b) {
  std::string text;
  for (const Fiber& f : b.fibers) {
    const char* s = f.state == State::kReady ? "R" : f.state == State::kBarrier ? "B" : f.state == State::kCollective ? "C" : "D";
    text += s;
  }
  return text;
}

// Run one block to completion under `schedule`; returns an error message or "".
inline std::string run_block(BlockState& b, Schedule schedule) {
  const int n = b.threads;
  std::vector<int> order;
  if (schedule == kLockStep) {
    for (int t = 0; t < n; ++t) order.push_back(t);
  } else {
    const int warps = (n + kWarpSize - 1) / kWarpSize;
    for (int w = warps - 1; w >= 0; --w)
      for (int l = 0; l < kWarpSize && w * kWarpSize + l < n; ++l) order.push_back(w * kWarpSize + l);
  }
  while (true) {
    bool progressed = false;
    if (schedule == kLockStep) {
      for (int t : order) {
        Fiber& f = b.fibers[t];
        if (f.state == State::kReady || f.state == State::kCollective) {
          const unsigned before = b.warps[t / kWarpSize].generation;
          const State was = f.state;
          if (was == State::kCollective && before == f.collective_generation) continue;
          b.current = t;
          switch_to(&b.scheduler_sp, f.sp);
          progressed = true;
          if (!b.error.empty()) return b.error;
        }
      }
    } else {
      // warp-greedy: each warp's lanes run until all are at a barrier or done
      for (size_t k = 0; k < order.size();) {
        const int w = order[k] / kWarpSize;
        size_t end = k;
        while (end < order.size() && order[end] / kWarpSize == w) ++end;
        bool warp_progress = true;
        while (warp_progress) {
          warp_progress = false;
          for (size_t q = k; q < end; ++q) {
            Fiber& f = b.fibers[order[q]];
            if (f.state == State::kReady ||
                (f.state == State::kCollective && b.warps[w].generation != f.collective_generation)) {
              b.current = order[q];
              switch_to(&b.scheduler_sp, f.sp);
              warp_progress = progressed = true;
              if (!b.error.empty()) return b.error;
            }
          }
        }
        k = end;
      }
    }
    int at_barrier = 0, done = 0, in_collective = 0;
    for (const Fiber& f : b.fibers) {
      at_barrier += f.state == State::kBarrier;
      done += f.state == State::kDone;
      in_collective += f.state == State::kCollective;
    }
    if (done == n) return "";
    if (at_barrier > 0 && at_barrier + in_collective == n && in_collective == 0) {
      for (Fiber& f : b.fibers) f.state = State::kReady;
      continue;
    }
    if (at_barrier > 0 && done > 0 && at_barrier + done == n) {
      return "divergent __syncthreads: " + std::to_string(at_barrier) + " threads wait at a barrier that " +
             std::to_string(done) + " exited threads never reach (states " + describe_states(b) + ")";
    }
    if (!progressed) {
      return "deadlock: no thread can run (R ready, B barrier, C collective, D done): " + describe_states(b);
    }
  }
}

struct Launch {
  dim3 grid, block;
  size_t smem_bytes;
  Schedule schedule;
};

inline Schedule& current_schedule() {
  static Schedule schedule = kLockStep;
  return schedule;
}

// Runs `kernel()` for every block of the grid, blocks one after another.
template <typename Kernel>
void launch(dim3 grid, dim3 block, size_t smem_bytes, Kernel kernel) {
  // The CUDA runtime's limits on a launch configuration: a kernel that relies on more fails on
  // a GPU (cudaErrorInvalidConfiguration), so it fails here too.
  const bool grid_ok = grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 && grid.z >= 1 &&
                       grid.z <= 65535;
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (!grid_ok || threads < 1 || threads > 1024 || block.z > 64)
    throw EmulationError("invalid launch configuration: grid (" + std::to_string(grid.x) + ", " +
                         std::to_string(grid.y) + ", " + std::to_string(grid.z) + "), block (" +
                         std::to_string(block.x) + ", " + std::to_string(block.y) + ", " + std::to_string(block.z) + ")");
  BlockState b;
  b.grid_dim = grid;
  b.block_dim = block;
  b.threads = int(block.x * block.y * block.z);
  b.fibers.resize(b.threads);
  b.warps.resize((b.threads + kWarpSize - 1) / kWarpSize);
  std::vector<char> stacks(size_t(b.threads) * kStackBytes);
  std::vector<unsigned char> smem(smem_bytes + 16);
  b.smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem.data()) + 15) & ~uintptr_t(15));
  b.smem_bytes = smem_bytes;
  b.body = [&kernel]() { kernel(); };
  BlockState* saved = tls_block;
  tls_block = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.block_idx = dim3(x, y, z);
        std::memset(b.smem, 0xFF, smem_bytes);  // poison
        b.copies.assign(b.threads, {});
        b.committed.assign(b.threads, 0);
        for (auto& w : b.warps) { w.arrived = 0; w.op = -1; }
        for (int t = 0; t < b.threads; ++t) {
          Fiber& f = b.fibers[t];
          f = Fiber{};
          f.tid = t;
          f.stack = stacks.data() + size_t(t) * kStackBytes;
          prepare_stack(f);
        }
        const std::string error = run_block(b, current_schedule());
        if (!error.empty()) {
          tls_block = saved;
          throw EmulationError("block (" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) +
                               "): " + error);
        }
      }
  tls_block = saved;
}

}  // namespace attncc_emu
