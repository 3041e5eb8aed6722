// Metal-on-CPU executor: runs a dispatch's threadgroups on a few OS threads; inside a threadgroup,
// every Metal thread is a ucontext fiber. Fibers are cooperative: one runs until it reaches a
// threadgroup_barrier / simdgroup_barrier / simd collective (or returns), then the next runnable
// one runs. When no fiber can run, the scheduler releases a barrier whose participants have all
// arrived, or reports the divergence / deadlock. Real blocking semantics at ~0.2 us per switch.
//
// Adversarial knobs (see Schedule): the order in which runnable fibers run between releases
// (forward, reversed, random), and threadgroup memory filled with NaN bytes (0xFF) before every
// threadgroup starts, so a read before the write it depends on gives garbage instead of a stale
// value that happens to be right.
//
// macOS declares the ucontext routines only when _XOPEN_SOURCE is defined before the first system
// header (<ucontext.h> is an #error otherwise), and only then does ucontext_t hold the machine
// context itself; _DARWIN_C_SOURCE keeps the rest of the system API visible. The routines are
// deprecated there, not removed.
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE 1
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
#endif
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime.h"

#include "metal_stdlib"
// The shim's address-space macros must not leak into the executor's own code.
#undef device
#undef threadgroup
#undef thread
#undef constant
#undef kernel

namespace metal_emu {

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxThreadgroupBytes = 32768;  // Apple GPUs: 32 KiB of threadgroup memory
constexpr size_t kArenaBytes = 64 * 1024;

struct KernelEntry {
  const void* fn = nullptr;
  KernelTrampoline tramp = nullptr;
  int num_buffers = 0;
};

std::map<std::string, KernelEntry>& registry() {
  static std::map<std::string, KernelEntry> r;
  return r;
}

enum class FState { Runnable, WaitTG, WaitSG, Done };

struct Fiber {
  ucontext_t ctx;
  FState state = FState::Runnable;
  unsigned parity = 0;
  unsigned matrix_parity = 0;
};

struct Worker {
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  ucontext_t sched;
  unsigned current = 0;
  unsigned nthreads = 0;
  const KernelEntry* kernel = nullptr;
  void* const* buffers = nullptr;
  uint3 tgid{0, 0, 0};
  std::vector<unsigned char> arena = std::vector<unsigned char>(kArenaBytes, 0xFF);  // poisoned
  size_t arena_used = 0;
  std::vector<std::pair<unsigned, size_t>> slots;
  std::vector<uint64_t> exchange;
  std::vector<float> matrix_exchange;
  std::string error;  // set by a kernel-side failure; the failing fiber is abandoned
  uint64_t barrier_rounds = 0, simd_rounds = 0;
  size_t max_tg_bytes = 0;
};

thread_local Worker* tl_worker = nullptr;

DispatchStats g_last_stats;
std::mutex g_stats_mu;

void fiber_entry() {
  Worker* w = tl_worker;
  const unsigned i = w->current;
  KernelThreadIds ids;
  ids.tgid = w->tgid;
  ids.lid = i;
  ids.sgid = i / 32u;
  ids.lane = i % 32u;
  w->kernel->tramp(w->kernel->fn, w->buffers, ids);
  w->fibers[i].state = FState::Done;
  // returning resumes uc_link (the scheduler)
}

Worker& current_worker() {
  if (tl_worker == nullptr) throw std::logic_error("metal_emu: MSL runtime call outside a dispatch");
  return *tl_worker;
}

void yield_as(FState s) {
  Worker& w = current_worker();
  Fiber& f = w.fibers[w.current];
  f.state = s;
  swapcontext(&f.ctx, &w.sched);
}

std::string where(const Worker& w) {
  return " (threadgroup " + std::to_string(w.tgid.x) + "," + std::to_string(w.tgid.y) + "," +
         std::to_string(w.tgid.z) + ")";
}

void run_threadgroup(Worker& w, Schedule schedule, uint64_t seed) {
  const unsigned n = w.nthreads;
  // Poison threadgroup memory and the simd exchange area.
  std::fill(w.arena.begin(), w.arena.begin() + std::max<size_t>(w.arena_used, 1), 0xFF);
  w.arena_used = 0;
  w.slots.clear();
  const unsigned nsg = (n + 31u) / 32u;
  w.exchange.assign(size_t(nsg) * 2 * 32, ~uint64_t(0));
  w.matrix_exchange.assign(size_t(nsg) * 2 * 192, std::numeric_limits<float>::quiet_NaN());
  while (w.stacks.size() < n) w.stacks.emplace_back(new char[kStackBytes]);
  w.fibers.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = w.fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = w.stacks[i].get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &w.sched;
    makecontext(&f.ctx, fiber_entry, 0);
    f.state = FState::Runnable;
    f.parity = 0;
    f.matrix_parity = 0;
  }
  std::mt19937_64 rng(seed ^ (uint64_t(w.tgid.x) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(w.tgid.y) << 40) ^
                      (uint64_t(w.tgid.z) << 52));
  std::vector<unsigned> order;
  order.reserve(n);
  const bool eager = schedule == Schedule::SimdAhead || schedule == Schedule::SimdAheadReverse;
  auto run_fiber = [&w](unsigned i) {
    w.current = i;
    swapcontext(&w.sched, &w.fibers[i].ctx);
  };
  for (;;) {
    if (eager) {
      // One simdgroup at a time, releasing its simdgroup barriers on the spot.
      for (unsigned s = 0; s < nsg; ++s) {
        const unsigned sg = schedule == Schedule::SimdAheadReverse ? nsg - 1 - s : s;
        const unsigned lo = sg * 32u, hi = std::min(n, lo + 32u);
        for (;;) {
          for (unsigned i = lo; i < hi; ++i)
            if (w.fibers[i].state == FState::Runnable && w.error.empty()) run_fiber(i);
          bool all_sg = true;
          for (unsigned i = lo; i < hi; ++i) all_sg = all_sg && w.fibers[i].state == FState::WaitSG;
          if (!all_sg) break;
          for (unsigned i = lo; i < hi; ++i) w.fibers[i].state = FState::Runnable;
          ++w.simd_rounds;
        }
      }
    } else {
      order.clear();
      for (unsigned i = 0; i < n; ++i)
        if (w.fibers[i].state == FState::Runnable) order.push_back(i);
      if (schedule == Schedule::Reverse) std::reverse(order.begin(), order.end());
      if (schedule == Schedule::Random) std::shuffle(order.begin(), order.end(), rng);
      for (unsigned i : order)
        if (w.error.empty()) run_fiber(i);
    }
    if (!w.error.empty()) throw std::runtime_error(w.error);
    // Nobody can run: release what may be released, or report why nothing can be.
    unsigned done = 0, at_tg = 0;
    bool released = false;
    for (unsigned sg = 0; sg < nsg; ++sg) {
      const unsigned lo = sg * 32u, hi = std::min(n, lo + 32u);
      unsigned s_done = 0, s_tg = 0, s_sg = 0;
      for (unsigned i = lo; i < hi; ++i) {
        const FState st = w.fibers[i].state;
        s_done += st == FState::Done;
        s_tg += st == FState::WaitTG;
        s_sg += st == FState::WaitSG;
      }
      done += s_done;
      at_tg += s_tg;
      if (s_sg == 0) continue;
      if (s_sg != hi - lo) {
        throw std::runtime_error("metal_emu: simdgroup " + std::to_string(sg) +
                                 ": simdgroup_barrier / simd collective not reached by all lanes (" +
                                 std::to_string(s_sg) + " waiting, " + std::to_string(s_tg) +
                                 " at threadgroup_barrier, " + std::to_string(s_done) + " returned)" + where(w));
      }
      for (unsigned i = lo; i < hi; ++i) w.fibers[i].state = FState::Runnable;
      ++w.simd_rounds;
      released = true;
    }
    if (done == n) break;
    if (released) continue;
    if (at_tg == n) {
      for (unsigned i = 0; i < n; ++i) w.fibers[i].state = FState::Runnable;
      ++w.barrier_rounds;
      continue;
    }
    throw std::runtime_error("metal_emu: threadgroup_barrier not reached by all threads (" + std::to_string(at_tg) +
                             " waiting, " + std::to_string(done) + " returned)" + where(w));
  }
  w.max_tg_bytes = std::max(w.max_tg_bytes, w.arena_used);
}

}  // namespace

// ---- hooks called from kernel code (through the shim) ------------------------------------------
void threadgroup_barrier_wait() { yield_as(FState::WaitTG); }
void simdgroup_barrier_wait() { yield_as(FState::WaitSG); }

void* threadgroup_slot(unsigned id, size_t bytes, size_t align) {
  Worker& w = current_worker();
  for (const auto& s : w.slots)
    if (s.first == id) return w.arena.data() + s.second;
  size_t off = (w.arena_used + std::max<size_t>(align, 16) - 1) / std::max<size_t>(align, 16) *
               std::max<size_t>(align, 16);
  if (off + bytes > kMaxThreadgroupBytes) {
    // Cannot throw through the fiber's stack: park the fiber for good and let the scheduler throw.
    w.error = "metal_emu: threadgroup memory over " + std::to_string(kMaxThreadgroupBytes) + " bytes (" +
              std::to_string(off + bytes) + " requested)" + where(w);
    Fiber& f = w.fibers[w.current];
    f.state = FState::Done;
    swapcontext(&f.ctx, &w.sched);
    std::abort();  // never resumed
  }
  w.slots.emplace_back(id, off);
  w.arena_used = off + bytes;
  return w.arena.data() + off;
}

namespace {
// This fiber's slot group in a per-simdgroup exchange area of `per_sg` elements, double buffered
// by a per-fiber parity so consecutive collectives never share a buffer.
template <class T>
T* sg_exchange(std::vector<T>& area, unsigned Fiber::*parity, size_t per_sg, unsigned& lane) {
  Worker& w = current_worker();
  Fiber& f = w.fibers[w.current];
  lane = w.current % 32u;
  const unsigned sg = w.current / 32u;
  const unsigned half = (f.*parity)++ & 1u;
  return area.data() + (size_t(sg) * 2 + half) * per_sg;
}
}  // namespace

uint64_t* simd_exchange(unsigned& lane) {
  return sg_exchange(current_worker().exchange, &Fiber::parity, 32, lane);
}

namespace {
std::string g_dropped_barrier;
}

bool barrier_dropped(const char* name) { return !g_dropped_barrier.empty() && g_dropped_barrier == name; }
void set_dropped_barrier(const std::string& name) { g_dropped_barrier = name; }

namespace {
ThreadgroupHooks g_hooks;
}

void set_threadgroup_hooks(const ThreadgroupHooks& hooks) { g_hooks = hooks; }

int current_thread_index() { return tl_worker == nullptr ? -1 : int(tl_worker->current); }

unsigned current_lane() {
  Worker& w = current_worker();
  return w.current % 32u;
}

float* simd_matrix_exchange(unsigned& lane) {
  return sg_exchange(current_worker().matrix_exchange, &Fiber::matrix_parity, 192, lane);
}

void register_kernel(const char* name, const void* fn, KernelTrampoline tramp, int num_buffers) {
  KernelEntry e;
  e.fn = fn;
  e.tramp = tramp;
  e.num_buffers = num_buffers;
  registry()[name] = e;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> out;
  for (const auto& kv : registry()) out.push_back(kv.first);
  return out;
}

DispatchStats last_dispatch_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_last_stats;
}

void dispatch(const DispatchDesc& d) {
  const auto it = registry().find(d.kernel);
  if (it == registry().end()) throw std::runtime_error("metal_emu: no kernel named '" + d.kernel + "'");
  const KernelEntry& k = it->second;
  if (int(d.buffers.size()) != k.num_buffers) {
    throw std::runtime_error("metal_emu: kernel '" + d.kernel + "' takes " + std::to_string(k.num_buffers) +
                             " buffers, got " + std::to_string(d.buffers.size()));
  }
  if (d.threads == 0 || d.threads > 1024) throw std::runtime_error("metal_emu: threads per threadgroup must be 1..1024");
  const uint64_t total = uint64_t(d.grid[0]) * d.grid[1] * d.grid[2];
  int workers = d.workers > 0 ? d.workers : int(std::max(1u, std::thread::hardware_concurrency()));
  if (g_hooks.run != nullptr) workers = 1;  // the load tracer aggregates on one thread
  workers = int(std::min<uint64_t>(uint64_t(workers), std::max<uint64_t>(total, 1)));
  std::atomic<uint64_t> next{0};
  std::vector<std::exception_ptr> errors(workers);
  DispatchStats stats;
  std::mutex mu;
  auto body = [&](int wi) {
    Worker w;
    w.kernel = &k;
    w.buffers = d.buffers.data();
    w.nthreads = d.threads;
    tl_worker = &w;
    try {
      for (;;) {
        const uint64_t g = next.fetch_add(1);
        if (g >= total) break;
        w.tgid = uint3(uint(g % d.grid[0]), uint((g / d.grid[0]) % d.grid[1]), uint(g / (uint64_t(d.grid[0]) * d.grid[1])));
        if (g_hooks.run != nullptr) {
          const uint32_t id[3] = {w.tgid.x, w.tgid.y, w.tgid.z};
          if (!g_hooks.run(g, id)) continue;
        }
        run_threadgroup(w, d.schedule, d.seed);
        if (g_hooks.done != nullptr) g_hooks.done(w.nthreads);
      }
    } catch (...) {
      errors[wi] = std::current_exception();
      next.store(total);
    }
    tl_worker = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    stats.barrier_rounds += w.barrier_rounds;
    stats.simd_rounds += w.simd_rounds;
    stats.max_threadgroup_bytes = std::max<uint64_t>(stats.max_threadgroup_bytes, w.max_tg_bytes);
  };
  if (workers <= 1) {
    body(0);
  } else {
    std::vector<std::thread> pool;
    for (int i = 0; i < workers; ++i) pool.emplace_back(body, i);
    for (auto& t : pool) t.join();
  }
  stats.threadgroups = total;
  {
    std::lock_guard<std::mutex> lock(g_stats_mu);
    g_last_stats = stats;
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace metal_emu
