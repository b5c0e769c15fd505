// Host build of intrinsics.cuh: every wna16_* device intrinsic emulated from the PTX ISA's
// semantics and fragment tables, and the small CUDA runtime that the launchers need, so that the
// kernel sources (.cu) compile with g++ and run on the CPU.
//
// Execution model (docs/kernel-emulation.md has the long form):
//   * a launch runs its blocks on "teams" of real threads, one std::thread per CUDA thread of the
//     block; a team runs one block after another (WNA16_EMU_BLOCKS teams run side by side, default
//     one), threads are created once per launch and reused for every block; with a schedule
//     seed (WNA16_EMU_SEED, non-zero) the blocks are dealt to the teams in a seeded random order
//     and each block starts after a seeded random delay, so blocks overlap differently per seed;
//   * wna16_syncthreads is a barrier of the block's threads; warp collectives (mma, ldmatrix,
//     shuffles, ballot, syncwarp) are a rendezvous of the warp's 32 lanes, each lane depositing its
//     operands and computing its own result from the others' -- as the hardware's fragment tables
//     say, so a fragment bug gives wrong numbers here as on a GPU;
//   * dynamic shared memory is one exactly sized heap block per team, filled with a poison pattern
//     (16-bit 0x7FFF: NaN as fp16/bf16/fp32, a huge int32) before every block;
//   * cp.async reads its source and overwrites its destination with the poison pattern when it is
//     issued (the copy may land any time from then on), and reads the source again and writes the
//     data when a cp.async.wait_group retires its group: a read of the destination before the wait
//     sees poison, a copy issued into a buffer that another thread still reads races with that
//     read, and a source that changes between issue and wait aborts;
//   * a barrier or collective that not every thread reaches (an early return, divergence) aborts
//     with a message instead of hanging; so do misaligned or non-shared ldmatrix/cp.async addresses;
//   * with fibers on (Device::fibers, WNA16_EMU_FIBERS=1) a team is one OS thread and its CUDA
//     threads are user-level contexts that switch at every barrier and collective: the same
//     kernels, orders and checks without a kernel round trip per hand-off (a futex wake and
//     sleep per lane per collective costs far more than the collective's arithmetic), and teams
//     side by side then use that many cores. ThreadSanitizer does not follow such switches: the
//     sanitizer builds keep real threads.
// The synchronisation is built on C++ atomics (acquire/release), which ThreadSanitizer models, so a
// missing wna16_syncthreads between a shared-memory write and another thread's read is reported.
// Global atomics are relaxed, as atomicAdd / atomicCAS are on the device: only ld.acquire,
// st.release and a fence order other memory, so a consumer that trusts a relaxed counter without
// an acquire is reported by ThreadSanitizer; relaxed atomics may yield the CPU (seeded) to widen
// the window in which other blocks interleave.
#pragma once

#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------------
// CUDA language keywords and built-in types

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// Static shared memory has no per-block meaning for a host thread: declare it through
// WNA16_SHARED_MEMORY (dynamic shared memory) instead. Using __shared__ fails to compile here.
#define __shared__ wna16_static_shared_memory_is_not_emulated_use_WNA16_SHARED_MEMORY
// __restrict__ is a g++ keyword already.

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};

// 16-bit float storage types (bit patterns only, member __x; no cuda_fp16.h arithmetic or
// conversion functions: kernels convert through the wna16_* functions).
struct __half {
  uint16_t __x;
};
typedef __half half;
struct __nv_bfloat16 {
  uint16_t __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

// The built-in indices of the thread running the kernel (set by the launch).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// ---------------------------------------------------------------------------------------------
// The CUDA runtime subset the launchers use

typedef struct wna16_emu_stream* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
};

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMemoryClockRate = 36,
  cudaDevAttrGlobalMemoryBusWidth = 37,
  cudaDevAttrL2CacheSize = 38,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

namespace wna16 {
namespace emu {

// The emulated device. Defaults: an H100/H200-class sm_90 part with 132 SMs; the environment
// (WNA16_EMU_SMS, WNA16_EMU_CC = "90", WNA16_EMU_SMEM_OPTIN) or a test may change them.
struct Device {
  int sms = 132;
  int cc_major = 9, cc_minor = 0;
  int smem_per_block = 48 * 1024;
  int smem_optin = 227 * 1024;
  int mem_clock_khz = 2619000;
  int bus_width_bits = 5120;
  int l2_bytes = 50 * 1024 * 1024;
  int runtime_version = 12080, driver_version = 12080;
  int concurrent_blocks = 1;  // teams of threads running blocks side by side
  int seed = 0;               // block schedule and yield seed; 0 = blocks in index order, no yields
  bool fibers = false;        // a team's threads as user-level contexts on one OS thread
  double timeout_s = 120;     // a barrier or collective waiting longer than this aborts
};

inline int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return (v && *v) ? atoi(v) : fallback;
}

inline Device& device() {
  static Device d = [] {
    Device x;
    x.sms = env_int("WNA16_EMU_SMS", x.sms);
    const int cc = env_int("WNA16_EMU_CC", x.cc_major * 10 + x.cc_minor);
    x.cc_major = cc / 10, x.cc_minor = cc % 10;
    x.smem_optin = env_int("WNA16_EMU_SMEM_OPTIN", x.smem_optin);
    x.concurrent_blocks = env_int("WNA16_EMU_BLOCKS", x.concurrent_blocks);
    x.seed = env_int("WNA16_EMU_SEED", x.seed);
    x.timeout_s = env_int("WNA16_EMU_TIMEOUT_S", (int)x.timeout_s);
    x.fibers = env_int("WNA16_EMU_FIBERS", 0) != 0;
    return x;
  }();
  return d;
}

inline cudaError_t& last_error() {
  static thread_local cudaError_t e = cudaSuccess;
  return e;
}

// Each launcher sets its kernel's limit before every launch, and verify runs launches from several
// host threads at once (as streams would): the map is only touched under its lock.
inline std::map<const void*, int>& func_smem_limits() {
  static std::map<const void*, int> m;
  return m;
}
inline std::mutex& func_smem_limits_lock() {
  static std::mutex m;
  return m;
}

[[noreturn]] inline void fatal(const char* fmt, const char* what) {
  fprintf(stderr, "wna16 emulation: ");
  fprintf(stderr, fmt, what);
  fprintf(stderr, " (block %u,%u,%u thread %u,%u,%u)\n", blockIdx.x, blockIdx.y, blockIdx.z,
          threadIdx.x, threadIdx.y, threadIdx.z);
  fflush(stderr);
  abort();
}

// ---------------------------------------------------------------------------------------------
// Barriers: a counter and a generation word; waiters sleep on the generation (futex). The
// acq_rel counter and the release/acquire generation give every thread's writes before the
// barrier a happens-before edge to every thread's reads after it, which ThreadSanitizer sees.

inline void futex_wait(std::atomic<uint32_t>* word, uint32_t value, long ns) {
  timespec ts{0, ns};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, value, &ts, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// Fibers: set on a team's OS thread while its CUDA threads run as user-level contexts.
struct FiberRunner;
inline FiberRunner*& fiber_runner() {
  static thread_local FiberRunner* r = nullptr;
  return r;
}
inline void fiber_yield();  // back to the team's scheduler, which resumes the next context

struct Barrier {
  std::atomic<int> count{0};
  std::atomic<uint32_t> gen{0};
  std::atomic<int> exited{0};  // threads of this group that left the kernel
  int expected = 0;

  void wait(const char* what) {
    const uint32_t g = gen.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) + 1 == expected) {
      count.store(0, std::memory_order_relaxed);
      gen.fetch_add(1, std::memory_order_release);
      if (!fiber_runner()) futex_wake_all(&gen);
      return;
    }
    if (fiber_runner()) {  // the others run on this OS thread: hand it over until the last arrives
      timespec t0{};
      for (uint64_t turn = 1; gen.load(std::memory_order_acquire) == g; ++turn) {
        if (exited.load(std::memory_order_acquire) > 0 && gen.load(std::memory_order_acquire) == g)
          fatal("%s not reached by every thread: some exited the kernel (divergent barrier)", what);
        if ((turn & 0xFFFF) == 0) {  // a stuck wait: the clock, now and then
          timespec t1;
          clock_gettime(CLOCK_MONOTONIC, &t1);
          if (turn == 0x10000) t0 = t1;
          else if ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec) > device().timeout_s)
            fatal("%s: waited past WNA16_EMU_TIMEOUT_S (deadlock or divergent barrier)", what);
        }
        fiber_yield();
      }
      return;
    }
    for (int spin = 0; spin < 64; ++spin)
      if (gen.load(std::memory_order_acquire) != g) return;
    const double limit = device().timeout_s;
    timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (gen.load(std::memory_order_acquire) == g) {
      futex_wait(&gen, g, 20 * 1000 * 1000);
      if (gen.load(std::memory_order_acquire) != g) return;
      // an exit seen after the generation load may belong to a thread that passed this very
      // barrier: look at the generation again before calling it divergence
      if (exited.load(std::memory_order_acquire) > 0 && gen.load(std::memory_order_acquire) == g)
        fatal("%s not reached by every thread: some exited the kernel (divergent barrier)", what);
      timespec t1;
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec) > limit)
        fatal("%s: waited past WNA16_EMU_TIMEOUT_S (deadlock or divergent barrier)", what);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Warp collectives: each lane deposits its operands in its slot, the 32 lanes meet at the warp
// barrier, then each lane reads what it needs from the others. Slots alternate between two
// buffers: a lane can only start the collective after next once every lane has arrived at the
// next one, i.e. finished reading this one.

enum Op : int { kOpNone, kOpMma, kOpLdm4, kOpLdm2, kOpLdm4T, kOpShfl, kOpShflXor, kOpBallot, kOpSync };

struct Slot {
  int op;
  int kind;  // mma: 0 = f16, 1 = bf16
  uint32_t r[6];
  const void* ptr;
};

struct Warp {
  Barrier bar;
  Slot slot[2][32];
};

struct Team;

struct ThreadState {
  Team* team = nullptr;
  Warp* warp = nullptr;
  int lane = 0;
  int parity = 0;
  // cp.async: queued copies with the commit group they belong to (-1 = not committed yet)
  struct Copy {
    void* dst;
    const void* src;
    bool pred;
    int64_t group;
    unsigned char seen[16];  // the source as read at issue
  };
  std::vector<Copy> copies;
  int64_t committed = 0;  // groups committed so far
  int64_t retired = 0;    // groups [0, retired) are complete
  uint64_t rng = 0;       // seeded per thread and block (0: no schedule noise)
  // work done, added to the emulator's counters when the thread leaves the launch
  int64_t mma_rows = 0;             // rows of the mma instructions executed (16 each)
  int64_t mma_rows_multiplied = 0;  // those with a non-zero A row (the others add +0)
};

// What the launches since the library was loaded did (wna16_emu_counters).
struct Counters {
  std::atomic<int64_t> launches{0}, blocks{0}, mma_rows{0}, mma_rows_multiplied{0};
  std::atomic<int64_t> os_threads{0};  // OS threads the launches ran on
};
inline Counters& counters() {
  static Counters c;
  return c;
}

// splitmix64: the emulator's seeded noise (block order, start delays, yields)
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline ThreadState& self() {
  static thread_local ThreadState s;
  return s;
}

struct Team {
  int nthreads = 0;
  Barrier block_bar;
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
};

inline void check_in_shared(const void* p, size_t bytes, const char* what) {
  const Team* t = self().team;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (!t || c < t->smem || c + bytes > t->smem + t->smem_bytes)
    fatal("%s: address is not inside the block's dynamic shared memory", what);
}

inline void check_aligned(const void* p, uintptr_t align, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % align) fatal("%s: address is not 16-byte aligned", what);
}

// Deposit, meet, return the slots of this collective (valid until the lane's next collective).
inline const Slot* rendezvous(const Slot& mine) {
  ThreadState& s = self();
  if (!s.warp) fatal("%s called outside a kernel launch", "a warp collective");
  if ((mine.op == kOpMma || mine.op == kOpLdm4 || mine.op == kOpLdm2 || mine.op == kOpLdm4T) &&
      s.warp->bar.expected != 32)
    fatal("%s needs a full warp of 32 threads (blockDim is not a multiple of 32)", "mma/ldmatrix");
  Slot* buf = s.warp->slot[s.parity];
  s.parity ^= 1;
  buf[s.lane] = mine;
  s.warp->bar.wait("a warp collective (mma/ldmatrix/shfl/ballot/syncwarp)");
  for (int l = 0; l < s.warp->bar.expected; ++l)
    if (buf[l].op != mine.op || buf[l].kind != mine.kind)
      fatal("%s: lanes of one warp met at different collectives", "warp collective");
  return buf;
}

// A relaxed atomic may let other threads run first (seeded, about one call in four), so that the
// blocks of a stream-K fix-up interleave differently from run to run.
inline void maybe_yield() {
  uint64_t& r = self().rng;
  if (!r) return;
  r = mix64(r);
  if ((r & 3) == 0) {
    if (fiber_runner()) fiber_yield();
    else std::this_thread::yield();
  }
  if ((r & 63) == 1) {
    timespec ts{0, (long)(1000 + (r >> 40) % 20000)};
    nanosleep(&ts, nullptr);
  }
}

// The poison pattern of shared memory (16-bit 0x7FFF: NaN in fp16, bf16 and fp32; a huge int32).
inline void poison(unsigned char* p, size_t bytes, size_t offset) {
  for (size_t i = 0; i < bytes; ++i) p[i] = ((offset + i) & 1) ? 0x7F : 0xFF;
}

// ---------------------------------------------------------------------------------------------
// 16-bit floating point: exact decoding, and one correctly rounded (nearest even) encoding from
// double for each format, subnormals included; NaN results are the canonical 0x7FFF.

struct Fmt16 {
  int man_bits;  // 10 (fp16) or 7 (bf16)
  int bias;      // 15 or 127
};
constexpr Fmt16 kF16{10, 15};
constexpr Fmt16 kBF16{7, 127};

inline double decode16(uint16_t h, Fmt16 f) {
  const int ebits = 15 - f.man_bits;
  const int emask = (1 << ebits) - 1;
  const int e = (h >> f.man_bits) & emask;
  const int m = h & ((1 << f.man_bits) - 1);
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == emask) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * ldexp((double)m, 1 - f.bias - f.man_bits);
  return sign * ldexp((double)(m | (1 << f.man_bits)), e - f.bias - f.man_bits);
}

// Every 16-bit value decoded once per format (the same exact values decode16 gives).
inline const double* decoded16(Fmt16 f) {
  static const std::vector<double> f16 = [] {
    std::vector<double> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) v[h] = decode16((uint16_t)h, kF16);
    return v;
  }();
  static const std::vector<double> bf16 = [] {
    std::vector<double> v(65536);
    for (uint32_t h = 0; h < 65536; ++h) v[h] = decode16((uint16_t)h, kBF16);
    return v;
  }();
  return f.man_bits == kBF16.man_bits ? bf16.data() : f16.data();
}

inline uint16_t encode16(double x, Fmt16 f) {
  if (isnan(x)) return 0x7FFF;
  const uint16_t sign = signbit(x) ? 0x8000 : 0;
  const int ebits = 15 - f.man_bits;
  const int emax_field = (1 << ebits) - 1;
  const uint16_t inf = (uint16_t)(sign | (emax_field << f.man_bits));
  x = fabs(x);
  if (isinf(x)) return inf;
  if (x == 0) return sign;
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  int e2;
  frexp(x, &e2);  // x = m * 2^e2, m in [0.5, 1)
  const int e = (e2 - 1 < emin) ? emin : e2 - 1;
  const double q = ldexp(1.0, e - f.man_bits);  // spacing of representable values near x
  const double r = nearbyint(x / q) * q;         // exact scaling, round to nearest even
  if (r >= ldexp(1.0, emax_field - 1 - f.bias + 1)) return inf;
  if (r < ldexp(1.0, emin)) return (uint16_t)(sign | (uint16_t)(r / ldexp(1.0, emin - f.man_bits)));
  frexp(r, &e2);
  const int er = e2 - 1;
  const int mant = (int)(r / ldexp(1.0, er - f.man_bits)) - (1 << f.man_bits);
  return (uint16_t)(sign | ((er + f.bias) << f.man_bits) | mant);
}

// a * b + c with one rounding: the product of two 16-bit values is exact in double; the sum is
// taken exactly as (s, err) and rounded to odd, which makes the final rounding to 16 bits exact
// (53 >= 11 + 2 bits).
inline double fma_to_odd(double a, double b, double c) {
  const double p = a * b;
  const double s = p + c;
  if (!isfinite(s) || !isfinite(p) || !isfinite(c)) return s;
  const double bb = s - p;
  const double err = (p - (s - bb)) + (c - bb);
  if (err == 0) return s;
  uint64_t bits;
  memcpy(&bits, &s, 8);
  if ((bits & 1) == 0) return nextafter(s, err > 0 ? INFINITY : -INFINITY);
  return s;
}

inline uint16_t lo16(uint32_t v) { return (uint16_t)(v & 0xffffu); }
inline uint16_t hi16(uint32_t v) { return (uint16_t)(v >> 16); }
inline uint32_t pack16(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

inline uint32_t fma_x2(uint32_t a, uint32_t b, uint32_t c, Fmt16 f) {
  uint16_t out[2];
  for (int i = 0; i < 2; ++i) {
    const int sh = 16 * i;
    const double* value = decoded16(f);
    const double r = fma_to_odd(value[(uint16_t)(a >> sh)], value[(uint16_t)(b >> sh)], value[(uint16_t)(c >> sh)]);
    out[i] = encode16(r, f);
  }
  return pack16(out[0], out[1]);
}

inline float f32_from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Fibers: a team's CUDA threads as user-level contexts on the calling OS thread. The scheduler
// resumes them round robin; a context runs until it waits (a barrier, a collective, a seeded
// yield) and hands the OS thread back. The thread-local state a CUDA thread owns (threadIdx and
// the emulator's ThreadState) is swapped in and out with it; blockIdx, blockDim and gridDim are
// the same for every thread of the team's current block.

// A context switch: on x86-64 the callee-saved registers, the SSE and x87 control words and the
// stack pointer (what a function call may assume unchanged), elsewhere ucontext. swapcontext
// also saves the signal mask, a system call per switch, which the emulated threads never change.
#if defined(__x86_64__)
extern "C" void wna16_emu_switch(void** save_sp, void* next_sp);
asm(R"(
  .text
  .weak wna16_emu_switch
  .hidden wna16_emu_switch
  .type wna16_emu_switch,@function
wna16_emu_switch:
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
  .size wna16_emu_switch, .-wna16_emu_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context* from, Context* to) { wna16_emu_switch(&from->sp, to->sp); }
// A fresh context's stack as wna16_emu_switch leaves a saved one: the control words, six
// callee-saved registers, and the entry as the return address (entered with the stack aligned as
// after a call). The entry never returns.
inline void make_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~(uintptr_t)15;
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16);
  sp[0] = reinterpret_cast<uint64_t>(entry);
  sp -= 7;  // rbp, rbx, r12-r15: zero
  for (int i = 0; i < 7; ++i) sp[i] = 0;
  uint32_t words[2];
  asm volatile("stmxcsr %0" : "=m"(words[0]));
  asm volatile("fnstcw %0" : "=m"(words[1]));
  memcpy(sp, words, 8);
  c->sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
inline void make_context(Context* c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = bytes;
  c->uc.uc_link = nullptr;  // the entry never returns
  makecontext(&c->uc, entry, 0);
}
#endif

struct Fiber {
  Context ctx;
  ThreadState state;
  uint3 tidx{};
  bool finished = false;
};

struct FiberRunner {
  Context scheduler;
  std::vector<Fiber> fibers;
  int64_t current = -1;
  const std::function<void(int64_t)>* body = nullptr;
};

inline void fiber_yield() {
  FiberRunner* r = fiber_runner();
  switch_context(&r->fibers[(size_t)r->current].ctx, &r->scheduler);
}

inline void fiber_entry() {
  FiberRunner* r = fiber_runner();
  const int64_t me = r->current;
  (*r->body)(me);
  r->fibers[(size_t)me].finished = true;
  switch_context(&r->fibers[(size_t)me].ctx, &r->scheduler);  // never resumed
  fatal("%s: a finished fiber was resumed", "the emulator");
}

// Stack per context: the kernels keep their tiles in registers (arrays of a few hundred floats)
// and the emulator's collectives a few vectors; reserved, touched only where used.
constexpr size_t kFiberStack = 256 * 1024;

inline void run_fibers(int64_t n, const std::function<void(int64_t)>& body) {
  FiberRunner r;
  r.body = &body;
  r.fibers.resize((size_t)n);
  const size_t bytes = kFiberStack * (size_t)n;
  void* stacks = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stacks == MAP_FAILED) fatal("%s: cannot reserve the fibers' stacks", "launch");
  for (int64_t i = 0; i < n; ++i)
    make_context(&r.fibers[(size_t)i].ctx, static_cast<char*>(stacks) + kFiberStack * (size_t)i, kFiberStack,
                 fiber_entry);
  fiber_runner() = &r;
  const uint3 own_tidx = threadIdx;
  for (int64_t live = n; live > 0;) {
    live = 0;
    for (int64_t i = 0; i < n; ++i) {
      Fiber& f = r.fibers[(size_t)i];
      if (f.finished) continue;
      r.current = i;
      std::swap(self(), f.state);
      threadIdx = f.tidx;
      switch_context(&r.scheduler, &f.ctx);
      f.tidx = threadIdx;
      std::swap(self(), f.state);
      live += !f.finished;
    }
  }
  threadIdx = own_tidx;
  fiber_runner() = nullptr;
  munmap(stacks, bytes);
}

// ---------------------------------------------------------------------------------------------
// The launch

template <typename Fn>
void run_grid(dim3 grid, dim3 block, size_t smem_bytes, Fn body) {
  const int64_t nthreads = (int64_t)block.x * block.y * block.z;
  const int64_t nblocks = (int64_t)grid.x * grid.y * grid.z;
  int teams = device().concurrent_blocks;
  if (teams < 1) teams = 1;
  if (teams > nblocks) teams = (int)nblocks;
  std::vector<std::unique_ptr<Team>> team(teams);
  for (auto& t : team) {
    t.reset(new Team());
    t->nthreads = (int)nthreads;
    t->block_bar.expected = (int)nthreads;
    for (int64_t w = 0; w * 32 < nthreads; ++w) {
      t->warps.emplace_back(new Warp());
      const int64_t lanes = nthreads - 32 * w;
      t->warps.back()->bar.expected = (int)(lanes < 32 ? lanes : 32);
    }
    t->smem_bytes = smem_bytes;
    t->smem = static_cast<unsigned char*>(::operator new(smem_bytes ? smem_bytes : 1,
                                                         std::align_val_t(16)));
  }
  // A second barrier per team separates blocks: everything of block b happens before block b+1.
  std::vector<std::unique_ptr<Barrier>> between(teams);
  for (auto& b : between) {
    b.reset(new Barrier());
    b->expected = (int)nthreads;
  }
  // which blocks each team runs, in order: index order, or a seeded shuffle dealt round robin
  std::vector<int64_t> order((size_t)nblocks);
  for (int64_t b = 0; b < nblocks; ++b) order[(size_t)b] = b;
  const uint64_t seed = (uint64_t)(uint32_t)device().seed;
  if (seed) {
    uint64_t r = mix64(seed ^ 0x5EEDull);
    for (int64_t i = nblocks - 1; i > 0; --i) {
      r = mix64(r);
      std::swap(order[(size_t)i], order[(size_t)(r % (uint64_t)(i + 1))]);
    }
  }
  // one CUDA thread of team ti: the blocks dealt to the team, one after another
  auto cuda_thread = [&](int ti, int64_t tid) {
    Team* t = team[ti].get();
    ThreadState& s = self();
    s.team = t;
    s.warp = t->warps[tid / 32].get();
    s.lane = (int)(tid % 32);
    s.parity = 0;
    threadIdx = uint3{(unsigned)(tid % block.x), (unsigned)((tid / block.x) % block.y),
                      (unsigned)(tid / ((int64_t)block.x * block.y))};
    blockDim = block;
    gridDim = grid;
    for (int64_t bi = ti; bi < nblocks; bi += teams) {
      const int64_t b = order[(size_t)bi];
      s.rng = seed ? mix64(seed * 0x100000001B3ull ^ (uint64_t)(b << 16) ^ (uint64_t)tid) | 1 : 0;
      blockIdx = uint3{(unsigned)(b % grid.x), (unsigned)((b / grid.x) % grid.y),
                       (unsigned)(b / ((int64_t)grid.x * grid.y))};
      if (tid == 0) {
        poison(t->smem, t->smem_bytes, 0);
        if (seed) {  // a seeded start delay: blocks of different teams overlap differently
          timespec ts{0, (long)(mix64(seed ^ (uint64_t)b) % 200000)};
          nanosleep(&ts, nullptr);
        }
        t->block_bar.exited.store(0, std::memory_order_relaxed);
        for (auto& w : t->warps) w->bar.exited.store(0, std::memory_order_relaxed);
      }
      between[ti]->wait("the emulator's block start");
      s.copies.clear();
      s.committed = s.retired = 0;
      body();
      // leaving the kernel: a barrier or collective still waiting for this thread fails
      t->block_bar.exited.fetch_add(1, std::memory_order_acq_rel);
      s.warp->bar.exited.fetch_add(1, std::memory_order_acq_rel);
      s.copies.clear();  // copies never waited for are dropped
      between[ti]->wait("the emulator's block end");
      if (tid == 0) counters().blocks.fetch_add(1, std::memory_order_relaxed);
    }
    counters().mma_rows.fetch_add(s.mma_rows, std::memory_order_relaxed);
    counters().mma_rows_multiplied.fetch_add(s.mma_rows_multiplied, std::memory_order_relaxed);
    s = ThreadState();
  };
  counters().launches.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::thread> threads;
  counters().os_threads.fetch_add(device().fibers ? teams : teams * nthreads, std::memory_order_relaxed);
  if (device().fibers) {
    threads.reserve((size_t)teams);
    for (int ti = 0; ti < teams; ++ti)
      threads.emplace_back([&, ti] { run_fibers(nthreads, [&](int64_t tid) { cuda_thread(ti, tid); }); });
  } else {
    threads.reserve((size_t)(teams * nthreads));
    for (int ti = 0; ti < teams; ++ti)
      for (int64_t tid = 0; tid < nthreads; ++tid) threads.emplace_back([&, ti, tid] { cuda_thread(ti, tid); });
  }
  for (auto& th : threads) th.join();
  for (auto& t : team) ::operator delete(t->smem, std::align_val_t(16));
}

template <typename... P, typename... A>
void launch(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t, void (*kernel)(P...),
            A&&... args) {
  const int64_t nthreads = (int64_t)block.x * block.y * block.z;
  const int64_t nblocks = (int64_t)grid.x * grid.y * grid.z;
  if (nthreads < 1 || nthreads > 1024 || nblocks < 1 || grid.y > 65535 || grid.z > 65535) {
    last_error() = cudaErrorInvalidConfiguration;
    return;
  }
  int limit = device().smem_per_block;
  {
    std::lock_guard<std::mutex> hold(func_smem_limits_lock());
    const auto it = func_smem_limits().find(reinterpret_cast<const void*>(kernel));
    if (it != func_smem_limits().end()) limit = it->second;
  }
  if (smem_bytes > (size_t)limit) {
    last_error() = cudaErrorInvalidValue;  // what the runtime answers without the opt-in
    return;
  }
  // Parameters are copied once, as the launch copies them to the device's parameter space.
  const std::tuple<typename std::decay<P>::type...> params(std::forward<A>(args)...);
  run_grid(grid, block, smem_bytes, [&] { std::apply(kernel, params); });
}

}  // namespace emu
}  // namespace wna16

inline cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int dev) {
  return dev == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int dev) {
  if (dev != 0) return cudaErrorInvalidDevice;
  const wna16::emu::Device& d = wna16::emu::device();
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = d.smem_per_block; break;
    case cudaDevAttrMultiProcessorCount: *value = d.sms; break;
    case cudaDevAttrMemoryClockRate: *value = d.mem_clock_khz; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = d.bus_width_bits; break;
    case cudaDevAttrL2CacheSize: *value = d.l2_bytes; break;
    case cudaDevAttrComputeCapabilityMajor: *value = d.cc_major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = d.cc_minor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = d.smem_optin; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > wna16::emu::device().smem_optin)
    return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> hold(wna16::emu::func_smem_limits_lock());
  wna16::emu::func_smem_limits()[reinterpret_cast<const void*>(func)] = value;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = wna16::emu::last_error();
  wna16::emu::last_error() = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return wna16::emu::last_error(); }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
  }
  return "unknown error";
}
inline cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = wna16::emu::device().runtime_version;
  return cudaSuccess;
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = wna16::emu::device().driver_version;
  return cudaSuccess;
}
// Launches run to completion on the calling thread, so streams are always idle.
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }

// ---------------------------------------------------------------------------------------------
// The intrinsics (same names and contracts as the device side of intrinsics.cuh)

#define WNA16_DEV inline

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: lane (g = lane/4, t = lane%4) holds
//   a0 = A[g][2t..2t+1]  a1 = A[g+8][2t..]  a2 = A[g][2t+8..]  a3 = A[g+8][2t+8..]
//   b0 = B[2t..2t+1][g]  b1 = B[2t+8..2t+9][g]
//   c/d0..1 = C[g][2t..2t+1]  c/d2..3 = C[g+8][2t..2t+1]
// Products are exact; each output is c + the sum of its 16 products (summed in double), rounded
// to fp32 -- the order and precision of the hardware's sum are not specified, only its inputs.
inline void wna16_emu_mma(float d[4], const uint32_t a[4], const uint32_t b[2], int kind) {
  using namespace wna16::emu;
  Slot mine{};
  mine.op = kOpMma;
  mine.kind = kind;
  for (int i = 0; i < 4; ++i) mine.r[i] = a[i];
  mine.r[4] = b[0], mine.r[5] = b[1];
  ThreadState& me = self();
  const int lane = me.lane;
  const Slot* s = rendezvous(mine);
  const double* value = decoded16(kind ? kBF16 : kF16);
  auto elem = [](uint32_t reg, int hi) { return (uint16_t)(hi ? reg >> 16 : reg & 0xffff); };
  auto A = [&](int row, int k) {  // element A[row][k] from the lane that holds it
    const int g = row & 7, t = (k & 7) >> 1;
    const int reg = (row >> 3) + 2 * (k >> 3);
    return elem(s[4 * g + t].r[reg], k & 1);
  };
  auto B = [&](int k, int n) {
    const int t = (k & 7) >> 1;
    return elem(s[4 * n + t].r[4 + (k >> 3)], k & 1);
  };
  const int g = lane >> 2, t = lane & 3;
  // A row of zeros (a tile's rows past its routed ones are zero-filled) adds +0 to every output
  // of the row when the column's B values are finite: c + 0, as the sum below would give. Such
  // rows are not multiplied, so the emulation's arithmetic follows the routed rows.
  bool zero_row[2], finite_col[2];
  for (int h = 0; h < 2; ++h) {
    bool z = true;
    for (int k = 0; k < 16 && z; ++k) z = (A(g + 8 * h, k) & 0x7fff) == 0;
    zero_row[h] = z;
    const int exp_mask = kind ? 0x7f80 : 0x7c00;
    bool fin = true;
    for (int k = 0; k < 16 && fin; ++k) fin = (B(k, 2 * t + h) & exp_mask) != exp_mask;
    finite_col[h] = fin;
  }
  if (lane == 0) {  // one count per mma: its 16 rows, and those multiplied
    me.mma_rows += 16;
    for (int row = 0; row < 16; ++row) {
      bool z = true;
      for (int k = 0; k < 16 && z; ++k) z = (A(row, k) & 0x7fff) == 0;
      me.mma_rows_multiplied += !z;
    }
  }
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double acc = 0;
    if (!(zero_row[i >> 1] && finite_col[i & 1]))
      for (int k = 0; k < 16; ++k) acc += value[A(row, k)] * value[B(k, col)];  // each product exact
    d[i] = (float)((double)d[i] + acc);
  }
  // Leave no reference into the slots: the next collective of this lane may reuse them.
}

WNA16_DEV void wna16_mma_f16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  wna16_emu_mma(d, a, b, 0);
}
WNA16_DEV void wna16_mma_bf16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  wna16_emu_mma(d, a, b, 1);
}

// Offset inside the block's shared memory (what cvta.to.shared gives on the device).
WNA16_DEV uint32_t wna16_smem_addr(const void* p) {
  using namespace wna16::emu;
  check_in_shared(p, 1, "wna16_smem_addr");
  return (uint32_t)(static_cast<const unsigned char*>(p) - self().team->smem);
}

// ldmatrix .m8n8 .b16: matrix i's row r is 16 bytes at the address given by lane 8i + r. Lane t
// receives, of each matrix, the 16-bit elements (t/4, 2(t%4)) and (t/4, 2(t%4)+1); with .trans
// the elements (2(t%4), t/4) and (2(t%4)+1, t/4).
inline void wna16_emu_ldmatrix(uint32_t* r, const void* row, int op, int nmat) {
  using namespace wna16::emu;
  const int lane = self().lane;
  if (lane < 8 * nmat) {
    check_aligned(row, 16, "ldmatrix");
    check_in_shared(row, 16, "ldmatrix");
  }
  Slot mine{};
  mine.op = op;
  mine.ptr = row;
  const Slot* s = rendezvous(mine);
  const bool trans = op == kOpLdm4T;
  auto at = [&](int m, int rr, int c) {
    uint16_t v;
    memcpy(&v, static_cast<const unsigned char*>(s[8 * m + rr].ptr) + 2 * c, 2);
    return v;
  };
  const int g = lane >> 2, t = lane & 3;
  for (int m = 0; m < nmat; ++m)
    r[m] = trans ? pack16(at(m, 2 * t, g), at(m, 2 * t + 1, g)) : pack16(at(m, g, 2 * t), at(m, g, 2 * t + 1));
}
WNA16_DEV void wna16_ldmatrix_x4(uint32_t r[4], const void* smem_row) {
  wna16_emu_ldmatrix(r, smem_row, wna16::emu::kOpLdm4, 4);
}
WNA16_DEV void wna16_ldmatrix_x2(uint32_t r[2], const void* smem_row) {
  wna16_emu_ldmatrix(r, smem_row, wna16::emu::kOpLdm2, 2);
}
WNA16_DEV void wna16_ldmatrix_x4_trans(uint32_t r[4], const void* smem_row) {
  wna16_emu_ldmatrix(r, smem_row, wna16::emu::kOpLdm4T, 4);
}

// cp.async: the source is read and the destination poisoned at issue (the copy is in flight and
// may land at any moment); at the wait that retires its group the source is read again -- it
// must not have changed -- and the data written.
WNA16_DEV void wna16_cp_async16(void* smem, const void* gmem, bool pred = true) {
  using namespace wna16::emu;
  check_aligned(smem, 16, "cp.async destination");
  check_in_shared(smem, 16, "cp.async destination");
  if (pred) check_aligned(gmem, 16, "cp.async source");
  ThreadState::Copy c{smem, gmem, pred, -1, {}};
  if (pred) memcpy(c.seen, gmem, 16);
  unsigned char* dst = static_cast<unsigned char*>(smem);
  poison(dst, 16, (size_t)(dst - self().team->smem));
  self().copies.push_back(c);
}
// L2 cache policies change where lines stay in the L2, never what a read returns: the emulated
// policy is an opaque token, and the hinted copy is the plain one (its checks included).
constexpr uint64_t kEmuEvictFirstPolicy = 0xE51C7F1257ull;
WNA16_DEV uint64_t wna16_l2_evict_first_policy() { return kEmuEvictFirstPolicy; }
WNA16_DEV void wna16_cp_async16_hint(void* smem, const void* gmem, bool pred, uint64_t policy) {
  if (policy != kEmuEvictFirstPolicy)
    wna16::emu::fatal("%s: the cache policy was not made by wna16_l2_evict_first_policy",
                      "cp.async with a cache hint");
  wna16_cp_async16(smem, gmem, pred);
}
WNA16_DEV void wna16_cp_async_commit() {
  using namespace wna16::emu;
  ThreadState& s = self();
  for (auto& c : s.copies)
    if (c.group < 0) c.group = s.committed;
  ++s.committed;  // an empty group is a group too
}
template <int N>
WNA16_DEV void wna16_cp_async_wait() {
  using namespace wna16::emu;
  static_assert(N >= 0, "cp.async.wait_group N >= 0");
  ThreadState& s = self();
  const int64_t done = s.committed - N;  // groups [0, done) must be complete
  if (done <= s.retired) return;
  std::vector<ThreadState::Copy> keep;
  for (const auto& c : s.copies) {
    if (c.group >= 0 && c.group < done) {
      if (c.pred) {
        unsigned char now[16];
        memcpy(now, c.src, 16);
        if (memcmp(now, c.seen, 16))
          fatal("%s: its source changed between the issue and the wait (a write raced with "
                "a copy in flight)", "cp.async");
        memcpy(c.dst, now, 16);
      } else {
        memset(c.dst, 0, 16);
      }
    } else {
      keep.push_back(c);
    }
  }
  s.copies.swap(keep);
  s.retired = done;
}

// lop3.b32: bit i of the result is bit (4a_i + 2b_i + c_i) of LUT.
template <int LUT>
WNA16_DEV uint32_t wna16_lop3(uint32_t a, uint32_t b, uint32_t c) {
  static_assert(LUT >= 0 && LUT <= 255, "lop3 LUT is 8 bits");
  uint32_t d = 0;
  for (int m = 0; m < 8; ++m)
    if ((LUT >> m) & 1) d |= ((m & 4) ? a : ~a) & ((m & 2) ? b : ~b) & ((m & 1) ? c : ~c);
  return d;
}

// prmt.b32 default mode: bytes 0-3 = a, 4-7 = b; selector nibble i picks byte (n & 7) for result
// byte i, and with bit 3 set replicates that byte's sign bit instead.
WNA16_DEV uint32_t wna16_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t bytes = (uint64_t)a | ((uint64_t)b << 32);
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (sel >> (4 * i)) & 0xf;
    uint32_t v = (uint32_t)(bytes >> (8 * (n & 7))) & 0xff;
    if (n & 8) v = (v & 0x80) ? 0xff : 0x00;
    d |= v << (8 * i);
  }
  return d;
}

WNA16_DEV uint32_t wna16_fma_f16x2(uint32_t a, uint32_t b, uint32_t c) {
  return wna16::emu::fma_x2(a, b, c, wna16::emu::kF16);
}
WNA16_DEV uint32_t wna16_sub_f16x2(uint32_t a, uint32_t b) {
  return wna16::emu::fma_x2(b, 0xBC00BC00u, a, wna16::emu::kF16);  // a - b exactly rounded once
}
WNA16_DEV uint32_t wna16_mul_f16x2(uint32_t a, uint32_t b) {
  return wna16::emu::fma_x2(a, b, 0x80008000u, wna16::emu::kF16);  // a * b + (-0)
}
WNA16_DEV uint32_t wna16_fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  return wna16::emu::fma_x2(a, b, c, wna16::emu::kBF16);
}
WNA16_DEV uint32_t wna16_sub_bf16x2(uint32_t a, uint32_t b) {
  return wna16::emu::fma_x2(b, 0xBF80BF80u, a, wna16::emu::kBF16);
}
WNA16_DEV uint32_t wna16_mul_bf16x2(uint32_t a, uint32_t b) {
  return wna16::emu::fma_x2(a, b, 0x80008000u, wna16::emu::kBF16);
}

// Warp collectives over all 32 lanes.
inline uint32_t wna16_emu_shfl(uint32_t v, int arg, int op) {
  using namespace wna16::emu;
  Slot mine{};
  mine.op = op;
  mine.r[0] = v;
  const int lane = self().lane;
  const Slot* s = rendezvous(mine);
  const int src = op == kOpShflXor ? ((lane ^ arg) & 31) : (arg & 31);
  if (src >= self().warp->bar.expected) return v;  // a missing lane: the value is unchanged
  return s[src].r[0];
}
WNA16_DEV uint32_t wna16_shfl_xor(uint32_t v, int lane_mask) {
  return wna16_emu_shfl(v, lane_mask, wna16::emu::kOpShflXor);
}
WNA16_DEV float wna16_shfl_xor_f32(float v, int lane_mask) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return wna16::emu::f32_from_bits(wna16_emu_shfl(u, lane_mask, wna16::emu::kOpShflXor));
}
WNA16_DEV uint32_t wna16_shfl(uint32_t v, int src_lane) {
  return wna16_emu_shfl(v, src_lane, wna16::emu::kOpShfl);
}
WNA16_DEV uint32_t wna16_ballot(bool pred) {
  using namespace wna16::emu;
  Slot mine{};
  mine.op = kOpBallot;
  mine.r[0] = pred;
  const Slot* s = rendezvous(mine);
  uint32_t m = 0;
  for (int l = 0; l < self().warp->bar.expected; ++l) m |= (s[l].r[0] ? 1u : 0u) << l;
  return m;
}

// The emulation has no register allocation to protect: the value itself.
WNA16_DEV uint32_t wna16_opaque(uint32_t x) { return x; }

WNA16_DEV void wna16_syncthreads() {
  using namespace wna16::emu;
  if (!self().team) fatal("%s called outside a kernel launch", "wna16_syncthreads");
  self().team->block_bar.wait("wna16_syncthreads");
}
WNA16_DEV void wna16_syncwarp() {
  wna16::emu::Slot mine{};
  mine.op = wna16::emu::kOpSync;
  wna16::emu::rendezvous(mine);
}

// Global-memory atomics, with the device's orderings: atomicAdd / atomicCAS are relaxed (they
// order nothing else), ld.acquire / st.release are what their PTX says. A seeded yield around
// each gives other blocks a window to run in between.
WNA16_DEV int wna16_atomic_add(int* p, int v) {
  wna16::emu::maybe_yield();
  const int old = __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
  wna16::emu::maybe_yield();
  return old;
}
WNA16_DEV float wna16_atomic_add_f32(float* p, float v) {
  wna16::emu::maybe_yield();
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    const float next = wna16::emu::f32_from_bits(old) + v;
    uint32_t nb;
    memcpy(&nb, &next, 4);
    if (__atomic_compare_exchange_n(u, &old, nb, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return wna16::emu::f32_from_bits(old);
  }
}
WNA16_DEV int wna16_atomic_cas(int* p, int expected, int desired) {
  wna16::emu::maybe_yield();
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  wna16::emu::maybe_yield();
  return expected;  // the old value either way
}
WNA16_DEV int wna16_load_acquire(const int* p) {
  wna16::emu::maybe_yield();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
WNA16_DEV void wna16_store_release(int* p, int v) {
  wna16::emu::maybe_yield();
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
// fence.sc.gpu: ThreadSanitizer does not model a standalone fence, so the fence is an acq_rel
// read-modify-write of one word that every fence of the process shares: a fence before a relaxed
// flag store and a fence after the relaxed load that sees the flag are then ordered as on the
// device (stronger than the device between fences that do not pair, never weaker).
WNA16_DEV void wna16_threadfence() {
  static std::atomic<uint32_t> fence_word{0};
  fence_word.fetch_add(1, std::memory_order_acq_rel);
}

// Conversions: 16-bit -> fp32 exactly; fp32 -> 16-bit rounded to nearest even.
WNA16_DEV float2 wna16_f16x2_to_float2(uint32_t v) {
  using namespace wna16::emu;
  return make_float2((float)decode16(lo16(v), kF16), (float)decode16(hi16(v), kF16));
}
WNA16_DEV uint32_t wna16_float2_to_f16x2(float lo, float hi) {
  using namespace wna16::emu;
  return pack16(encode16(lo, kF16), encode16(hi, kF16));
}
WNA16_DEV float2 wna16_bf16x2_to_float2(uint32_t v) {
  using namespace wna16::emu;
  return make_float2(f32_from_bits(v << 16), f32_from_bits(v & 0xffff0000u));
}
WNA16_DEV uint32_t wna16_float2_to_bf16x2(float lo, float hi) {
  using namespace wna16::emu;
  return pack16(encode16(lo, kBF16), encode16(hi, kBF16));
}

// Dynamic shared memory: the team's buffer (smem_bytes of the launch, 16-byte aligned).
#define WNA16_SHARED_MEMORY(type, name) \
  type* const name = reinterpret_cast<type*>(wna16::emu::self().team->smem)

// The launch runs on the CPU emulation, to completion, before returning.
#define WNA16_LAUNCH(grid, block, smem_bytes, stream, kernel, ...)                       \
  do {                                                                                    \
    auto* wna16_kernel_ = kernel;                                                         \
    wna16::emu::launch(dim3(grid), dim3(block), (size_t)(smem_bytes), (stream), wna16_kernel_, \
                       __VA_ARGS__);                                                      \
  } while (0)
