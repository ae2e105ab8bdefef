// Stub for the syntax check of csrc/npu (see ../../../README.md).
#pragma once
#include <functional>
#include <string>

namespace at_npu::native {
class OpCommand {
 public:
  OpCommand& Name(const std::string& name);
  OpCommand& SetCustomHandler(std::function<int()> func);
  void Run();
};
}  // namespace at_npu::native
