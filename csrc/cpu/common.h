// Helpers shared by the CPU kernels in this folder. Each kernel .cpp is compiled once per CPU
// capability (see setup.py); keep file-local helpers in an anonymous namespace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

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

// checks.tensor of dflash/checks.py: `t` has one of `dtypes`, rank `dim`, the sizes `shape`
// lists for its leading dims (-1 = any) and, when given, `device`. Raises ValueError("op: ...").
inline void check_tensor(const char* op, const std::string& name, const at::Tensor& t,
                         c10::ArrayRef<at::ScalarType> dtypes, int64_t dim,
                         c10::ArrayRef<int64_t> shape = {},
                         const std::optional<at::Device>& device = std::nullopt) {
  if (std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) == dtypes.end()) {
    std::string expected;
    for (auto d : dtypes) expected += (expected.empty() ? "" : " or ") + dtype_str(d);
    TORCH_CHECK_VALUE(false, op, ": ", name, " has dtype ", dtype_str(t.scalar_type()),
                      ", expected ", expected);
  }
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ",
                    shape_str(t));
  for (size_t i = 0; i < shape.size() && static_cast<int64_t>(i) < t.dim(); ++i) {
    TORCH_CHECK_VALUE(shape[i] < 0 || t.size(i) == shape[i], op, ": ", name, " has shape ",
                      shape_str(t), ", expected size ", shape[i], " in dim ", i);
  }
  TORCH_CHECK_VALUE(!device || t.device() == *device, op, ": ", name, " is on ",
                    t.device().str(), ", expected ", device ? device->str() : "");
}

}  // namespace dflash
