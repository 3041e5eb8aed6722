// Device-memory load tracer (load_trace.h). Linked only into the traced harness modules; the
// kernel objects there are instrumented by clang's -fsanitize-coverage=trace-loads, which calls the
// __sanitizer_cov_load<N> functions below before every load.
#include "load_trace.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <unordered_map>

#include "runtime.h"

namespace metal_emu {
namespace load_trace {

namespace {

struct Noted {
  uintptr_t lo, hi;
  std::string name;
};

struct Range {
  uintptr_t lo, hi;
  uint32_t buf;
};

struct Record {
  uint32_t site;   // index into g_sites
  uint8_t width;
  uint8_t buf;
  uintptr_t addr;
};

struct BufferState {
  BufferStats stats;
  uintptr_t lo = 0;
  std::vector<uint8_t> fetches;  // per byte, saturating
};

std::vector<Noted> g_noted;
bool g_active = false;
uint64_t g_max_threadgroups = 0;
bool g_in_dispatch = false;

// The running dispatch.
DispatchTrace g_trace;
std::vector<Range> g_ranges;
std::vector<BufferState> g_buffers;
std::vector<std::vector<Record>> g_log;  // per thread of the running threadgroup
std::unordered_map<uint64_t, uint32_t> g_site_index;
std::vector<SiteStats> g_sites;
uint64_t g_stride = 1;
std::vector<DispatchTrace> g_done;

// Direct-mapped cache in front of g_site_index (a kernel has a few dozen load sites).
struct SiteCacheEntry {
  uint64_t site = 0;
  uint32_t index = 0;
};
SiteCacheEntry g_site_cache[256];

uint32_t site_index(uint64_t site, uint32_t buf) {
  SiteCacheEntry& c = g_site_cache[(site >> 2) & 255u];
  if (c.site == site) return c.index;
  auto it = g_site_index.find(site);
  uint32_t idx;
  if (it == g_site_index.end()) {
    idx = uint32_t(g_sites.size());
    g_site_index.emplace(site, idx);
    SiteStats s;
    s.site = site;
    s.buffer = g_buffers[buf].stats.name;
    g_sites.push_back(s);
  } else {
    idx = it->second;
  }
  c.site = site;
  c.index = idx;
  return idx;
}

inline void on_load(const void* p, uint8_t width, const void* ret) {
  if (!g_in_dispatch) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (const Range& r : g_ranges) {
    if (a >= r.lo && a < r.hi) {
      const int lid = current_thread_index();
      if (lid < 0 || size_t(lid) >= g_log.size()) return;
      g_log[size_t(lid)].push_back(Record{site_index(reinterpret_cast<uint64_t>(ret), r.buf), width,
                                          uint8_t(r.buf), a});
      return;
    }
  }
}

bool run_threadgroup_hook(uint64_t linear, const uint32_t*) {
  if (linear % g_stride != 0) return false;
  ++g_trace.traced;
  return true;
}

struct Entry {
  uintptr_t addr;
  uint32_t width;
  uint32_t buf;
};

// One simdgroup-wide load: the lanes' (address, width) of the n-th execution of one site.
void fold_simd_load(SiteStats& s, std::vector<Entry>& lanes) {
  std::sort(lanes.begin(), lanes.end(), [](const Entry& x, const Entry& y) { return x.addr < y.addr; });
  uint64_t used = 0, segments = 0;
  uintptr_t cur_lo = 0, cur_hi = 0;
  bool open = false;
  uint64_t last_segment = ~uint64_t(0);
  auto close = [&]() {
    used += cur_hi - cur_lo;
    uint64_t first = cur_lo >> 6, last = (cur_hi - 1) >> 6;
    if (first == last_segment) ++first;
    if (last >= first) segments += last - first + 1;
    last_segment = last;
  };
  for (const Entry& e : lanes) {
    const uintptr_t lo = e.addr, hi = e.addr + e.width;
    if (open && lo <= cur_hi) {
      cur_hi = std::max(cur_hi, hi);
    } else {
      if (open) close();
      cur_lo = lo;
      cur_hi = hi;
      open = true;
    }
  }
  if (open) close();
  s.simd_loads += 1;
  s.active_lanes += lanes.size();
  s.used_bytes += used;
  s.segments += segments;
}

void threadgroup_done_hook(unsigned threads) {
  const unsigned nsg = (threads + 31u) / 32u;
  // Per-site lists of simdgroup-wide loads: groups[site][n] = the lanes' entries.
  std::vector<std::vector<std::vector<Entry>>> groups(g_sites.size());
  std::vector<uint32_t> count(g_sites.size());
  for (unsigned sg = 0; sg < nsg; ++sg) {
    const unsigned lo = sg * 32u, hi = std::min(threads, lo + 32u);
    if (groups.size() < g_sites.size()) {
      groups.resize(g_sites.size());
      count.resize(g_sites.size());
    }
    for (unsigned lane = lo; lane < hi && lane < g_log.size(); ++lane) {
      std::fill(count.begin(), count.end(), 0u);
      for (const Record& r : g_log[lane]) {
        SiteStats& s = g_sites[r.site];
        s.lane_loads += 1;
        s.bytes_fetched += r.width;
        s.width_mask |= 1u << std::min<uint32_t>(r.width, 31u);
        BufferState& b = g_buffers[r.buf];
        b.stats.lane_loads += 1;
        b.stats.bytes_fetched += r.width;
        if (b.fetches.empty()) b.fetches.assign(b.stats.bytes, 0);
        const uintptr_t off = r.addr - b.lo;
        for (uintptr_t i = off; i < off + r.width && i < b.fetches.size(); ++i)
          if (b.fetches[i] != 255) ++b.fetches[i];
        auto& per_n = groups[r.site];
        const uint32_t n = count[r.site]++;
        if (per_n.size() <= n) per_n.resize(n + 1);
        per_n[n].push_back(Entry{r.addr, r.width, r.buf});
      }
    }
    for (size_t site = 0; site < groups.size(); ++site) {
      for (auto& lanes : groups[site]) {
        if (!lanes.empty()) fold_simd_load(g_sites[site], lanes);
        lanes.clear();
      }
    }
  }
  for (auto& l : g_log) l.clear();
}

}  // namespace

void note_buffer(const void* data, size_t bytes, const std::string& name) {
  if (data == nullptr || bytes == 0) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data);
  for (Noted& n : g_noted) {
    if (n.lo == lo) {
      n.hi = lo + bytes;
      n.name = name;
      return;
    }
  }
  g_noted.push_back(Noted{lo, lo + bytes, name});
}

void start(uint64_t max_threadgroups) {
  g_active = true;
  g_max_threadgroups = max_threadgroups;
  g_done.clear();
}

bool active() { return g_active; }

void dispatch_begin(const std::string& kernel, const uint32_t grid[3], uint32_t threads,
                    const std::vector<void*>& slots, size_t params_bytes) {
  g_trace = DispatchTrace();
  g_trace.kernel = kernel;
  for (int i = 0; i < 3; ++i) g_trace.grid[i] = grid[i];
  g_trace.threads = threads;
  g_trace.threadgroups = uint64_t(grid[0]) * grid[1] * grid[2];
  g_stride = 1;
  if (g_max_threadgroups > 0 && g_trace.threadgroups > g_max_threadgroups)
    g_stride = (g_trace.threadgroups + g_max_threadgroups - 1) / g_max_threadgroups;
  g_ranges.clear();
  g_buffers.clear();
  g_sites.clear();
  g_site_index.clear();
  for (auto& c : g_site_cache) c = SiteCacheEntry();
  auto add = [&](uintptr_t lo, uintptr_t hi, const std::string& name, int slot) {
    for (const Range& r : g_ranges)
      if (r.lo == lo) return;
    BufferState b;
    b.stats.name = name;
    b.stats.slot = slot;
    b.stats.bytes = hi - lo;
    b.lo = lo;
    g_ranges.push_back(Range{lo, hi, uint32_t(g_buffers.size())});
    g_buffers.push_back(std::move(b));
  };
  for (size_t i = 0; i < slots.size(); ++i) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(slots[i]);
    if (i + 1 == slots.size()) {
      add(p, p + params_bytes, "params", int(i));
      continue;
    }
    for (const Noted& n : g_noted) {
      if (p >= n.lo && p < n.hi) {
        add(n.lo, n.hi, n.name, int(i));
        break;
      }
    }
  }
  if (g_buffers.size() > 255) throw std::runtime_error("load_trace: more than 255 buffers in one dispatch");
  g_log.assign(std::max<uint32_t>(threads, 1u), {});
  ThreadgroupHooks hooks;
  hooks.run = &run_threadgroup_hook;
  hooks.done = &threadgroup_done_hook;
  set_threadgroup_hooks(hooks);
  g_in_dispatch = true;
}

void dispatch_end() {
  g_in_dispatch = false;
  set_threadgroup_hooks(ThreadgroupHooks());
  for (BufferState& b : g_buffers) {
    for (uint8_t f : b.fetches) {
      b.stats.unique_bytes += f != 0;
      b.stats.refetched_bytes += f > 1;
      b.stats.max_fetches = std::max<uint32_t>(b.stats.max_fetches, f);
    }
    g_trace.buffers.push_back(b.stats);
    b.fetches.clear();
    b.fetches.shrink_to_fit();
  }
  g_trace.sites = g_sites;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&threadgroup_done_hook), &info) != 0 && info.dli_fname != nullptr) {
    g_trace.module_path = info.dli_fname;
    g_trace.module_base = reinterpret_cast<uint64_t>(info.dli_fbase);
  }
  g_done.push_back(std::move(g_trace));
  g_trace = DispatchTrace();
  g_log.clear();
  g_log.shrink_to_fit();
}

std::vector<DispatchTrace> stop() {
  if (g_in_dispatch) dispatch_end();
  g_active = false;
  g_noted.clear();
  std::vector<DispatchTrace> out;
  out.swap(g_done);
  return out;
}

}  // namespace load_trace
}  // namespace metal_emu

// ---- binary16 conversions clang emits calls to for __fp16 on x86-64 (the kernels' `half` in the
// traced build); compiler-rt has them, libgcc does not. Round to nearest even, as MSL does. ----
extern "C" {
float __gnu_h2f_ieee(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t __gnu_f2h_ieee(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));  // inf / NaN
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past the largest half: inf
  if (ax < 0x38800000u) {  // subnormal half (or zero)
    if (ax < 0x33000000u) return sign;
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14 + (113 - e) - ... : m >> (shift) gives the half mantissa
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}
}

// ---- clang's SanitizerCoverage callbacks (trace-loads; inline-8bit-counters is the coverage kind
// trace-loads rides on, its counters are not used) ------------------------------------------------
extern "C" {
void __sanitizer_cov_8bit_counters_init(char*, char*) {}
void __sanitizer_cov_load1(uint8_t* p) { metal_emu::load_trace::on_load(p, 1, __builtin_return_address(0)); }
void __sanitizer_cov_load2(uint16_t* p) { metal_emu::load_trace::on_load(p, 2, __builtin_return_address(0)); }
void __sanitizer_cov_load4(uint32_t* p) { metal_emu::load_trace::on_load(p, 4, __builtin_return_address(0)); }
void __sanitizer_cov_load8(uint64_t* p) { metal_emu::load_trace::on_load(p, 8, __builtin_return_address(0)); }
void __sanitizer_cov_load16(void* p) { metal_emu::load_trace::on_load(p, 16, __builtin_return_address(0)); }
}
