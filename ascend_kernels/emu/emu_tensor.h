// Tensors, memory management and synchronization of the emulated Ascend C API:
// GlobalTensor, LocalTensor, TPipe, TQue, TBuf, SetFlag/WaitFlag, PipeBarrier, GetBlockIdx/Num.
#pragma once

#include <deque>
#include <type_traits>

#include "emu_runtime.h"
#include "emu_types.h"

// Device-code qualifiers are meaningless on the host.
#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };

namespace AscendC {

enum class TPosition : uint8_t { GM, VECIN, VECOUT, VECCALC };

enum class HardEvent : uint8_t {
  MTE2_V,
  V_MTE2,
  MTE3_V,
  V_MTE3,
  MTE2_MTE3,
  MTE3_MTE2,
  S_V,
  V_S,
  MTE2_S,
  S_MTE2,
  MTE3_S,
  S_MTE3
};

namespace detail {

struct EventPipes {
  int src, dst;
  const char* name;
};

constexpr EventPipes event_pipes(HardEvent e) {
  switch (e) {
    case HardEvent::MTE2_V:
      return {dflash::emu::kMte2, dflash::emu::kV, "MTE2_V"};
    case HardEvent::V_MTE2:
      return {dflash::emu::kV, dflash::emu::kMte2, "V_MTE2"};
    case HardEvent::MTE3_V:
      return {dflash::emu::kMte3, dflash::emu::kV, "MTE3_V"};
    case HardEvent::V_MTE3:
      return {dflash::emu::kV, dflash::emu::kMte3, "V_MTE3"};
    case HardEvent::MTE2_MTE3:
      return {dflash::emu::kMte2, dflash::emu::kMte3, "MTE2_MTE3"};
    case HardEvent::MTE3_MTE2:
      return {dflash::emu::kMte3, dflash::emu::kMte2, "MTE3_MTE2"};
    case HardEvent::S_V:
      return {dflash::emu::kS, dflash::emu::kV, "S_V"};
    case HardEvent::V_S:
      return {dflash::emu::kV, dflash::emu::kS, "V_S"};
    case HardEvent::MTE2_S:
      return {dflash::emu::kMte2, dflash::emu::kS, "MTE2_S"};
    case HardEvent::S_MTE2:
      return {dflash::emu::kS, dflash::emu::kMte2, "S_MTE2"};
    case HardEvent::MTE3_S:
      return {dflash::emu::kMte3, dflash::emu::kS, "MTE3_S"};
    case HardEvent::S_MTE3:
      return {dflash::emu::kS, dflash::emu::kMte3, "S_MTE3"};
  }
  return {dflash::emu::kS, dflash::emu::kS, "?"};
}

}  // namespace detail

using TEventID = int8_t;

inline int64_t GetBlockIdx() {
  return dflash::emu::block().idx();
}
inline int64_t GetBlockNum() {
  return dflash::emu::block().num();
}

template <HardEvent E>
inline void SetFlag(int32_t id) {
  constexpr auto p = detail::event_pipes(E);
  dflash::emu::block().set_flag(p.src, p.dst, id, p.name);
}

template <HardEvent E>
inline void WaitFlag(int32_t id) {
  constexpr auto p = detail::event_pipes(E);
  dflash::emu::block().wait_flag(p.src, p.dst, id, p.name);
}

template <pipe_t P>
inline void PipeBarrier() {
  static_assert(P == PIPE_V || P == PIPE_ALL || P == PIPE_MTE2 || P == PIPE_MTE3 || P == PIPE_S,
                "pipe not modelled by the emulation");
  if constexpr (P == PIPE_S)
    dflash::emu::fail("sync", "PipeBarrier<PIPE_S> raises a hardware error");
  if constexpr (P == PIPE_V) dflash::emu::block().hazards().barrier_vector();
  if constexpr (P == PIPE_ALL) dflash::emu::block().hazards().barrier_all();
  // MTE2 and MTE3 each execute in order: a barrier on them orders nothing the emulation tracks.
}

template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T* buffer, uint64_t size) {
    dflash::emu::block().check_gm(buffer, size * sizeof(T), false, "SetGlobalBuffer");
    data_ = buffer;
    size_ = size;
  }
  void SetGlobalBuffer(__gm__ T* buffer) {
    data_ = buffer;
    size_ = 0;
  }

  GlobalTensor operator[](uint64_t offset) const {
    GlobalTensor t;
    t.data_ = data_ + offset;
    t.size_ = size_ ? (offset <= size_ ? size_ - offset : 0) : 0;
    if (size_ && offset > size_)
      dflash::emu::fail("gm-bounds", "GlobalTensor offset ", offset, " past its ", size_,
                        " elements");
    return t;
  }

  // Scalar read through the data cache (pipe S); inputs only, so no hazard to track.
  T GetValue(uint64_t i) const {
    check(i, 1, false, "GlobalTensor::GetValue");
    return data_[i];
  }

  // Emulation internals, used by DataCopy.
  T* data() const { return data_; }
  void check(uint64_t first, uint64_t count, bool write, const char* what) const {
    if (size_ && first + count > size_)
      dflash::emu::fail("gm-bounds", what, " reaches element ", first + count,
                        " of a GlobalTensor of ", size_);
    dflash::emu::block().check_gm(data_ + first, count * sizeof(T), write, what);
  }

 private:
  T* data_ = nullptr;
  uint64_t size_ = 0;
};

template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;

  LocalTensor operator[](uint32_t offset) const {
    if (offset > size_)
      dflash::emu::fail("ub-bounds", "LocalTensor offset ", offset, " past its ", size_,
                        " elements");
    return LocalTensor(offset_ + offset * sizeof(T), size_ - offset, pos_);
  }

  uint32_t GetSize() const { return size_; }

  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    return LocalTensor<U>(offset_, size_ * sizeof(T) / sizeof(U), pos_);
  }

  // Scalar access (pipe S): ordered against vector and DMA pipes only by explicit flags.
  T GetValue(uint32_t i) const {
    check_element(i, "LocalTensor::GetValue");
    dflash::emu::block().scalar_access("LocalTensor::GetValue");
    auto& h = dflash::emu::block().hazards();
    h.issue(dflash::emu::kS);
    h.read(dflash::emu::kS, offset_ + i * sizeof(T), sizeof(T), "LocalTensor::GetValue");
    return data()[i];
  }

  void SetValue(uint32_t i, T value) const {
    check_element(i, "LocalTensor::SetValue");
    dflash::emu::block().scalar_access("LocalTensor::SetValue");
    auto& h = dflash::emu::block().hazards();
    h.issue(dflash::emu::kS);
    h.write(dflash::emu::kS, offset_ + i * sizeof(T), sizeof(T), "LocalTensor::SetValue");
    data()[i] = value;
  }

  // Emulation internals.
  LocalTensor(uint32_t offset, uint32_t size, TPosition pos)
      : offset_(offset), size_(size), pos_(pos) {}
  uint32_t offset() const { return offset_; }
  TPosition position() const { return pos_; }
  T* data() const { return reinterpret_cast<T*>(dflash::emu::block().ub(offset_)); }

 private:
  void check_element(uint32_t i, const char* what) const {
    if (i >= size_)
      dflash::emu::fail("ub-bounds", what, "(", i, ") on a tensor of ", size_, " elements");
  }

  uint32_t offset_ = 0;
  uint32_t size_ = 0;
  TPosition pos_ = TPosition::VECCALC;
};

template <TPosition Pos>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() const {
    return LocalTensor<T>(offset_, bytes_ / sizeof(T), Pos);
  }
  template <typename T>
  LocalTensor<T> Get(uint32_t count) const {
    if (count * sizeof(T) > bytes_)
      dflash::emu::fail("ub-bounds", "TBuf::Get(", count, ") on a buffer of ", bytes_, " bytes");
    return LocalTensor<T>(offset_, count, Pos);
  }

  void init(uint32_t offset, uint32_t bytes) {
    offset_ = offset;
    bytes_ = bytes;
  }

 private:
  uint32_t offset_ = 0, bytes_ = 0;
};

namespace detail {

// A queue's buffers and the flags its operations set, with IDs from the pipe's shared pool:
// EnQue sets producer -> consumer on a fresh ID that DeQue waits on and releases; FreeTensor sets
// consumer -> producer on a fresh ID that the buffer's next AllocTensor waits on and releases (the
// pipe's end waits on the ones still held).
class Queue {
 public:
  Queue(TPosition pos, int depth) : pos_(pos), depth_(depth) {
    if (pos == TPosition::VECIN) {
      producer_ = dflash::emu::kMte2;
      consumer_ = dflash::emu::kV;
    } else if (pos == TPosition::VECOUT) {
      producer_ = dflash::emu::kV;
      consumer_ = dflash::emu::kMte3;
    } else {
      dflash::emu::fail("queue", "only VECIN and VECOUT queues are modelled");
    }
  }

  ~Queue() {
    dflash::emu::Block* blk = dflash::emu::current_block();
    if (!blk) return;
    for (const Buf& b : bufs_)
      if (b.free_id >= 0) blk->defer_wait(consumer_, producer_, b.free_id);
  }

  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  TPosition position() const { return pos_; }

  void init(uint32_t num, uint32_t bytes) {
    if (!bufs_.empty()) dflash::emu::fail("queue", "InitBuffer called twice on one queue");
    if (num == 0 || bytes == 0)
      dflash::emu::fail("queue", "InitBuffer needs num >= 1 and len >= 1");
    bufs_.resize(num);
    for (Buf& b : bufs_) {
      b.offset = dflash::emu::block().allocate(bytes, "InitBuffer(TQue)");
      b.bytes = bytes;
    }
  }

  uint32_t alloc() {
    for (Buf& b : bufs_) {
      if (b.state != kFree) continue;
      auto& blk = dflash::emu::block();
      if (b.free_id >= 0) {
        blk.wait_flag(consumer_, producer_, b.free_id,
                      dflash::emu::event_name(consumer_, producer_),
                      "AllocTensor (waits on its buffer's FreeTensor flag)");
        blk.release_event(consumer_, producer_, b.free_id,
                          dflash::emu::event_name(consumer_, producer_));
        b.free_id = -1;
      }
      b.state = kAllocated;
      blk.poison(b.offset, b.bytes);
      return b.offset;
    }
    dflash::emu::fail("queue-depth", "AllocTensor: all ", bufs_.size(),
                      " buffers of this queue are in use (missing FreeTensor?)");
  }

  void enque(uint32_t offset) {
    Buf& b = find(offset, kAllocated, "EnQue");
    if (static_cast<int>(fifo_.size()) >= depth_)
      dflash::emu::fail("queue-depth", "EnQue: the queue already holds its depth of ", depth_,
                        " tensors");
    auto& blk = dflash::emu::block();
    const char* name = dflash::emu::event_name(producer_, consumer_);
    b.state = kQueued;
    b.enque_id = blk.alloc_event(producer_, consumer_, name, "a queue's EnQue");
    blk.set_flag(producer_, consumer_, b.enque_id, name);
    fifo_.push_back(&b);
  }

  uint32_t deque() {
    if (fifo_.empty()) dflash::emu::fail("queue-depth", "DeQue on an empty queue");
    Buf& b = *fifo_.front();
    fifo_.pop_front();
    auto& blk = dflash::emu::block();
    const char* name = dflash::emu::event_name(producer_, consumer_);
    blk.wait_flag(producer_, consumer_, b.enque_id, name, "DeQue (waits on its EnQue flag)");
    blk.release_event(producer_, consumer_, b.enque_id, name);
    b.state = kDequeued;
    return b.offset;
  }

  void free(uint32_t offset) {
    Buf* b = nullptr;
    for (Buf& c : bufs_)
      if (c.offset == offset && (c.state == kAllocated || c.state == kDequeued)) b = &c;
    if (!b) dflash::emu::fail("queue", "FreeTensor of a tensor this queue does not hold");
    int releasing = b->state == kDequeued ? consumer_ : producer_;
    auto& blk = dflash::emu::block();
    const char* name = dflash::emu::event_name(consumer_, producer_);
    b->state = kFree;
    b->free_id = blk.alloc_event(consumer_, producer_, name, "a queue's FreeTensor");
    blk.set_flag(consumer_, producer_, b->free_id, name, blk.hazards().snapshot(releasing));
  }

  uint32_t bytes(uint32_t offset) const {
    for (const Buf& b : bufs_)
      if (b.offset == offset) return b.bytes;
    return 0;
  }

 private:
  enum State { kFree, kAllocated, kQueued, kDequeued };
  struct Buf {
    uint32_t offset = 0, bytes = 0;
    State state = kFree;
    int enque_id = -1, free_id = -1;
  };

  Buf& find(uint32_t offset, State state, const char* what) {
    for (Buf& b : bufs_)
      if (b.offset == offset && b.state == state) return b;
    dflash::emu::fail("queue", what, " of a tensor that was not allocated from this queue");
  }

  TPosition pos_;
  int depth_;
  int producer_ = dflash::emu::kMte2, consumer_ = dflash::emu::kV;
  std::vector<Buf> bufs_;
  std::deque<Buf*> fifo_;
};

}  // namespace detail

template <TPosition Pos, int32_t Depth>
class TQue {
 public:
  TQue() : queue_(Pos, Depth) {}

  template <typename T>
  LocalTensor<T> AllocTensor() {
    uint32_t offset = queue_.alloc();
    return LocalTensor<T>(offset, queue_.bytes(offset) / sizeof(T), Pos);
  }

  template <typename T>
  bool EnQue(const LocalTensor<T>& t) {
    queue_.enque(t.offset());
    return true;
  }

  template <typename T>
  LocalTensor<T> DeQue() {
    uint32_t offset = queue_.deque();
    return LocalTensor<T>(offset, queue_.bytes(offset) / sizeof(T), Pos);
  }

  template <typename T>
  void FreeTensor(LocalTensor<T>& t) {
    queue_.free(t.offset());
  }

  detail::Queue& queue() { return queue_; }

 private:
  detail::Queue queue_;
};

class TPipe {
 public:
  TPipe() = default;
  ~TPipe() {  // the pipe owns the block's UB allocations
    if (dflash::emu::current_block()) dflash::emu::block().release_all();
  }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <TPosition Pos, int32_t Depth>
  void InitBuffer(TQue<Pos, Depth>& que, uint8_t num, uint32_t len) {
    que.queue().init(num, len);
  }

  template <TPosition Pos>
  void InitBuffer(TBuf<Pos>& buf, uint32_t len) {
    buf.init(dflash::emu::block().allocate(len, "InitBuffer(TBuf)"), len);
  }

  // Event IDs come from the pool the queues draw from (see detail::Queue).
  template <HardEvent E>
  TEventID AllocEventID() {
    constexpr auto p = detail::event_pipes(E);
    return static_cast<TEventID>(
        dflash::emu::block().alloc_event(p.src, p.dst, p.name, "AllocEventID"));
  }

  template <HardEvent E>
  void ReleaseEventID(TEventID id) {
    constexpr auto p = detail::event_pipes(E);
    dflash::emu::block().release_event(p.src, p.dst, id, p.name);
  }

  template <HardEvent E>
  TEventID FetchEventID() {
    constexpr auto p = detail::event_pipes(E);
    return static_cast<TEventID>(dflash::emu::block().fetch_event(p.src, p.dst, p.name));
  }

  TEventID FetchEventID(HardEvent e) {
    const auto p = detail::event_pipes(e);
    return static_cast<TEventID>(dflash::emu::block().fetch_event(p.src, p.dst, p.name));
  }
};

}  // namespace AscendC
