// Helpers shared by the CPU kernels in this folder. Each kernel .cpp is compiled once per CPU
// capability (see setup.py); keep file-local helpers in an anonymous namespace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

// Input errors raise ValueError("<op>: <message>"), the same text as dflash/checks.py, so the
// shared bad-input tests can match every implementation with one pattern.
#define DFLASH_CHECK(cond, op, ...) TORCH_CHECK_VALUE((cond), op ": ", __VA_ARGS__)

namespace dflash {

// "[2, 3, 4]", as Python prints a shape.
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// "torch.float32", as Python prints a dtype.
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kBool: return "torch.bool";
    case at::kDouble: return "torch.float64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

}  // namespace dflash
