// attncc CUDA emulator's runtime: what emulator.h declares, defined once per library (the
// instances object) or inline in every object (see "the runtime" there). Included by emulator.h only.
#pragma once

namespace attncc_emu {

// Wavefronts of one shared-memory phase: the most distinct 4-byte words in any one bank.
ATTNCC_EMU_RUNTIME long long phase_wavefronts(const uintptr_t* addr, const bool* active, int lanes, int bytes) {
  std::vector<uintptr_t> words[32];
  bool any = false;
  for (int l = 0; l < lanes; ++l) {
    if (!active[l]) continue;
    any = true;
    for (uintptr_t w = addr[l] / 4; w <= (addr[l] + bytes - 1) / 4; ++w) {
      auto& bank = words[w % 32];
      if (std::find(bank.begin(), bank.end(), w) == bank.end()) bank.push_back(w);
    }
  }
  size_t most = any ? 1 : 0;
  for (auto& bank : words) most = std::max(most, bank.size());
  return static_cast<long long>(most);
}

ATTNCC_EMU_RUNTIME void count_request(int line, int op, unsigned mask, int bytes, const uintptr_t* addr) {
  SiteCounter& c = tls_counters->sites[{line, op}];
  const int lanes = __builtin_popcount(mask);
  ++c.requests;
  c.lanes += lanes;
  c.bytes += static_cast<long long>(lanes) * bytes;
  bool active[32];
  for (int l = 0; l < 32; ++l) active[l] = (mask >> l) & 1u;
  if (is_shared(op)) {  // an ldmatrix: four 8x8 matrices of 16-byte rows, a phase each
    const int phase = op == kOpLdmatrix ? 8 : bytes <= 4 ? 32 : 128 / bytes;
    for (int p = 0; p < 32; p += phase) {
      const long long wavefronts = phase_wavefronts(addr + p, active + p, phase, op == kOpLdmatrix ? 16 : bytes);
      c.wavefronts += wavefronts;
      c.ideal_wavefronts += wavefronts > 0;
    }
  } else if (is_global(op)) {
    std::vector<uintptr_t> sectors, distinct_bytes;
    for (int l = 0; l < 32; ++l) {
      if (!active[l]) continue;
      for (uintptr_t s = addr[l] / 32; s <= (addr[l] + bytes - 1) / 32; ++s)
        if (std::find(sectors.begin(), sectors.end(), s) == sectors.end()) sectors.push_back(s);
      for (int i = 0; i < bytes; ++i) distinct_bytes.push_back(addr[l] + i);
    }
    std::sort(distinct_bytes.begin(), distinct_bytes.end());
    const auto unique_bytes = std::unique(distinct_bytes.begin(), distinct_bytes.end()) - distinct_bytes.begin();
    c.sectors += static_cast<long long>(sectors.size());
    c.ideal_sectors += (unique_bytes + 31) / 32;
    tls_counters->distinct_sectors.insert(sectors.begin(), sectors.end());
  }
}

ATTNCC_EMU_RUNTIME void check_shared(const void* address, int bytes, bool write, int line, int tid, bool collective = false);

// A lane's access (or instruction, for addr == nullptr, bytes == 0); grouped per warp. The
// race check sees every plain shared-memory access here.
ATTNCC_EMU_RUNTIME void record(int op, const void* addr, int bytes, int line) {
  if ((op == kOpLdShared || op == kOpStShared) && tls_block != nullptr && tls_block->race != nullptr)
    check_shared(addr, bytes, op == kOpStShared, line, tls_block->current);
  if (tls_traces == nullptr) return;
  const int tid = tls_block->current;
  WarpTrace& w = (*tls_traces)[tid / kWarpSize];
  const int lane = tid % kWarpSize;
  const long long n = w.occurrences[lane][{line, op}]++;
  PendingRequest& r = w.pending[{line, op, n}];
  r.mask |= 1u << lane;
  r.bytes = bytes;
  r.addr[lane] = reinterpret_cast<uintptr_t>(addr);
}

// Every lane of warp `w` is at a barrier or collective (or done): its requests are complete.
ATTNCC_EMU_RUNTIME void flush_warp(int w) {
  if (tls_traces == nullptr) return;
  WarpTrace& trace = (*tls_traces)[w];
  for (auto& [key, r] : trace.pending) count_request(std::get<0>(key), std::get<1>(key), r.mask, r.bytes, r.addr);
  trace.pending.clear();
  for (auto& lane : trace.occurrences) lane.clear();
}
ATTNCC_EMU_RUNTIME void flush_all_warps() {
  if (tls_traces == nullptr) return;
  for (size_t w = 0; w < tls_traces->size(); ++w) flush_warp(int(w));
}

// The counters as JSON, for attncc/runtime/profile.py.
ATTNCC_EMU_RUNTIME std::string counters_json() {
  std::string text = "{";
  const Profile* profile = active_profile();
  bool first_kernel = true;
  for (const auto& [name, k] : profile ? profile->kernels : std::map<std::string, KernelCounters>{}) {
    text += (first_kernel ? "\"" : ", \"") + name + "\": {\"launches\": " + std::to_string(k.launches) +
            ", \"blocks\": " + std::to_string(k.blocks) + ", \"threads_per_block\": " +
            std::to_string(k.threads_per_block) + ", \"shared_bytes\": " + std::to_string(k.shared_bytes) +
            ", \"distinct_sectors\": " + std::to_string(k.distinct_sectors.size()) +
            ", \"sites\": [";
    first_kernel = false;
    bool first_site = true;
    for (const auto& [site, c] : k.sites) {
      text += std::string(first_site ? "" : ", ") + "{\"line\": " + std::to_string(site.first) + ", \"op\": \"" +
              kOpNames[site.second] + "\", \"requests\": " + std::to_string(c.requests) +
              ", \"lanes\": " + std::to_string(c.lanes) + ", \"wavefronts\": " + std::to_string(c.wavefronts) +
              ", \"ideal_wavefronts\": " + std::to_string(c.ideal_wavefronts) + ", \"sectors\": " +
              std::to_string(c.sectors) + ", \"ideal_sectors\": " + std::to_string(c.ideal_sectors) +
              ", \"bytes\": " + std::to_string(c.bytes) + "}";
      first_site = false;
    }
    text += "]}";
  }
  return text + "}";
}

// ------------------------------------------------------------------------ context switch
#if defined(ATTNCC_EMU_ASM_SWITCH)
// Weak: with the runtime inline every object that includes this header defines it (a kernel's
// forward and backward are two objects of one library), and the linker keeps one, as for an
// inline function; shared, only the instances object does.
extern "C" void attncc_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.hidden attncc_emu_switch
.weak attncc_emu_switch
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

ATTNCC_EMU_RUNTIME void fiber_main();

#if defined(ATTNCC_EMU_ASM_SWITCH)
extern "C" ATTNCC_EMU_RUNTIME void attncc_emu_entry() {
  fiber_main();
  __builtin_unreachable();
}

ATTNCC_EMU_RUNTIME void prepare_stack(Fiber& f) {
  // Layout read by attncc_emu_switch: six callee-saved registers, then the return address.
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;  // fake return address of the entry function (keeps 16-byte alignment)
  *--sp = reinterpret_cast<void*>(&attncc_emu_entry);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  f.sp = sp;
}
ATTNCC_EMU_RUNTIME void switch_to(void** save, void* load) { attncc_emu_switch(save, load); }
#else
// Portable fallback: ucontext (slower: every switch saves the signal mask with a syscall).
// A fiber's `sp` points at its ucontext_t, kept at the top of its stack.
extern "C" ATTNCC_EMU_RUNTIME void attncc_emu_entry() { fiber_main(); }

ATTNCC_EMU_RUNTIME void prepare_stack(Fiber& f) {
  auto* ctx = reinterpret_cast<ucontext_t*>(f.stack + kStackBytes - sizeof(ucontext_t) - 64);
  getcontext(ctx);
  ctx->uc_stack.ss_sp = f.stack;
  ctx->uc_stack.ss_size = kStackBytes - sizeof(ucontext_t) - 128;
  ctx->uc_link = nullptr;
  makecontext(ctx, reinterpret_cast<void (*)()>(&attncc_emu_entry), 0);
  f.sp = ctx;
}
ATTNCC_EMU_RUNTIME void switch_to(void** save, void* load) {
  // the scheduler saves into its own context; fibers save into the ucontext at their `sp`
  ucontext_t* from = *save ? static_cast<ucontext_t*>(*save) : &scheduler_context;
  *save = from;
  swapcontext(from, static_cast<ucontext_t*>(load));
}
#endif

ATTNCC_EMU_RUNTIME void yield_to_scheduler() {
  BlockState* b = tls_block;
  Fiber& f = b->fibers[b->current];
  switch_to(&f.sp, b->scheduler_sp);
}

ATTNCC_EMU_RUNTIME void fail(const std::string& message) {
  BlockState* b = tls_block;
  if (b->error.empty()) b->error = message;
  b->fibers[b->current].state = State::kDone;
  yield_to_scheduler();
  __builtin_unreachable();
}

// ------------------------------------------------------------------------ race check
// Two accesses to a byte race where one of them writes and nothing orders them: they are in
// the same barrier interval and either in different warps, or in one warp with no collective
// between them (shuffles, mma and ldmatrix are .sync: the warp's lanes meet there, so a lane's
// earlier accesses come before every lane's later ones; ldmatrix's own reads are ordered with
// its warp's accesses on either side). A cp.async writes its bytes from its issue until the
// wait that lands them in its thread: any access to them in between races, and after the wait
// its thread's write is ordered with the others' as a store there. The first race ends the
// launch with an error naming the two accesses' lines in kernel.cu. The reads of a byte in one
// interval keep a summary (one reader, or several), which can report a same-warp write after
// several lanes' reads where only its own lane read in that generation.
ATTNCC_EMU_RUNTIME std::string access_text(int tid, bool write, int line) {
  return "thread " + std::to_string(tid) + " (warp " + std::to_string(tid / kWarpSize) + ") " +
         (write ? "writes" : "reads") + " at line " + std::to_string(line);
}

ATTNCC_EMU_RUNTIME void check_shared(const void* address, int bytes, bool write, int line, int tid, bool collective) {
  BlockState* b = tls_block;
  RaceState& r = *b->race;
  const auto* const at = static_cast<const unsigned char*>(address);
  if (at < b->smem || at + bytes > b->smem + b->smem_bytes)
    fail(access_text(tid, write, line) + ": " + std::to_string(bytes) + " bytes at shared offset " +
         std::to_string(at - b->smem) + ", outside the block's " + std::to_string(b->smem_bytes) + " bytes");
  const auto offset = static_cast<size_t>(at - b->smem);
  const int warp = tid / kWarpSize;
  const uint32_t generation = b->warps[warp].generation;
  const auto unordered = [&](int other, uint32_t other_generation) {
    return other / kWarpSize != warp || (!collective && other_generation == generation);
  };
  const auto race = [&](size_t byte, const std::string& other) {
    fail("shared-memory race at offset " + std::to_string(byte) + ": " + access_text(tid, write, line) + ", " +
         other + ", with no barrier between");
  };
  for (size_t byte = offset; byte < offset + bytes; ++byte) {
    ShadowByte& w = r.bytes[byte];
    if (w.block != r.block) w = ShadowByte{r.block};
    if (w.pending >= 0) {
      fail("shared-memory race at offset " + std::to_string(byte) + ": " + access_text(tid, write, line) +
           " while the cp.async of thread " + std::to_string(w.pending) + " (line " + std::to_string(w.write_line) +
           ") into it is in flight (no cp.async.wait_group of its thread before)");
    }
    if (w.write_epoch == r.epoch && w.writer != tid && unordered(w.writer, w.write_generation))
      race(byte, "which thread " + std::to_string(w.writer) + " wrote at line " + std::to_string(w.write_line));
    if (write && w.read_epoch == r.epoch) {
      const bool only_self = w.reader == tid;
      const bool other_warp = w.read_warp != warp;  // (kSeveral: several warps)
      if (other_warp || (!only_self && !collective && w.read_generation == generation))
        race(byte, "which " + (w.reader == kSeveral ? std::string("several threads") : "thread " + std::to_string(w.reader)) +
             " read at line " + std::to_string(w.read_line));
    }
    if (write) {
      w.writer = int16_t(tid), w.write_epoch = r.epoch, w.write_generation = generation, w.write_line = uint16_t(line);
    } else if (w.read_epoch != r.epoch) {
      w.reader = int16_t(tid), w.read_warp = int16_t(warp), w.read_epoch = r.epoch;
      w.read_generation = generation, w.read_line = uint16_t(line);
    } else {
      if (w.reader != tid) w.reader = kSeveral;
      if (w.read_warp != warp) w.read_warp = kSeveral;
      w.read_generation = std::max(w.read_generation, generation), w.read_line = uint16_t(line);
    }
  }
}

// A cp.async of `bytes` to `dst` issued by the current thread: a write from now until it lands.
ATTNCC_EMU_RUNTIME void race_issue_copy(void* dst, int bytes, int line) {
  BlockState* b = tls_block;
  check_shared(dst, bytes, true, line, b->current);
  const auto offset = static_cast<size_t>(static_cast<unsigned char*>(dst) - b->smem);
  for (size_t byte = offset; byte < offset + bytes; ++byte) b->race->bytes[byte].pending = int16_t(b->current);
}

// The current thread's copy `c` has landed: its write, as of now.
ATTNCC_EMU_RUNTIME void race_land_copy(const PendingCopy& c) {
  BlockState* b = tls_block;
  RaceState& r = *b->race;
  const auto offset = static_cast<size_t>(static_cast<unsigned char*>(c.dst) - b->smem);
  for (size_t byte = offset; byte < offset + c.size; ++byte) {
    ShadowByte& w = r.bytes[byte];
    w.pending = -1;
    w.writer = int16_t(b->current), w.write_epoch = r.epoch;
    w.write_generation = b->warps[b->current / kWarpSize].generation;
  }
}

ATTNCC_EMU_RUNTIME void fiber_main() {
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

// ------------------------------------------------------------------------ barrier
ATTNCC_EMU_RUNTIME void syncthreads(int line) {
  record(kOpBarrier, nullptr, 0, line);
  BlockState* b = tls_block;
  b->fibers[b->current].state = State::kBarrier;
  yield_to_scheduler();
}

ATTNCC_EMU_RUNTIME const char* op_name(int op) {
  switch (op) {
    case kShflXor: return "shfl.xor";
    case kMmaF16: return "mma.m16n8k16.f16";
    case kMmaBf16: return "mma.m16n8k16.bf16";
    case kMmaF16K8: return "mma.m16n8k8.f16";
    case kMmaFp8: return "mma.m16n8k32.e4m3.e4m3";
    case kMmaFp8E5M2: return "mma.m16n8k32.e4m3.e5m2";
    case kLdmatrix: return "ldmatrix.x4";
    case kLdmatrixTrans: return "ldmatrix.x4.trans";
    default: return "no operation";
  }
}

ATTNCC_EMU_RUNTIME void warp_collective(int op, unsigned mask, const uint32_t* in, int n_in, const void* addr, uint32_t* out,
                            int n_out, Compute compute, int line) {
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
    if (b->race != nullptr && (op == kLdmatrix || op == kLdmatrixTrans)) {  // each lane's 16-byte row
      for (int l = 0; l < kWarpSize; ++l)
        if ((mask >> l) & 1u) check_shared(slot.addr[l], 16, false, line, warp * kWarpSize + l, true);
    }
    compute(slot, mask);
    if (tls_traces != nullptr) {  // every lane has arrived: its requests since the last sync are complete
      flush_warp(warp);
      const int counted = op == kLdmatrix || op == kLdmatrixTrans ? kOpLdmatrix : op == kShflXor ? kOpShfl : kOpMma;
      uintptr_t addresses[kWarpSize];
      for (int l = 0; l < kWarpSize; ++l) addresses[l] = reinterpret_cast<uintptr_t>(slot.addr[l]);
      count_request(line, counted, mask, counted == kOpLdmatrix ? 16 : 0, addresses);
    }
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
ATTNCC_EMU_RUNTIME void cp_async(void* dst_shared, const void* src_global, int bytes, int line) {
  record(kOpCpAsyncGlobal, src_global, bytes, line);
  record(kOpCpAsyncShared, dst_shared, bytes, line);
  BlockState* b = tls_block;
  if (b->race != nullptr) race_issue_copy(dst_shared, bytes, line);
  PendingCopy copy{dst_shared, bytes, {}, b->committed[b->current]};
  if (b->eager_copies) {
    std::memcpy(dst_shared, src_global, bytes);
  } else {
    copy.bytes.resize(bytes);
    std::memcpy(copy.bytes.data(), src_global, bytes);  // the source is read at issue
  }
  b->copies[b->current].push_back(std::move(copy));
}
ATTNCC_EMU_RUNTIME void cp_async_commit() { ++tls_block->committed[tls_block->current]; }
// Land every copy except those in the `pending` most recent committed groups.
ATTNCC_EMU_RUNTIME void cp_async_wait(int pending) {
  BlockState* b = tls_block;
  auto& list = b->copies[b->current];
  const long limit = b->committed[b->current] - pending;
  std::vector<PendingCopy> keep;
  for (auto& c : list) {
    if (c.group >= limit) {
      keep.push_back(std::move(c));
      continue;
    }
    if (!c.bytes.empty()) std::memcpy(c.dst, c.bytes.data(), c.bytes.size());  // (else it landed at issue)
    if (b->race != nullptr) race_land_copy(c);
  }
  list.swap(keep);
}

// ------------------------------------------------------------------------ launch
ATTNCC_EMU_RUNTIME std::string describe_states(const BlockState& b) {
  std::string text;
  for (const Fiber& f : b.fibers) {
    const char* s = f.state == State::kReady ? "R" : f.state == State::kBarrier ? "B" : f.state == State::kCollective ? "C" : "D";
    text += s;
  }
  return text;
}

// Run one block to completion under `schedule`; returns an error message or "".
ATTNCC_EMU_RUNTIME std::string run_block(BlockState& b, Schedule schedule) {
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
    if (done == n) {
      flush_all_warps();
      return "";
    }
    if (at_barrier > 0 && at_barrier + in_collective == n && in_collective == 0) {
      flush_all_warps();  // every thread is at the barrier: its requests since the last sync are complete
      if (b.race != nullptr) ++b.race->epoch;
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

// Runs `body` for every block of the grid (`launch`).
ATTNCC_EMU_RUNTIME void launch_blocks(const char* name, dim3 grid, dim3 block, size_t smem_bytes,
                                      std::function<void()> body) {
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
  b.body = std::move(body);
  BlockState* saved = tls_block;
  tls_block = &b;
  std::vector<WarpTrace> traces(b.warps.size());
  RaceState race;  // (its bytes start with block 0: no block of this launch touched them)
  uint32_t block_serial = 0;
  if (current_schedule() & kRaceCheck) {
    race.bytes.resize(smem_bytes);
    b.race = &race;
  }
  if (Profile* profile = active_profile()) {
    KernelCounters& k = profile->kernels[name];
    ++k.launches;
    k.blocks += 1ll * grid.x * grid.y * grid.z;
    k.threads_per_block = b.threads;
    k.shared_bytes = smem_bytes;
    tls_counters = &k;
    tls_traces = &traces;
  }
  struct Restore {  // also when a kernel bug ends the launch
    BlockState* saved;
    ~Restore() {
      tls_block = saved;
      tls_traces = nullptr;
      tls_counters = nullptr;
    }
  } restore{saved};
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
        b.eager_copies = (current_schedule() & kEagerCopies) != 0;
        if (b.race != nullptr) {
          race.block = ++block_serial;
          race.epoch = 0;
        }
        const std::string error = run_block(b, Schedule(current_schedule() & kWarpGreedy));
        if (!error.empty()) {
          throw EmulationError("block (" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) +
                               "): " + error);
        }
      }
}

}  // namespace attncc_emu
