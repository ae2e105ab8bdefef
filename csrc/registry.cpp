// The one place where the dflash operator schemas live (docs/design.md section 3).
//
// Implementations register elsewhere: the CPU kernels in csrc/cpu/ (built once per CPU capability
// and loaded at import time), the NPU launchers in csrc/npu/ (only with --device npu), and the fake
// (meta) functions plus any reference fallbacks from dflash/ops/registry.py.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(dflash, m) {
  m.def(
      "context_kv(Tensor hidden, Tensor? fc_weight, Tensor hidden_norm_weight, Tensor kv_weight, "
      "Tensor? kv_bias, Tensor k_norm_weight, Tensor positions, Tensor cos_sin_cache, "
      "Tensor slot_mapping, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, float eps, "
      "bool check=True) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor context_lens, Tensor cu_query_lens, "
      "float scale, bool causal, bool check=True, Tensor? tree_mask=None) -> Tensor");
  // The same into a caller-owned output: nothing allocated, so a captured graph (an ACL graph on
  // Ascend) replays it into fixed memory (docs/design.md 3.2).
  m.def(
      "paged_attention.out(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
      "Tensor value_cache, Tensor block_table, Tensor context_lens, Tensor cu_query_lens, "
      "float scale, bool causal, bool check=True, Tensor? tree_mask=None, *, Tensor(a!) out) -> "
      "()");
  m.def(
      "rejection_sample(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor is_greedy, Tensor uniform, Tensor exponential, bool check=True) -> "
      "(Tensor, Tensor)");
  m.def(
      "rejection_sample.out(Tensor draft_token_ids, Tensor? draft_probs, Tensor target_probs, "
      "Tensor is_greedy, Tensor uniform, Tensor exponential, bool check=True, *, "
      "Tensor(a!) output_token_ids, Tensor(b!) num_accepted) -> ()");
  // docs/design.md section 3.3: the counter-based noise rejection_sample's inputs are made of
  // (Philox4x32-10 words; csrc/cpu/philox.cpp, the PyTorch reference on other devices).
  m.def(
      "philox_bits(Tensor seeds, Tensor offsets, int stream, int rows, int n, bool check=True) -> "
      "Tensor");
  // Each row's k largest entries, or their softmax probabilities: the greedy tokens and the
  // draft tree's candidates (docs/design.md 3.3.1) in one pass over the vocabulary.
  m.def("top_k(Tensor x, int k, bool probs) -> (Tensor, Tensor)");
  // docs/design.md section 3.4: the decoder layer's small ops, each one call instead of several ATen
  // calls (csrc/cpu/layer_ops.cpp; the PyTorch reference serves other devices).
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor x, Tensor cos_sin) -> Tensor");
  m.def(
      "qkv_rope_cache(Tensor qkv, Tensor? q_norm_weight, Tensor? k_norm_weight, Tensor cos_sin, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, int num_heads, "
      "float eps, bool check=True) -> (Tensor, Tensor, Tensor)");
  m.def("panel_linear(Tensor x, Tensor weight_panels, Tensor? bias) -> Tensor");
  m.def(
      "quant_linear(Tensor x, Tensor weight, Tensor scales, Tensor? mins, Tensor? bias) -> Tensor");
  // A target decoder layer of decoding or verification as one call of the ops above
  // (csrc/decoder_layer.cpp): each linear weight is a plain, panel or oneDNN tensor, or quantized
  // codes with their scales (and 4-bit mins).
  m.def(
      "decoder_layer(Tensor x, Tensor? residual, Tensor input_norm, Tensor post_norm, Tensor qkv, "
      "Tensor? qkv_scales, Tensor? qkv_mins, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
      "Tensor o, Tensor? o_scales, Tensor? o_mins, Tensor? o_bias, Tensor gate_up, "
      "Tensor? gate_up_scales, Tensor? gate_up_mins, Tensor down, Tensor? down_scales, "
      "Tensor? down_mins, Tensor cos_sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor block_table, Tensor context_lens, Tensor cu_query_lens, "
      "Tensor? tree_mask, int num_heads, float scale, float eps, bool check=True) -> "
      "(Tensor, Tensor)");
}

// `import dflash._C` loads the schemas; the module itself has no Python attributes.
static PyModuleDef dflash_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C() {
  return PyModule_Create(&dflash_c_module);
}
