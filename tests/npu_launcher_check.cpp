// tests/test_npu_build.py runs csrc/npu's launchers against stand-ins that behave like torch_npu
// and CANN: the current stream is thread-local and OpCommand runs its custom handler on another
// thread (the task queue's); the device guard and the platform record what they are asked. The
// kernels' launch functions are stubs, so the launchers run on CPU tensors.
//   npu_launcher_check stream    prints which thread's stream a launch got ("caller")
//   npu_launcher_check guards    calls each launcher, prints the device each one guarded
//   npu_launcher_check platform  prints the error of a launcher when CANN has no platform
//   npu_launcher_check status    launches whose aclrtlaunch_* fail: prints the task's error (the
//                                launcher's own report goes to stderr)
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "npu/context_kv.cpp"
#include "npu/paged_attention.cpp"
#include "npu/rejection_sample.cpp"

namespace c10_npu {
thread_local void* current_stream = nullptr;
void* NPUStream::stream(const bool) const {
  return current_stream;
}
NPUStream getCurrentNPUStream(signed char) {
  return NPUStream();
}
std::vector<std::string> guarded;  // the device of every guard, in order
OptionalNPUGuard::OptionalNPUGuard(std::optional<c10::Device> device) {
  guarded.push_back(device ? device->str() : "none");
}
OptionalNPUGuard::~OptionalNPUGuard() = default;
}  // namespace c10_npu

namespace at_npu::native {
namespace {
std::function<int()> handler;
}
// torch_npu fails an op's task whose custom handler returns non-zero
OpCommand& OpCommand::Name(const std::string&) {
  return *this;
}
OpCommand& OpCommand::SetCustomHandler(std::function<int()> func) {
  handler = std::move(func);
  return *this;
}
void OpCommand::Run() {
  int status = 0;
  std::thread([&status] { status = handler(); }).join();  // the task queue's thread
  TORCH_CHECK(status == 0, "task failed: its handler returned ", status);
}
}  // namespace at_npu::native

namespace platform_ascendc {
bool available = true;
PlatformAscendC* PlatformAscendCManager::GetInstance() {
  static PlatformAscendC instance;
  return available ? &instance : nullptr;
}
uint32_t PlatformAscendC::GetCoreNumAiv() const {
  return 8;
}
void PlatformAscendC::GetCoreMemSize(const CoreMemType&, uint64_t& size) const {
  size = 192 * 1024;
}
}  // namespace platform_ascendc

namespace AscendC {
void GetSumMaxMinTmpSize(const uint32_t, const uint32_t, const bool, uint32_t& maxSize,
                         uint32_t& minSize) {
  maxSize = minSize = 0;
}
}  // namespace AscendC

// the generated launch functions: they return `launch_status` (the runtime's status)
uint32_t launch_status = 0;
#define DFLASH_STUB_LAUNCH(KERNEL, ...)                                          \
  extern "C" uint32_t aclrtlaunch_##KERNEL(uint32_t, aclrtStream, __VA_ARGS__) { \
    return launch_status;                                                        \
  }
#define DFLASH_GM6 void*, void*, void*, void*, void*, void*
DFLASH_STUB_LAUNCH(dflash_context_kv_fp32, DFLASH_GM6, ContextKvTiling*)
DFLASH_STUB_LAUNCH(dflash_context_kv_fp16, DFLASH_GM6, ContextKvTiling*)
DFLASH_STUB_LAUNCH(dflash_context_kv_bf16, DFLASH_GM6, ContextKvTiling*)
DFLASH_STUB_LAUNCH(dflash_paged_attention_fp32, DFLASH_GM6, void*, void*, void*, void*,
                   PagedAttentionTiling*)
DFLASH_STUB_LAUNCH(dflash_paged_attention_fp16, DFLASH_GM6, void*, void*, void*, void*,
                   PagedAttentionTiling*)
DFLASH_STUB_LAUNCH(dflash_paged_attention_bf16, DFLASH_GM6, void*, void*, void*, void*,
                   PagedAttentionTiling*)
DFLASH_STUB_LAUNCH(dflash_rejection_sample, DFLASH_GM6, void*, void*, RejectionSampleTiling*)
#undef DFLASH_GM6
#undef DFLASH_STUB_LAUNCH

namespace {

// Each launcher once; with `report`, each one's error is printed and the next one runs.
void call_every_launcher(bool report = false) {
  const auto f = at::TensorOptions().dtype(at::kFloat);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  auto call = [report](auto launcher) {
    if (!report) return launcher();
    try {
      launcher();
      std::printf("no error\n");
    } catch (const c10::Error& e) {
      std::printf("%s\n", e.what_without_backtrace());
    }
  };
  // paged_attention (the functional schema, then .out): one sequence of 2 new tokens, no context
  using dflash::npu::paged_attention_into, dflash::npu::sample_into;
  const auto attention = [&](auto launcher, auto... out) {
    launcher(at::randn({2, 2, 8}, f), at::randn({2, 1, 8}, f), at::randn({2, 1, 8}, f),
             at::randn({2, 4, 1, 8}, f), at::randn({2, 4, 1, 8}, f), at::zeros({1, 1}, i32),
             at::zeros({1}, i32), at::tensor({0, 2}, i32), 0.35, true, false, std::nullopt, out...);
  };
  call([&] { attention(dflash::variants::paged_attention<paged_attention_into>); });
  call([&] {
    at::Tensor out = at::empty({2, 2, 8}, f);
    attention(dflash::variants::paged_attention_out<paged_attention_into>, out);
  });
  // rejection_sample (likewise): one greedy row of 2 drafts over 5 tokens
  const auto sample = [&](auto launcher, auto&... out) {
    launcher(at::zeros({1, 2}, i64), std::nullopt, at::softmax(at::randn({1, 3, 5}, f), -1),
             at::ones({1}, at::TensorOptions().dtype(at::kBool)), at::zeros({1, 2}, f),
             at::ones({1, 5}, f), false, out...);
  };
  call([&] { sample(dflash::variants::rejection_sample<sample_into>); });
  call([&] {
    at::Tensor ids = at::empty({1, 3}, i64), accepted = at::empty({1}, i64);
    sample(dflash::variants::rejection_sample_out<sample_into>, ids, accepted);
  });
  // context_kv: 2 tokens, 1 layer, 1 kv head of 8
  call([&] {
    const std::vector<at::Tensor> keys{at::zeros({2, 4, 1, 8}, f)};
    const std::vector<at::Tensor> values{at::zeros({2, 4, 1, 8}, f)};
    dflash::npu::context_kv_npu(at::randn({2, 8}, f), std::nullopt, at::ones({8}, f),
                                at::randn({16, 8}, f), std::nullopt, at::ones({1, 8}, f),
                                at::tensor({0, 1}, i64), at::randn({16, 8}, f),
                                at::tensor({0, 1}, i64), keys, values, 1e-6, false);
  });
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "stream") {
    static int caller_stream;
    c10_npu::current_stream = &caller_stream;
    void* seen = nullptr;
    dflash::ascend::run_on_stream("check", [&seen](void* stream) {
      seen = stream;
      return 0u;
    });
    std::printf("%s\n", seen == &caller_stream ? "caller" : "other");
  } else if (mode == "guards") {
    call_every_launcher();
    for (const auto& device : c10_npu::guarded) std::printf("%s\n", device.c_str());
  } else if (mode == "status") {
    launch_status = 507015;
    call_every_launcher(true);
  } else if (mode == "platform") {
    platform_ascendc::available = false;
    try {
      call_every_launcher();
      std::printf("no error\n");
    } catch (const c10::Error& e) {
      std::printf("%s\n", e.what_without_backtrace());
    }
  }
  return 0;
}
