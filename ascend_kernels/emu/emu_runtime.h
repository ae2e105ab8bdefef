// Runtime of the Ascend C CPU emulation: one AI Vector core's unified buffer (UB), the hazard
// tracker that checks pipe synchronization, global-memory (GM) bookkeeping and the launcher.
//
// Written for dflash from the public Ascend C API documentation; no CANN code is used. Every
// violation of a hardware rule throws dflash::emu::Fault("ascend-emu [<rule>] ...") so tests can name the
// rule that a kernel broke. Kernel code never includes this file directly: it includes
// "kernel_operator.h", exactly as it does when built with CANN.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace dflash::emu {

constexpr uint32_t kUbBytes = 192 * 1024;      // unified buffer of one 910B (A2) vector core
constexpr uint32_t kAlign = 32;                // DMA granularity and vector operand alignment
constexpr uint32_t kRepeatBytes = 256;         // bytes one vector instruction repeat processes
constexpr uint32_t kPoisonWord = 0x7FC17FC1u;  // NaN as float32 and as either 16-bit half
// Select in tensor-scalar mode stores its scalar in the UB's reserved tail (the last 8 KiB on A2):
// a kernel that uses it may plan buffers only below this offset.
constexpr uint32_t kSelectReservedOffset = 184 * 1024;
constexpr int kEventIds = 8;  // flag IDs per (source, destination) pipe pair

struct Fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Parts>
[[noreturn]] void fail(const char* rule, const Parts&... parts) {
  std::ostringstream s;
  s << "ascend-emu [" << rule << "] ";
  (s << ... << parts);
  throw Fault(s.str());
}

inline uint32_t round_up(uint32_t n, uint32_t to) {
  return (n + to - 1) / to * to;
}

// Hardware pipes that touch the UB. The scalar unit (S) issues every instruction in program order;
// vector (V) and the two DMA engines (MTE2: GM -> UB, MTE3: UB -> GM) run asynchronously.
enum Pipe : int { kS = 0, kV, kMte2, kMte3, kNumPipes };

inline const char* pipe_name(int p) {
  static const char* names[] = {"S", "V", "MTE2", "MTE3"};
  return names[p];
}

// "MTE2_V" and so on: the HardEvent of a (source, destination) pair.
inline const char* event_name(int src, int dst) {
  static const std::string names[kNumPipes][kNumPipes] = {
      {"S_S", "S_V", "S_MTE2", "S_MTE3"},
      {"V_S", "V_V", "V_MTE2", "V_MTE3"},
      {"MTE2_S", "MTE2_V", "MTE2_MTE2", "MTE2_MTE3"},
      {"MTE3_S", "MTE3_V", "MTE3_MTE2", "MTE3_MTE3"}};
  return names[src][dst].c_str();
}

// What one pipe has observed of every pipe: seen[q] = index of the last instruction of q that is
// known to have completed. A flag (SetFlag/WaitFlag or a queue hand-over) passes a snapshot.
struct Clock {
  uint32_t seen[kNumPipes] = {};
};

// Tracks, per 32-byte UB block, the last writer and the last reader of every pipe, and faults on
// any read-after-write, write-after-write or write-after-read between pipes that no flag orders.
// Inside the vector pipe a dependent instruction needs PipeBarrier<PIPE_V>. Scalar loads complete
// before the next instruction issues, so nothing has to wait for them.
class Hazards {
 public:
  Hazards() : cells_(kUbBytes / kAlign) {}

  uint32_t issue(int pipe) { return ++now_[pipe]; }

  void read(int pipe, uint32_t offset, uint32_t bytes, const char* what) {
    for (uint32_t c = offset / kAlign; c < (offset + bytes + kAlign - 1) / kAlign; ++c) {
      Cell& cell = cells_[c];
      if (!seen(pipe, cell.writer, cell.write_time))
        unordered(cell.writer, pipe, what, "reads UB last written by");
      cell.read_time[pipe] = now_[pipe];
    }
  }

  void write(int pipe, uint32_t offset, uint32_t bytes, const char* what) {
    for (uint32_t c = offset / kAlign; c < (offset + bytes + kAlign - 1) / kAlign; ++c) {
      Cell& cell = cells_[c];
      // A pipe's own writes land in issue order; only a vector read needs the barrier.
      if (cell.writer != pipe && !seen(pipe, cell.writer, cell.write_time))
        unordered(cell.writer, pipe, what, "overwrites UB last written by");
      for (int q = kV; q < kNumPipes; ++q) {
        if (q != pipe && !seen(pipe, q, cell.read_time[q]))
          unordered(q, pipe, what, "overwrites UB still being read by");
      }
      cell = Cell{};
      cell.writer = pipe;
      cell.write_time = now_[pipe];
    }
  }

  // The snapshot a flag set by `pipe` carries: everything `pipe` has issued so far is complete.
  Clock snapshot(int pipe) const {
    Clock c = clocks_[pipe];
    c.seen[pipe] = now_[pipe];
    return c;
  }

  void merge(int pipe, const Clock& c) {
    for (int q = 0; q < kNumPipes; ++q)
      clocks_[pipe].seen[q] = std::max(clocks_[pipe].seen[q], c.seen[q]);
  }

  void barrier_all() {
    for (auto& c : clocks_)
      for (int q = 0; q < kNumPipes; ++q) c.seen[q] = now_[q];
  }

  void barrier_vector() { clocks_[kV].seen[kV] = now_[kV]; }

 private:
  struct Cell {
    int writer = kS;
    uint32_t write_time = 0;  // 0: never written by the kernel
    uint32_t read_time[kNumPipes] = {};
  };

  bool seen(int pipe, int other, uint32_t time) const {
    if (time == 0) return true;
    if (pipe == other && pipe != kV) return true;  // S, MTE2 and MTE3 are in order
    return clocks_[pipe].seen[other] >= time;
  }

  [[noreturn]] void unordered(int earlier, int later, const char* what,
                              const char* relation) const {
    std::string fix = earlier == kV && later == kV
                          ? "PipeBarrier<PIPE_V>()"
                          : std::string("SetFlag/WaitFlag<HardEvent::") + pipe_name(earlier) + "_" +
                                pipe_name(later) + "> (or a queue hand-over)";
    fail("sync", what, " (pipe ", pipe_name(later), ") ", relation, " pipe ", pipe_name(earlier),
         " and nothing orders them; missing ", fix);
  }

  std::vector<Cell> cells_;
  uint32_t now_[kNumPipes] = {};
  Clock clocks_[kNumPipes];
};

struct GmArg {
  const void* ptr;
  size_t bytes;
  bool writable;
  std::string name;
};

struct GmWrite {
  uintptr_t begin, end;
  uint32_t block;
};

// Everything one launch shares between its blocks.
struct Launch {
  std::vector<GmArg> regions;
  std::vector<GmWrite> writes;
  std::vector<uint32_t> order;
  bool mix = false;  // launched as a MIX kernel: twice the vector blocks, GetBlockNum unchanged
};

// What KERNEL_TASK_TYPE_DEFAULT declares. A file with several kernels must declare it: CANN cannot
// infer it there, and a MIX guess (two vector cores per cube core) makes GetBlockIdx() span twice
// GetBlockNum(), so a kernel that splits its work by them runs items twice or skips them.
enum class KernelType { kUndeclared, kAivOnly, kMix };

// Thrown by a block's first declaration of a MIX type: the launch restarts with MIX indexing.
struct MixLaunch {};

// One block (one AI Vector core running the kernel once): fresh UB, hazards and flags.
class Block {
 public:
  Block(Launch& launch, uint32_t idx, uint32_t num) : launch_(launch), idx_(idx), num_(num) {
    ub_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, kUbBytes)));
    poison(0, kUbBytes);
  }

  uint32_t idx() const { return idx_; }
  uint32_t num() const { return num_; }

  void declare(KernelType type) {
    if (type == KernelType::kMix && !launch_.mix) throw MixLaunch{};
    type_ = type;
  }
  uint8_t* ub(uint32_t offset) const { return ub_.get() + offset; }
  Hazards& hazards() { return hazards_; }

  // Fresh or re-allocated UB holds whatever was there before; NaN patterns make a kernel that reads
  // it produce NaN instead of plausible numbers.
  void poison(uint32_t offset, uint32_t bytes) {
    for (uint32_t i = 0; i < bytes; i += 4) std::memcpy(ub_.get() + offset + i, &kPoisonWord, 4);
  }

  uint32_t allocate(uint32_t bytes, const char* what) {
    uint32_t offset = used_;
    used_ += round_up(bytes, kAlign);
    if (used_ > kUbBytes)
      fail("ub-budget", what, " needs ", round_up(bytes, kAlign), " bytes at offset ", offset,
           ": the unified buffer has ", kUbBytes, " bytes (192 KiB) per core");
    return offset;
  }

  void release_all() { used_ = 0; }

  // GM accesses must stay inside one tensor the launcher passed; writes only to writable ones.
  void check_gm(const void* p, size_t bytes, bool write, const char* what) const {
    auto begin = reinterpret_cast<uintptr_t>(p);
    for (const GmArg& r : launch_.regions) {
      auto rb = reinterpret_cast<uintptr_t>(r.ptr);
      if (begin >= rb && begin + bytes <= rb + r.bytes) {
        if (write && !r.writable) fail("gm-bounds", what, " writes to read-only input ", r.name);
        return;
      }
    }
    fail("gm-bounds", what, " touches ", bytes, " bytes of GM at ", p,
         " outside every tensor passed to the kernel");
  }

  void record_gm_write(const void* p, size_t bytes) {
    auto begin = reinterpret_cast<uintptr_t>(p);
    if (bytes) launch_.writes.push_back({begin, begin + bytes, idx_});
  }

  // The highest UB byte any buffer of this block occupies.
  uint32_t used() const { return used_; }

  // Flags, keyed by (source pipe, destination pipe, event id). The pipe hands out IDs from one
  // pool per pipe pair, shared by the queues (EnQue / FreeTensor allocate theirs there) and by
  // kernel code (AllocEventID / FetchEventID): a hard-coded ID can be one a queue holds.
  void set_flag(int src, int dst, int id, const char* name) {
    set_flag(src, dst, id, name, hazards_.snapshot(src));
  }

  // A scalar access to the UB while a flag between the scalar pipe and a DMA pipe is held open
  // (set, not yet waited): under --cce-auto-sync bisheng orders scalar UB accesses against the
  // DMA pipes itself, with SetFlag/WaitFlag on IDs it chooses (EVENT_ID0 first), which can land on
  // the held ID: two SetFlag on one ID without a wait. Such a flag must be waited at once.
  void scalar_access(const char* what) const {
    for (const auto& [key, e] : events_) {
      const auto [src, dst, id] = key;
      const bool dma = src == kMte2 || src == kMte3 || dst == kMte2 || dst == kMte3;
      if (e.first && dma && (src == kS || dst == kS))
        fail("auto-sync", what, " while SetFlag<", event_name(src, dst), ">(", id,
             ") is held open: with --cce-auto-sync the compiler syncs scalar UB accesses with "
             "the DMA pipes on IDs of its own; wait such a flag at once (SetFlag then WaitFlag)");
    }
  }

  void set_flag(int src, int dst, int id, const char* name, const Clock& clock) {
    check_id(id, name);
    auto& e = events_[std::make_tuple(src, dst, id)];
    if (e.first)
      fail("event", "SetFlag<", name, ">(", id, ") while the previous one was never waited",
           holder(src, dst, id), ": a second SetFlag on a set flag is undefined and can hang");
    e = {true, clock};
  }

  void wait_flag(int src, int dst, int id, const char* name, const char* who = nullptr) {
    check_id(id, name);
    auto& e = events_[std::make_tuple(src, dst, id)];
    if (!e.first)
      fail("event", who ? who : "", who ? ": " : "", "WaitFlag<", name, ">(", id,
           ") without a matching SetFlag", holder(src, dst, id), ": pipe ", pipe_name(dst),
           " would wait forever");
    hazards_.merge(dst, e.second);
    e.first = false;
  }

  // AllocEventID: the lowest ID of the pair that nobody holds, now held until ReleaseEventID.
  int alloc_event(int src, int dst, const char* name, const char* owner) {
    auto& pool = pools_[{src, dst}];
    for (int id = 0; id < kEventIds; ++id) {
      if (pool[id]) continue;
      pool[id] = owner;
      return id;
    }
    fail("event", "AllocEventID<", name, ">: all ", kEventIds, " IDs are held");
  }

  void release_event(int src, int dst, int id, const char* name) {
    check_id(id, name);
    auto& pool = pools_[{src, dst}];
    if (!pool[id]) fail("event", "ReleaseEventID<", name, ">(", id, ") of an ID nobody holds");
    pool[id] = nullptr;
  }

  // FetchEventID: the lowest ID nobody holds, for a SetFlag/WaitFlag pair that follows at once.
  int fetch_event(int src, int dst, const char* name) {
    auto& pool = pools_[{src, dst}];
    for (int id = 0; id < kEventIds; ++id)
      if (!pool[id]) return id;
    fail("event", "FetchEventID<", name, ">: all ", kEventIds, " IDs are held");
  }

  // A queue that goes away with buffers freed but not re-allocated: the pipe's end waits on
  // their FreeTensor flags (checked in finish(), outside any destructor).
  void defer_wait(int src, int dst, int id) noexcept {
    try {
      deferred_.push_back({src, dst, id});
    } catch (...) {
    }
  }

  void finish() {
    if (type_ == KernelType::kUndeclared)
      fail("kernel-type", "block ", idx_,
           " ran a kernel that declares no task type "
           "(KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY) for a vector kernel)");
    for (const auto& [src, dst, id] : deferred_) {
      wait_flag(src, dst, id, event_name(src, dst), "the pipe's end (a queue's FreeTensor flag)");
      pools_[{src, dst}][id] = nullptr;
    }
    deferred_.clear();
    for (const auto& [key, e] : events_) {
      if (e.first)
        fail("event", "block ", idx_, " ends with a SetFlag (", pipe_name(std::get<0>(key)), " -> ",
             pipe_name(std::get<1>(key)), ", id ", std::get<2>(key),
             ") never waited; the next kernel on this core would see it");
    }
  }

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  Launch& launch_;
  uint32_t idx_, num_;
  std::unique_ptr<uint8_t, FreeDeleter> ub_;
  uint32_t used_ = 0;
  Hazards hazards_;
  void check_id(int id, const char* name) const {
    if (id < 0 || id >= kEventIds)
      fail("event", "<", name, "> event ID ", id, " outside 0..", kEventIds - 1);
  }

  std::string holder(int src, int dst, int id) const {
    auto it = pools_.find({src, dst});
    if (it == pools_.end() || !it->second[id]) return "";
    return std::string(" (ID ") + std::to_string(id) + " is held by " + it->second[id] + ")";
  }

  std::map<std::tuple<int, int, int>, std::pair<bool, Clock>> events_;
  std::map<std::pair<int, int>, std::array<const char*, kEventIds>> pools_;
  std::vector<std::tuple<int, int, int>> deferred_;
  KernelType type_ = KernelType::kUndeclared;
};

inline Block*& current_block() {
  static thread_local Block* block = nullptr;
  return block;
}

inline Block& block() {
  Block* b = current_block();
  if (!b) fail("launch", "Ascend C API used outside dflash::emu::launch");
  return *b;
}

inline std::vector<uint32_t>& last_order() {
  static std::vector<uint32_t> order;
  return order;
}

inline uint64_t next_seed() {
  static std::atomic<uint64_t> launches{0};
  const char* env = std::getenv("ASCEND_EMU_SEED");
  uint64_t base = env ? std::strtoull(env, nullptr, 10) : 0x5eed;
  return base * 1000003u + launches++;
}

// Runs `kernel` once per block, blocks in a shuffled order, each with a fresh poisoned UB, then
// checks that no two blocks wrote the same GM bytes (their order is undefined on hardware).
inline void launch(uint32_t block_dim, std::vector<GmArg> gm, const std::function<void()>& kernel) {
  if (block_dim == 0) fail("launch", "blockDim must be at least 1");
  Launch state{std::move(gm), {}, {}};
  std::mt19937_64 rng(next_seed());
  for (bool done = false; !done;) {
    // a MIX kernel runs two vector blocks per requested block (see KernelType)
    const uint32_t blocks = state.mix ? 2 * block_dim : block_dim;
    state.order.resize(blocks);
    for (uint32_t i = 0; i < blocks; ++i) state.order[i] = i;
    std::shuffle(state.order.begin(), state.order.end(), rng);
    state.writes.clear();
    try {
      for (uint32_t idx : state.order) {
        Block b(state, idx, block_dim);
        current_block() = &b;
        kernel();
        b.finish();
        current_block() = nullptr;
      }
      done = true;
    } catch (const MixLaunch&) {  // declared first thing, before any work
      current_block() = nullptr;
      state.mix = true;
    } catch (...) {
      current_block() = nullptr;
      throw;
    }
  }
  last_order() = state.order;
  auto& w = state.writes;
  std::sort(w.begin(), w.end(),
            [](const GmWrite& a, const GmWrite& b) { return a.begin < b.begin; });
  // Sweep: the write reaching furthest so far must come from the same block as any that overlap it.
  for (size_t i = 1, far = 0; i < w.size(); ++i) {
    if (w[i].begin < w[far].end && w[i].block != w[far].block)
      fail("block-race", "blocks ", w[far].block, " and ", w[i].block,
           " both write the same GM bytes; their order is undefined on hardware");
    if (w[i].end > w[far].end) far = i;
  }
}

}  // namespace dflash::emu
