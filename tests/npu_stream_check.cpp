// tests/test_npu_build.py runs dflash::ascend::run_on_stream (csrc/npu/npu_common.h) against
// stand-ins that behave like torch_npu: the current stream is thread-local and OpCommand runs its
// custom handler on another thread (the task queue's). Prints which thread's stream the launch got.
#include <cstdio>
#include <thread>

#include "npu/npu_common.h"

namespace c10_npu {
thread_local void* current_stream = nullptr;
void* NPUStream::stream(const bool) const {
  return current_stream;
}
NPUStream getCurrentNPUStream(signed char) {
  return NPUStream();
}
}  // namespace c10_npu

namespace at_npu::native {
namespace {
std::function<int()> handler;
}
OpCommand& OpCommand::Name(const std::string&) {
  return *this;
}
OpCommand& OpCommand::SetCustomHandler(std::function<int()> func) {
  handler = std::move(func);
  return *this;
}
void OpCommand::Run() {
  std::thread([] { handler(); }).join();
}  // the task queue's thread
}  // namespace at_npu::native

int main() {
  static int caller_stream;
  c10_npu::current_stream = &caller_stream;
  void* seen = nullptr;
  dflash::ascend::run_on_stream("check", [&seen](void* stream) { seen = stream; });
  std::printf("%s\n", seen == &caller_stream ? "caller" : "other");
  return 0;
}
