// The emulator's runtime: fibers for the threads of one CTA, the block scheduler, warp
// collectives with the PTX fragment layouts, and shared memory / cp.async. See cuda_emu.h.
#include "cuda_emu.h"

#include "common/fp8.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <memory>
#include <unordered_map>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace attn_emu {

thread_local ThreadCtx* g_thread = nullptr;

namespace {

[[noreturn]] void fault(const std::string& what) { throw std::runtime_error("emulated kernel: " + what); }

// ---------------------------------------------------------------- context switch
// x86-64: a hand-rolled switch of the callee-saved registers, MXCSR and the x87 control word
// (a few ns; glibc's swapcontext makes a sigprocmask system call per switch, and an mma.sync
// costs 64 switches). Other targets use ucontext.
#if defined(__x86_64__)
extern "C" void attn_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.hidden attn_emu_switch
.globl attn_emu_switch
.type attn_emu_switch, @function
attn_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size attn_emu_switch, .-attn_emu_switch
)");
#endif

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;

// kMbar: blocked in mbarrier.try_wait on wait_bar for the phase of parity wait_parity;
// kNamed: at the named barrier bar_id (bar.sync id, count)
enum class State { kReady, kBarrier, kWarp, kMbar, kNamed, kDone };
enum class Op { kNone, kShfl, kLdmatrix, kLdmatrixTrans, kMmaF16, kMmaBF16, kMmaS8, kWgmma };
const char* op_name(Op op) {
  switch (op) {
    case Op::kShfl: return "__shfl_xor_sync";
    case Op::kLdmatrix: return "ldmatrix.x4";
    case Op::kLdmatrixTrans: return "ldmatrix.x4.trans";
    case Op::kMmaF16: return "mma.m16n8k16.f16";
    case Op::kMmaBF16: return "mma.m16n8k16.bf16";
    case Op::kMmaS8: return "mma.m16n8k32.s8";
    case Op::kWgmma: return "wgmma.mma_async";
    default: return "none";
  }
}

struct Copy {  // one pending cp.async
  uint32_t dst;
  const unsigned char* src;
  int bytes, src_bytes;
  int group;
};

struct Fiber {
  ThreadCtx ctx;
  int linear, lane, warp;
  int pos;  // position in the scheduling order
  State state;
#if defined(__x86_64__)
  void* sp;
#else
  ucontext_t uc;
#endif
  std::unique_ptr<unsigned char[]> stack;
  std::vector<Copy> copies;
  int commits;  // cp.async groups committed so far; copies of group == commits are uncommitted
  uint32_t wait_bar, wait_parity;
  int bar_id;
};

struct Mbar {  // an mbarrier object: arrivals expected per phase, still pending, the phase number
  int count, pending;
  uint32_t phase;
};
struct NamedBar {
  int arrived = 0, expected = 0;
};

struct Warp {
  Op op;
  int arrived;
  uint32_t in[32][10];
  uint32_t out[32][4];
};

struct Cta {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<int> order;  // fibers by scheduling position
  int nthreads, nwarps, live, at_barrier;
  // __syncthreads_or: the OR of the predicates given at the barrier so far, and the last result
  int vote_acc, vote_result;
  size_t smem_bytes;
  Fiber* cur;
#if defined(__x86_64__)
  void* sched_sp;
#else
  ucontext_t sched_uc;
#endif
  void (*fn)(void*);
  void* ctx;
  std::unordered_map<uint32_t, Mbar> mbars;  // by shared-memory address
  std::unordered_map<int, NamedBar> named;   // by barrier id (1..15)
  std::exception_ptr error;
};

struct Runtime {
  int arch = 90;
  std::unique_ptr<unsigned char[]> smem_buf{new unsigned char[kMaxSmem + 128]};
  // 128-byte aligned, as the kernels declare it
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_buf.get()) + 127) & ~uintptr_t(127));
  std::vector<std::pair<const unsigned char*, const unsigned char*>> ranges;
  std::unordered_map<const void*, int> max_dyn_smem;
  std::vector<std::string> launches;  // kernel names, for take_launches()
  std::vector<LaunchStats> stats;      // per launch, for take_launch_stats()
  Cta cta;
  // the interleaving (set_schedule): warp-serial (else lockstep), warps last-first (reverse)
  bool reverse = false, warp_serial = true;
};
thread_local Runtime rt;

Fiber& self() { return *rt.cta.cur; }

// The next ready fiber after scheduling position `pos`, or null. Warp-serial (the default): the
// lanes of the current warp first, so one warp runs ahead to its next barrier before the next
// starts, and a read of another warp's shared-memory data that lacks a barrier sees the NaN fill
// (lockstep misses a store + read pair that every warp executes at the same point). Lockstep:
// round robin over all threads, every warp advancing one collective per round.
Fiber* next_ready(int pos) {
  Cta& c = rt.cta;
  if (rt.warp_serial) {
    const int w0 = pos - pos % 32;
    for (int i = w0; i < w0 + 32 && i < c.nthreads; ++i) {
      Fiber& f = c.fibers[c.order[i]];
      if (f.state == State::kReady) return &f;
    }
  }
  for (int k = 1; k <= c.nthreads; ++k) {
    int i = pos + k;
    if (i >= c.nthreads) i -= c.nthreads;
    Fiber& f = c.fibers[c.order[i]];
    if (f.state == State::kReady) return &f;
  }
  return nullptr;
}

// The current fiber blocks (or has finished): hand the thread straight to the next ready fiber,
// or back to the scheduler when there is none (all done, or a deadlock) or a fault is pending.
// Suspends the current fiber f and runs `next` (or the scheduler, when null) until f resumes.
void hand_over(Fiber* f, Fiber* next) {
  Cta& c = rt.cta;
  if (next != nullptr) {
    c.cur = next;
    g_thread = &next->ctx;
#if defined(__x86_64__)
    attn_emu_switch(&f->sp, next->sp);
#else
    swapcontext(&f->uc, &next->uc);
#endif
  } else {
#if defined(__x86_64__)
    attn_emu_switch(&f->sp, c.sched_sp);
#else
    swapcontext(&f->uc, &c.sched_uc);
#endif
  }
  g_thread = &f->ctx;  // resumed
  c.cur = f;
}

void yield_to_scheduler() {
  Cta& c = rt.cta;
  hand_over(c.cur, c.error ? nullptr : next_ready(c.cur->pos));
}

// The current fiber stays ready and hands the thread to `next` (a ready fiber) at once.
void switch_to(Fiber& next) {
  Cta& c = rt.cta;
  if (&next != c.cur && !c.error) hand_over(c.cur, &next);
}

void fiber_main() {
  Cta& c = rt.cta;
  Fiber* f = c.cur;
  try {
    c.fn(c.ctx);
  } catch (...) {
    if (!c.error) c.error = std::current_exception();
  }
  f->state = State::kDone;
  --c.live;
  // a thread that exits no longer counts for the barrier
  if (c.live > 0 && c.at_barrier == c.live) {
    c.vote_result = c.vote_acc;
    c.vote_acc = 0;
    for (int t = 0; t < c.nthreads; ++t)
      if (c.fibers[t].state == State::kBarrier) c.fibers[t].state = State::kReady;
    c.at_barrier = 0;
  }
  yield_to_scheduler();
  std::abort();  // a finished fiber is never resumed
}

#if defined(__x86_64__)
extern "C" void attn_emu_fiber_entry() { fiber_main(); }
#else
void fiber_entry_uc() { fiber_main(); }
#endif

void start_fiber(Fiber& f) {
  if (!f.stack) f.stack.reset(new unsigned char[kStackBytes]);
#if defined(__x86_64__)
  // initial frame popped by attn_emu_switch: MXCSR / x87 control word, 6 registers, then the
  // "return address" attn_emu_fiber_entry at a 16-byte aligned slot (so the entry sees the
  // stack alignment of a call)
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack.get()) + kStackBytes) & ~uintptr_t(15);
  uint64_t* s = reinterpret_cast<uint64_t*>(top);
  *--s = 0;
  *--s = reinterpret_cast<uint64_t>(&attn_emu_fiber_entry);
  for (int i = 0; i < 6; ++i) *--s = 0;
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  --s;
  std::memcpy(s, csr, 8);
  f.sp = s;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack.get();
  f.uc.uc_stack.ss_size = kStackBytes;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, fiber_entry_uc, 0);
#endif
}

void resume(Fiber& f) {
  Cta& c = rt.cta;
  c.cur = &f;
  g_thread = &f.ctx;
#if defined(__x86_64__)
  attn_emu_switch(&c.sched_sp, f.sp);
#else
  swapcontext(&c.sched_uc, &f.uc);
#endif
  g_thread = nullptr;
}

std::string where(const Fiber& f) {
  const ThreadCtx& t = f.ctx;
  return "block (" + std::to_string(t.block_idx.x) + "," + std::to_string(t.block_idx.y) + "," +
         std::to_string(t.block_idx.z) + ") thread " + std::to_string(f.linear);
}

void run_cta(uint3 bidx, dim3 grid, dim3 block) {
  Cta& c = rt.cta;
  std::memset(rt.smem, 0xff, c.smem_bytes);
  c.live = c.nthreads;
  c.at_barrier = 0;
  c.vote_acc = c.vote_result = 0;
  c.mbars.clear();
  c.named.clear();
  for (int t = 0; t < c.nthreads; ++t) {
    Fiber& f = c.fibers[t];
    f.linear = t;
    f.lane = t & 31;
    f.warp = t >> 5;
    f.ctx.thread_idx = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    f.ctx.block_idx = bidx;
    f.ctx.block_dim = block;
    f.ctx.grid_dim = grid;
    f.state = State::kReady;
    f.copies.clear();
    f.commits = 0;
    start_fiber(f);
  }
  // reverse (set_schedule): warps last-first (lanes keep their order), another interleaving
  c.order.clear();
  for (int w = 0; w < c.nwarps; ++w) {
    const int ww = rt.reverse ? c.nwarps - 1 - w : w;
    for (int l = 0; l < 32 && 32 * ww + l < c.nthreads; ++l) {
      c.fibers[32 * ww + l].pos = int(c.order.size());
      c.order.push_back(32 * ww + l);
    }
  }
  for (Warp& w : c.warps) {
    w.op = Op::kNone;
    w.arrived = 0;
  }
  while (c.live > 0) {
    // runs fibers (each hands over to the next ready one) until none is ready
    Fiber* f = nullptr;
    for (int i = 0; i < c.nthreads && f == nullptr; ++i)
      if (c.fibers[c.order[i]].state == State::kReady) f = &c.fibers[c.order[i]];
    if (f != nullptr) resume(*f);
    if (c.error) std::rethrow_exception(c.error);
    if (c.live > 0 && next_ready(0) == nullptr) {
      int bar = 0, coll = 0, mbar = 0, named = 0;
      std::string detail;
      for (int t = 0; t < c.nthreads; ++t) {
        const Fiber& f = c.fibers[t];
        if (f.state == State::kBarrier) ++bar;
        if (f.state == State::kMbar) ++mbar;
        if (f.state == State::kNamed) ++named;
        if (f.state == State::kWarp) {
          ++coll;
          if (detail.empty())
            detail = "; " + where(f) + " waits in " + op_name(c.warps[f.warp].op) + " for lanes of warp " +
                     std::to_string(f.warp) + " that exited or wait elsewhere";
        }
      }
      fault("deadlock: " + std::to_string(bar) + " threads at __syncthreads, " + std::to_string(coll) +
            " at a warp collective, " + std::to_string(mbar) + " waiting on mbarriers, " + std::to_string(named) +
            " at named barriers, " + std::to_string(c.nthreads - c.live) + " exited" + detail);
    }
  }
}

// A lane arrives at a collective: deposit in[0..n_in), wait for the warp, take out[0..n_out).
// The last lane computes the results of all 32 (compute(w)).
template <typename Compute>
void collective(Op op, const uint32_t* in, int n_in, uint32_t* out, int n_out, Compute compute) {
  Cta& c = rt.cta;
  Fiber& f = self();
  Warp& w = c.warps[f.warp];
  const int warp_threads = std::min(32, c.nthreads - 32 * f.warp);
  if (warp_threads != 32) fault(std::string(op_name(op)) + " in a partial warp");
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fault("warp " + std::to_string(f.warp) + " diverged: lanes at " + op_name(w.op) + " and " + op_name(op) +
          " (" + where(f) + ")");
  }
  std::memcpy(w.in[f.lane], in, sizeof(uint32_t) * n_in);
  if (++w.arrived == 32) {
    compute(w);
    w.arrived = 0;
    for (int l = 0; l < 32; ++l) {
      Fiber& o = c.fibers[32 * f.warp + l];
      if (o.state == State::kWarp) o.state = State::kReady;
    }
  } else {
    f.state = State::kWarp;
    yield_to_scheduler();
  }
  std::memcpy(out, w.out[f.lane], sizeof(uint32_t) * n_out);
}

void check_smem(uint32_t addr, int bytes, const char* what) {
  if (addr % uint32_t(bytes) != 0)
    fault(std::string(what) + ": shared address " + std::to_string(addr) + " is not " + std::to_string(bytes) +
          "-byte aligned (" + where(self()) + ")");
  if (size_t(addr) + bytes > rt.cta.smem_bytes)
    fault(std::string(what) + ": shared address " + std::to_string(addr) + " + " + std::to_string(bytes) +
          " is past the " + std::to_string(rt.cta.smem_bytes) + " bytes of dynamic shared memory (" +
          where(self()) + ")");
}

float half_bits_to_float(uint16_t h, Elem e) {
  if (e == Elem::kBF16) return __uint_as_float(uint32_t(h) << 16);
  __half x;
  std::memcpy(&x, &h, 2);
  return __half2float(x);
}

// The demangled symbol of a kernel (template instances are exported from the module).
std::string kernel_name(const void* kernel_id) {
  Dl_info info;
  if (dladdr(kernel_id, &info) == 0 || info.dli_sname == nullptr) return "?";
  int status = 0;
  char* dem = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 && dem != nullptr ? dem : info.dli_sname;
  std::free(dem);
  return name;
}

}  // namespace

// ---------------------------------------------------------------- public API
std::vector<std::string> take_launches() {
  std::vector<std::string> out;
  out.swap(rt.launches);
  return out;
}
std::vector<LaunchStats> take_launch_stats() {
  std::vector<LaunchStats> out;
  out.swap(rt.stats);
  return out;
}
void set_arch(int sm) { rt.arch = sm; }
void set_schedule(bool warp_serial, bool reverse) {
  rt.warp_serial = warp_serial;
  rt.reverse = reverse;
}
int arch() { return rt.arch; }
void add_global_range(const void* ptr, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(ptr);
  rt.ranges.emplace_back(p, p + bytes);
}
void clear_global_ranges() { rt.ranges.clear(); }
unsigned char* dynamic_smem() { return rt.smem; }
void set_max_dynamic_smem(const void* kernel_id, int bytes) { rt.max_dyn_smem[kernel_id] = bytes; }

void run_grid(const void* kernel_id, dim3 grid, dim3 block, size_t smem_bytes, void (*fn)(void*), void* ctx) {
  const int nthreads = int(block.x * block.y * block.z);
  if (nthreads < 1 || nthreads > kMaxThreads) fault("launch with " + std::to_string(nthreads) + " threads per block");
  if (grid.y > 65535 || grid.z > 65535 || grid.x < 1 || grid.y < 1 || grid.z < 1)
    fault("invalid grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) + "," + std::to_string(grid.z) + ")");
  const size_t limit = rt.arch >= 90 ? 227 * 1024 : 163 * 1024;
  if (smem_bytes > limit)
    fault("launch asks for " + std::to_string(smem_bytes) + " bytes of shared memory, sm_" +
          std::to_string(rt.arch) + " has " + std::to_string(limit));
  if (smem_bytes > 48 * 1024) {
    auto it = rt.max_dyn_smem.find(kernel_id);
    if (it == rt.max_dyn_smem.end() || size_t(it->second) < smem_bytes)
      fault("launch asks for " + std::to_string(smem_bytes) +
            " bytes of dynamic shared memory without cudaFuncAttributeMaxDynamicSharedMemorySize");
  }
  rt.launches.push_back(kernel_name(kernel_id));
  rt.stats.push_back(LaunchStats{uint64_t(grid.x) * grid.y * grid.z, uint64_t(nthreads), 0, 0, 0});
  Cta& c = rt.cta;
  c.nthreads = nthreads;
  c.nwarps = (nthreads + 31) / 32;
  if (int(c.fibers.size()) < nthreads) c.fibers.resize(nthreads);
  c.warps.resize(c.nwarps);
  c.smem_bytes = smem_bytes;
  c.fn = fn;
  c.ctx = ctx;
  c.error = nullptr;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_cta(make_uint3(x, y, z), grid, block);
}

cudaError_t get_device(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  if (attr == cudaDevAttrComputeCapabilityMajor) {
    *value = rt.arch / 10;
  } else if (attr == cudaDevAttrComputeCapabilityMinor) {
    *value = rt.arch % 10;
  } else if (attr == cudaDevAttrMultiProcessorCount) {
    *value = rt.arch >= 90 ? 132 : 108;  // an H100 SXM, an A100
  } else if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) {
    *value = rt.arch >= 90 ? 232448 : 166912;  // 227 KB, 163 KB
  } else {
    fault("device attribute " + std::to_string(int(attr)) + " is not emulated");
  }
  return cudaSuccess;
}
cudaError_t get_last_error() { return cudaSuccess; }  // emulated faults throw at once
const char* get_error_string(cudaError_t) { return "emulated error"; }
cudaError_t memset_async(void* ptr, int value, size_t bytes, cudaStream_t) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

void syncthreads() { (void)syncthreads_or(0); }

// A barrier that also returns whether any thread's predicate was nonzero. Every fiber reads the
// result when it resumes, before any of them can complete the next barrier.
int syncthreads_or(int pred) {
  Cta& c = rt.cta;
  Fiber& f = self();
  c.vote_acc |= pred != 0;
  if (++c.at_barrier == c.live) {
    if (!rt.stats.empty()) ++rt.stats.back().barriers;
    c.at_barrier = 0;
    c.vote_result = c.vote_acc;
    c.vote_acc = 0;
    for (int t = 0; t < c.nthreads; ++t)
      if (c.fibers[t].state == State::kBarrier) c.fibers[t].state = State::kReady;
    return c.vote_result;
  }
  f.state = State::kBarrier;
  yield_to_scheduler();
  return c.vote_result;
}

// mma.m16n8k16 fragments (g = lane / 4, t = lane % 4; each 32-bit register holds two 16-bit
// elements, the lower column / k index in the low half):
//   A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, k x n):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C, D (16 x 8, fp32):    c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// Products of 16-bit values are exact in double; the k sum and C are added in double and
// rounded once (the hardware's fp32 accumulation rounds differently, within fp32 noise).
void mma_m16n8k16(Elem e, float* c, const uint32_t* a, const uint32_t* b) {
  uint32_t in[10], out[4];
  std::memcpy(in, a, 16);
  std::memcpy(in + 4, b, 8);
  std::memcpy(in + 6, c, 16);
  if (!rt.stats.empty() && self().lane == 0) ++rt.stats.back().mma;  // once per warp
  collective(e == Elem::kF16 ? Op::kMmaF16 : Op::kMmaBF16, in, 10, out, 4, [e](Warp& w) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      const uint32_t* r = w.in[l];
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = half_bits_to_float(uint16_t(r[0] >> (16 * h)), e);
        A[g + 8][2 * t + h] = half_bits_to_float(uint16_t(r[1] >> (16 * h)), e);
        A[g][2 * t + 8 + h] = half_bits_to_float(uint16_t(r[2] >> (16 * h)), e);
        A[g + 8][2 * t + 8 + h] = half_bits_to_float(uint16_t(r[3] >> (16 * h)), e);
        B[2 * t + h][g] = half_bits_to_float(uint16_t(r[4] >> (16 * h)), e);
        B[2 * t + 8 + h][g] = half_bits_to_float(uint16_t(r[5] >> (16 * h)), e);
      }
      C[g][2 * t] = __uint_as_float(r[6]);
      C[g][2 * t + 1] = __uint_as_float(r[7]);
      C[g + 8][2 * t] = __uint_as_float(r[8]);
      C[g + 8][2 * t + 1] = __uint_as_float(r[9]);
    }
    float D[16][8];
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 8; ++j) {
        double s = C[i][j];
        for (int k = 0; k < 16; ++k) s += double(A[i][k]) * double(B[k][j]);
        D[i][j] = float(s);
      }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      w.out[l][0] = __float_as_uint(D[g][2 * t]);
      w.out[l][1] = __float_as_uint(D[g][2 * t + 1]);
      w.out[l][2] = __float_as_uint(D[g + 8][2 * t]);
      w.out[l][3] = __float_as_uint(D[g + 8][2 * t + 1]);
    }
  });
  std::memcpy(c, out, 16);
}

// The s8 form: four int8 per 32-bit word along k (a0 = (g, 4t..4t+3), a1 = (g+8, ..), a2 = (g,
// 16+4t..), a3 = (g+8, 16+4t..); b0 = (k 4t..4t+3, n g), b1 = (k 16+4t.., n g)); C as the f32 form.
void mma_m16n8k32_s8(int32_t* c, const uint32_t* a, const uint32_t* b) {
  uint32_t in[10], out[4];
  std::memcpy(in, a, 16);
  std::memcpy(in + 4, b, 8);
  std::memcpy(in + 6, c, 16);
  if (!rt.stats.empty() && self().lane == 0) ++rt.stats.back().mma;  // once per warp
  collective(Op::kMmaS8, in, 10, out, 4, [](Warp& w) {
    int32_t A[16][32], B[32][8], C[16][8];
    auto byte = [](uint32_t r, int i) { return int32_t(int8_t(uint8_t(r >> (8 * i)))); };
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      const uint32_t* r = w.in[l];
      for (int i = 0; i < 4; ++i) {
        A[g][4 * t + i] = byte(r[0], i);
        A[g + 8][4 * t + i] = byte(r[1], i);
        A[g][16 + 4 * t + i] = byte(r[2], i);
        A[g + 8][16 + 4 * t + i] = byte(r[3], i);
        B[4 * t + i][g] = byte(r[4], i);
        B[16 + 4 * t + i][g] = byte(r[5], i);
      }
      C[g][2 * t] = int32_t(r[6]);
      C[g][2 * t + 1] = int32_t(r[7]);
      C[g + 8][2 * t] = int32_t(r[8]);
      C[g + 8][2 * t + 1] = int32_t(r[9]);
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      for (int e = 0; e < 4; ++e) {
        const int i = g + (e >> 1) * 8, j = 2 * t + (e & 1);
        int64_t s = C[i][j];
        for (int k = 0; k < 32; ++k) s += int64_t(A[i][k]) * B[k][j];
        w.out[l][e] = uint32_t(int32_t(uint32_t(s)));
      }
    }
  });
  std::memcpy(c, out, 16);
}

// ldmatrix.x4: lane 8 m + r gives the address of row r (16 bytes) of matrix m; lane 4 r + t
// receives in register m the 32-bit word t (elements 2t, 2t+1) of row r of matrix m, or with
// .trans of row r of the transposed matrix (elements (2t, r) and (2t+1, r)).
void ldmatrix_x4(uint32_t* r, uint32_t addr, bool trans) {
  uint32_t out[4];
  collective(trans ? Op::kLdmatrixTrans : Op::kLdmatrix, &addr, 1, out, 4, [trans](Warp& w) {
    uint16_t M[4][8][8];
    for (int m = 0; m < 4; ++m)
      for (int row = 0; row < 8; ++row) {
        const uint32_t a = w.in[8 * m + row][0];
        check_smem(a, 16, trans ? "ldmatrix.trans" : "ldmatrix");
        std::memcpy(M[m][row], rt.smem + a, 16);
      }
    for (int l = 0; l < 32; ++l) {
      const int row = l >> 2, t = l & 3;
      for (int m = 0; m < 4; ++m) {
        const uint16_t lo = trans ? M[m][2 * t][row] : M[m][row][2 * t];
        const uint16_t hi = trans ? M[m][2 * t + 1][row] : M[m][row][2 * t + 1];
        w.out[l][m] = uint32_t(lo) | (uint32_t(hi) << 16);
      }
    }
  });
  std::memcpy(r, out, 16);
}

uint32_t shfl_xor_bits(uint32_t mask, uint32_t bits, int lane_mask, int width) {
  if (mask != 0xffffffffu || width != 32) fault("__shfl_xor_sync is emulated for full warps only");
  uint32_t in[2] = {bits, uint32_t(lane_mask)}, out;
  collective(Op::kShfl, in, 2, &out, 1, [](Warp& w) {
    for (int l = 0; l < 32; ++l) {
      const uint32_t src = l ^ (w.in[l][1] & 31);
      w.out[l][0] = w.in[src][0];
    }
  });
  return out;
}

uint32_t smem_u32(const void* ptr) {
  const unsigned char* p = static_cast<const unsigned char*>(ptr);
  if (p < rt.smem || p > rt.smem + kMaxSmem) fault("smem_u32 of a pointer outside shared memory");
  return uint32_t(p - rt.smem);
}

// ---------------------------------------------------------------- mbarriers and named barriers
void mbar_init(uint32_t addr, int count) {
  check_smem(addr, 8, "mbarrier.init");
  if (count < 1) fault("mbarrier.init with count " + std::to_string(count));
  rt.cta.mbars[addr] = Mbar{count, count, 0};
}

void mbar_arrive(uint32_t addr) {
  Cta& c = rt.cta;
  auto it = c.mbars.find(addr);
  if (it == c.mbars.end()) fault("mbarrier.arrive on shared address " + std::to_string(addr) + " before its init (" + where(self()) + ")");
  Mbar& m = it->second;
  if (--m.pending > 0) return;
  m.pending = m.count;
  ++m.phase;  // the phase completes: every waiter for it may go on
  Fiber* woken = nullptr;
  for (int t = 0; t < c.nthreads; ++t) {
    Fiber& f = c.fibers[c.order[t]];
    if (f.state == State::kMbar && f.wait_bar == addr && (m.phase & 1u) != f.wait_parity) {
      f.state = State::kReady;
      if (woken == nullptr) woken = &f;
    }
  }
  // the waiters run at once, before the arriving thread goes on: whatever it starts next (the
  // producer's next cp.async group, still NaN until its own wait) is what a reader that skipped
  // its barrier would see
  if (woken != nullptr) switch_to(*woken);
}

void mbar_wait(uint32_t addr, uint32_t parity) {
  Cta& c = rt.cta;
  auto it = c.mbars.find(addr);
  if (it == c.mbars.end()) fault("mbarrier.try_wait on shared address " + std::to_string(addr) + " before its init (" + where(self()) + ")");
  // the phase of this parity has completed when the current phase has the other parity
  if ((it->second.phase & 1u) != (parity & 1u)) return;
  Fiber& f = self();
  f.state = State::kMbar;
  f.wait_bar = addr;
  f.wait_parity = parity & 1u;
  yield_to_scheduler();
}

void named_barrier(int id, int count) {
  Cta& c = rt.cta;
  if (id < 1 || id > 15) fault("bar.sync id " + std::to_string(id) + " (1..15; 0 is __syncthreads)");
  if (count % 32 != 0 || count < 32 || count > c.nthreads) fault("bar.sync thread count " + std::to_string(count));
  NamedBar& b = c.named[id];
  if (b.arrived > 0 && b.expected != count) fault("bar.sync " + std::to_string(id) + " with different thread counts");
  b.expected = count;
  if (++b.arrived == count) {
    b.arrived = 0;
    for (int t = 0; t < c.nthreads; ++t) {
      Fiber& f = c.fibers[t];
      if (f.state == State::kNamed && f.bar_id == id) f.state = State::kReady;
    }
    return;
  }
  Fiber& f = self();
  f.state = State::kNamed;
  f.bar_id = id;
  yield_to_scheduler();
}

// ---------------------------------------------------------------- wgmma
namespace {

// The 16-bit element (mn, k) of an operand through a 128-byte-swizzle descriptor: K-major
// (mn along 8-row atoms SBO apart, k inside a 128-byte row) or MN-major (mn inside the row,
// 64-element blocks LBO apart; k along rows, 8-row atoms SBO apart).
uint32_t desc_addr(uint64_t desc, int mn, int k, bool mn_major) {
  const uint32_t start = uint32_t(desc & 0x3FFFu) << 4;
  const uint32_t lbo = uint32_t((desc >> 16) & 0x3FFFu) << 4;
  const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFFu) << 4;
  uint32_t a;
  if (!mn_major) {
    a = start + uint32_t(mn % 8) * 128 + uint32_t(mn / 8) * sbo + uint32_t(k / 8) * 16 + uint32_t(k % 8) * 2;
  } else {
    a = start + uint32_t((mn % 64) / 8) * 16 + uint32_t(mn % 8) * 2 + uint32_t(mn / 64) * lbo + uint32_t(k % 8) * 128 +
        uint32_t(k / 8) * sbo;
  }
  return a ^ (((a >> 7) & 7u) << 4);
}

float desc_elem(uint64_t desc, int mn, int k, bool mn_major, Elem e) {
  if ((desc >> 62) != 1u) fault("wgmma: descriptor swizzle mode " + std::to_string(desc >> 62) + " (only 128-byte, 1, is emulated)");
  if (((desc >> 49) & 7u) != 0u) fault("wgmma: descriptor base offset != 0 (atoms must start 1024-aligned)");
  const uint32_t a = desc_addr(desc, mn, k, mn_major);
  check_smem(a, 2, "wgmma operand");
  uint16_t h;
  std::memcpy(&h, rt.smem + a, 2);
  return half_bits_to_float(h, e);
}

// A warp's accumulators as C fragments, to and from its 16 x n matrix: lane l's d[4 nt + x] is
// (row g + 8 (x >= 2), column 8 nt + 2 t + (x & 1)), g = l / 4, t = l % 4. accumulate false reads
// zeros (the first k-step overwrites).
template <typename M, typename D>
void frags_to_matrix(D* const* dl, int n, bool accumulate, M (*c)[128]) {
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int nt = 0; nt < n / 8; ++nt)
      for (int x = 0; x < 4; ++x)
        c[g + (x >= 2 ? 8 : 0)][8 * nt + 2 * t + (x & 1)] = accumulate ? M(dl[l][4 * nt + x]) : M(0);
  }
}
template <typename M, typename D>
void matrix_to_frags(const M (*c)[128], int n, D* const* dl) {
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int nt = 0; nt < n / 8; ++nt)
      for (int x = 0; x < 4; ++x) dl[l][4 * nt + x] = D(c[g + (x >= 2 ? 8 : 0)][8 * nt + 2 * t + (x & 1)]);
  }
}

// Byte k (0..31 of a k32 step) of row mn of a K-major 8-bit operand: byte k % 2 of the 16-bit
// element (mn, k / 2) of the same descriptor (8-bit core matrices are 8 rows of 16 bytes, as
// 16-bit ones).
int8_t desc_byte(uint64_t desc, int mn, int k) {
  if ((desc >> 62) != 1u) fault("wgmma: descriptor swizzle mode " + std::to_string(desc >> 62));
  if (((desc >> 49) & 7u) != 0u) fault("wgmma: descriptor base offset != 0 (atoms must start 1024-aligned)");
  const uint32_t a = desc_addr(desc, mn, k / 2, false) + uint32_t(k % 2);
  check_smem(a, 1, "wgmma operand");
  int8_t x;
  std::memcpy(&x, rt.smem + a, 1);
  return x;
}

}  // namespace

namespace {

// The two 8-bit wgmma forms: D (int32_t or float) accumulators of this warp's 16 rows, the A / B
// bytes through desc_byte, each made an M (the sum's type) by elem, the sums in M; `what` names
// the form in faults.
template <typename D, typename M, typename E>
void wgmma_8bit(const char* what, int n, D* d, uint64_t desc_a, uint64_t desc_b, int accumulate, E elem) {
  if (n != 64 && n != 128) fault(std::string(what) + ": n = " + std::to_string(n) + " is not emulated (64 or 128)");
  if (rt.arch < 90) fault("wgmma on an emulated sm_" + std::to_string(rt.arch) + " (sm_90a only)");
  uint32_t in[7] = {};
  const uintptr_t dp = reinterpret_cast<uintptr_t>(d);
  std::memcpy(in, &dp, 8);
  std::memcpy(in + 2, &desc_a, 8);
  std::memcpy(in + 4, &desc_b, 8);
  in[6] = uint32_t(accumulate != 0) | uint32_t(n) << 8;
  const int wq = self().warp % 4;
  uint32_t unused[1];
  collective(Op::kWgmma, in, 7, unused, 0, [n, wq, what, elem](Warp& w) {
    for (int l = 1; l < 32; ++l) {
      if (std::memcmp(w.in[l] + 2, w.in[0] + 2, 5 * sizeof(uint32_t)) != 0)
        fault(std::string(what) + ": lanes of one warp gave different descriptors or flags");
    }
    uint64_t da, db;
    std::memcpy(&da, w.in[0] + 2, 8);
    std::memcpy(&db, w.in[0] + 4, 8);
    const bool acc = (w.in[0][6] & 1u) != 0;
    D* dl[32];
    for (int l = 0; l < 32; ++l) {
      uintptr_t p0;
      std::memcpy(&p0, w.in[l], 8);
      dl[l] = reinterpret_cast<D*>(p0);
    }
    M A[16][32], C[16][128];
    static thread_local M B[32][128];
    for (int r = 0; r < 16; ++r)
      for (int k = 0; k < 32; ++k) A[r][k] = elem(desc_byte(da, 16 * wq + r, k));
    for (int k = 0; k < 32; ++k)
      for (int c = 0; c < n; ++c) B[k][c] = elem(desc_byte(db, c, k));
    frags_to_matrix(dl, n, acc, C);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < n; ++c) {
        M s = C[r][c];
        for (int k = 0; k < 32; ++k) s = M(s + A[r][k] * B[k][c]);
        C[r][c] = s;
      }
    matrix_to_frags(C, n, dl);
  });
}

// int8 sums wrap as the hardware's int32 ones (uint32 arithmetic: no signed overflow here)
struct S8Sum {
  uint32_t v;
  S8Sum(int32_t x = 0) : v(uint32_t(x)) {}
  S8Sum operator+(S8Sum o) const { return S8Sum(int32_t(v + o.v)); }
  S8Sum operator*(S8Sum o) const { return S8Sum(int32_t(v * o.v)); }
  explicit operator int32_t() const { return int32_t(v); }
};

}  // namespace

void wgmma_s8(int n, int32_t* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
  wgmma_8bit<int32_t, S8Sum>("wgmma s8", n, d, desc_a, desc_b, accumulate, [](int8_t x) { return S8Sum(x); });
}

void wgmma_e4m3(int n, float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
  wgmma_8bit<float, double>("wgmma e4m3", n, d, desc_a, desc_b, accumulate,
                            [](int8_t x) { return double(attn::e4m3_to_float(uint8_t(x))); });
}

void wgmma(Elem e, int n, float* d, uint64_t desc_a, const uint32_t* a, uint64_t desc_b, int accumulate, bool trans_a,
           bool trans_b) {
  if (n != 64 && n != 128) fault("wgmma: n = " + std::to_string(n) + " is not emulated (64 or 128)");
  if (rt.arch < 90) fault("wgmma on an emulated sm_" + std::to_string(rt.arch) + " (sm_90a only)");
  uint32_t in[10] = {};
  const uintptr_t dp = reinterpret_cast<uintptr_t>(d), ap = reinterpret_cast<uintptr_t>(a);
  std::memcpy(in, &dp, 8);
  std::memcpy(in + 2, &ap, 8);
  std::memcpy(in + 4, &desc_a, 8);
  std::memcpy(in + 6, &desc_b, 8);
  in[8] = uint32_t(accumulate != 0) | uint32_t(trans_a) << 1 | uint32_t(trans_b) << 2 | uint32_t(n) << 8 |
          uint32_t(e) << 20;
  const int wq = self().warp % 4;  // this warp's quarter of the warpgroup's 64 rows
  uint32_t unused[1];
  collective(Op::kWgmma, in, 10, unused, 0, [e, n, wq, trans_a, trans_b](Warp& w) {
    for (int l = 1; l < 32; ++l) {  // descriptors and flags are warp-uniform, as is the A source
      if (std::memcmp(w.in[l] + 4, w.in[0] + 4, 5 * sizeof(uint32_t)) != 0 ||
          ((w.in[l][2] | w.in[l][3]) != 0) != ((w.in[0][2] | w.in[0][3]) != 0))
        fault("wgmma: lanes of one warp gave different descriptors or flags");
    }
    uint64_t da, db;
    std::memcpy(&da, w.in[0] + 4, 8);
    std::memcpy(&db, w.in[0] + 6, 8);
    const bool acc = (w.in[0][8] & 1u) != 0;
    const bool a_regs = (w.in[0][2] | w.in[0][3]) != 0;
    float* dl[32];
    const uint32_t* al[32];
    for (int l = 0; l < 32; ++l) {
      uintptr_t p0, p1;
      std::memcpy(&p0, w.in[l], 8);
      std::memcpy(&p1, w.in[l] + 2, 8);
      dl[l] = reinterpret_cast<float*>(p0);
      al[l] = reinterpret_cast<const uint32_t*>(p1);
    }
    // A (16 rows of this warp x 16), B (16 x n)
    double A[16][16], C[16][128];
    static thread_local double B[16][128];
    if (a_regs) {
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int h = 0; h < 2; ++h) {
          A[g][2 * t + h] = half_bits_to_float(uint16_t(al[l][0] >> (16 * h)), e);
          A[g + 8][2 * t + h] = half_bits_to_float(uint16_t(al[l][1] >> (16 * h)), e);
          A[g][2 * t + 8 + h] = half_bits_to_float(uint16_t(al[l][2] >> (16 * h)), e);
          A[g + 8][2 * t + 8 + h] = half_bits_to_float(uint16_t(al[l][3] >> (16 * h)), e);
        }
      }
    } else {
      for (int r = 0; r < 16; ++r)
        for (int k = 0; k < 16; ++k) A[r][k] = desc_elem(da, 16 * wq + r, k, trans_a, e);
    }
    for (int k = 0; k < 16; ++k)
      for (int c = 0; c < n; ++c) B[k][c] = desc_elem(db, c, k, trans_b, e);
    frags_to_matrix(dl, n, acc, C);
    for (int r = 0; r < 16; ++r)
      for (int c = 0; c < n; ++c) {
        double s = C[r][c];
        for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][c];
        C[r][c] = s;
      }
    matrix_to_frags(C, n, dl);
  });
}

void cp_async(uint32_t dst, const void* src, int bytes, int src_bytes) {
  check_smem(dst, bytes, "cp.async");
  const unsigned char* s = static_cast<const unsigned char*>(src);
  if (src_bytes > 0) {
    if (reinterpret_cast<uintptr_t>(s) % bytes != 0) fault("cp.async: misaligned global source (" + where(self()) + ")");
    bool inside = false;
    for (const auto& r : rt.ranges) inside = inside || (s >= r.first && s + src_bytes <= r.second);
    if (!inside) fault("cp.async: global source outside the kernel's tensors (" + where(self()) + ")");
  }
  if (!rt.stats.empty()) rt.stats.back().cp_async_bytes += uint64_t(src_bytes > 0 ? src_bytes : 0);
  std::memset(rt.smem + dst, 0xff, bytes);  // undefined until the group is waited for
  Fiber& f = self();
  f.copies.push_back(Copy{dst, s, bytes, src_bytes, f.commits});
}

void cp_async_commit() { ++self().commits; }

void cp_async_wait(int n) {
  Fiber& f = self();
  const int done = f.commits - n;  // groups [0, done) complete
  size_t keep = 0;
  for (size_t i = 0; i < f.copies.size(); ++i) {
    const Copy& cp = f.copies[i];
    if (cp.group < done) {
      std::memcpy(rt.smem + cp.dst, cp.src, cp.src_bytes);
      std::memset(rt.smem + cp.dst + cp.src_bytes, 0, cp.bytes - cp.src_bytes);
    } else {
      f.copies[keep++] = cp;
    }
  }
  f.copies.resize(keep);
}

void st_shared_b32(uint32_t addr, uint32_t v) {
  check_smem(addr, 4, "st.shared.b32");
  std::memcpy(rt.smem + addr, &v, 4);
}

uint4 ld_shared_v4(uint32_t addr) {
  check_smem(addr, 16, "ld.shared.v4.u32");
  uint4 v;
  std::memcpy(&v, rt.smem + addr, 16);
  return v;
}

uint32_t ld_shared_b32(uint32_t addr) {
  check_smem(addr, 4, "ld.shared.u32");
  uint32_t v;
  std::memcpy(&v, rt.smem + addr, 4);
  return v;
}

float2 ld_shared_v2f(uint32_t addr) {
  check_smem(addr, 8, "ld.shared.v2.f32");
  float2 v;
  std::memcpy(&v, rt.smem + addr, 8);
  return v;
}

}  // namespace attn_emu
