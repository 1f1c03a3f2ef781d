#include "policy.h"

#include <string>
#include <unordered_map>

namespace peak::caster {

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kNone: return "none";
    case Policy::kLower: return "lower";
    case Policy::kFp32: return "fp32";
    case Policy::kPromote: return "promote";
    case Policy::kSequencePromote: return "sequence_promote";
    case Policy::kBanned: return "banned";
    case Policy::kInplaceFp32: return "inplace_fp32";
    case Policy::kMatchSelf: return "match_self";
  }
  return "?";
}

namespace {

// ---- Apex's lists (apex/amp/lists/{functional,torch,tensor}_overrides.py)
// scaled_dot_product_attention beside Apex's list (it came after Apex): rotary embeddings (Llama)
// promote q and k to fp32 through `mul` with fp32 cos/sin while v stays low, and the op refuses
// mixed dtypes; torch.autocast lowers it too.
const char* const kFunctionalFp16[] = {"conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                       "conv_transpose2d", "conv_transpose3d", "conv_tbc",
                                       "linear", "scaled_dot_product_attention"};
const char* const kFunctionalFp32[] = {
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss",
    "kl_div", "l1_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "multi_margin_loss", "nll_loss",
    "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss"};
const char* const kFunctionalBanned[] = {"binary_cross_entropy"};

// torch FP16 list; addbmm/baddbmm/bmm are Apex's "CUDA >= 9.1" additions (always true today, and
// this caster casts CPU tensors too).
const char* const kTorchFp16[] = {"conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                  "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
                                  "addmm", "addmv", "addr", "matmul", "mm", "mv",
                                  "addbmm", "baddbmm", "bmm"};
const char* const kTorchFp32[] = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log",
                                  "log10", "log2", "reciprocal", "rsqrt", "sinh", "tan", "pow",
                                  "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum",
                                  "var", "renorm"};
// vdot beside Apex's list: torch's spectral_norm parametrization takes vdot(u, mv(W, v)), with mv
// on the low list.
const char* const kTorchCasts[] = {"addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot",
                                   "vdot", "add", "div", "mul", "eq", "equal", "ge", "gt", "le",
                                   "lt", "ne"};
const char* const kTorchSequenceCasts[] = {"cat", "stack"};
// RNN entry points (Apex 3.5 patched _VF; nn.LSTM/GRU/RNN call torch._VF.<name>, which is the
// torch.<name> builtin): their inputs, states and weight lists are cast to the low dtype.
const char* const kTorchRnn[] = {"lstm", "gru", "rnn_tanh", "rnn_relu",
                                 "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"};

const char* const kTensorFp16[] = {"__matmul__"};
const char* const kTensorFp32[] = {"__ipow__", "__pow__", "__rpow__", "cpu"};
const char* const kTensorCasts[] = {
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__",
    "__isub__", "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__",
    "__rmul__", "__rsub__", "__rtruediv__", "__sub__", "__truediv__"};

struct Held {
  PyObject* func;  // strong reference
  Policy policy;
};
std::unordered_map<PyObject*, Held>& table() {
  static auto* t = new std::unordered_map<PyObject*, Held>();  // leaked: outlives the interpreter
  return *t;
}

}  // namespace

std::vector<DefaultEntry> default_entries() {
  std::vector<DefaultEntry> out;
  auto add = [&](const char* where, const char* name, Policy p) { out.push_back({where, name, p}); };
  for (auto n : kFunctionalFp16) add("functional", n, Policy::kLower);
  for (auto n : kFunctionalFp32) add("functional", n, Policy::kFp32);
  for (auto n : kFunctionalBanned) add("functional", n, Policy::kBanned);
  for (auto n : kTorchFp16) add("torch", n, Policy::kLower);
  for (auto n : kTorchFp32) add("torch", n, Policy::kFp32);
  for (auto n : kTorchCasts) add("torch", n, Policy::kPromote);
  for (auto n : kTorchSequenceCasts) add("torch", n, Policy::kSequencePromote);
  for (auto n : kTorchRnn) add("torch", n, Policy::kLower);
  // Tensor: its own names, then the torch names that are Tensor methods (filtered on resolution).
  for (auto n : kTensorFp16) add("Tensor", n, Policy::kLower);
  for (auto n : kTorchFp16) add("Tensor", n, Policy::kLower);
  for (auto n : kTensorFp32) add("Tensor", n, Policy::kFp32);
  for (auto n : kTorchFp32) add("Tensor", n, Policy::kFp32);
  for (auto n : kTensorCasts) add("Tensor", n, Policy::kPromote);
  for (auto n : kTorchCasts) add("Tensor", n, Policy::kPromote);
  // In-place derivations (Apex init steps 3, 3.5, 4).
  static std::vector<std::string> names;  // keeps the derived names' storage alive
  if (names.empty()) {
    for (auto n : kTorchFp32) names.push_back(std::string(n) + "_");
    for (auto n : kTorchFp16) names.push_back(std::string(n) + "_");
    for (auto n : kTorchCasts) names.push_back(std::string(n) + "_");
  }
  size_t i = 0;
  for (size_t k = 0; k < std::size(kTorchFp32); ++k, ++i) {
    add("torch", names[i].c_str(), Policy::kInplaceFp32);
    add("Tensor", names[i].c_str(), Policy::kInplaceFp32);
  }
  for (; i < names.size(); ++i) add("Tensor", names[i].c_str(), Policy::kMatchSelf);
  return out;
}

Policy lookup(PyObject* func) {
  auto& t = table();
  auto it = t.find(func);
  return it == t.end() ? Policy::kNone : it->second.policy;
}

void set_policy(PyObject* func, Policy p) {
  auto& t = table();
  auto it = t.find(func);
  if (p == Policy::kNone) {
    if (it != t.end()) {
      Py_DECREF(it->second.func);
      t.erase(it);
    }
    return;
  }
  if (it != t.end()) {
    it->second.policy = p;
    return;
  }
  Py_INCREF(func);
  t.emplace(func, Held{func, p});
}

void clear_table() {
  auto& t = table();
  for (auto& kv : t) Py_DECREF(kv.second.func);
  t.clear();
}

std::vector<std::pair<PyObject*, Policy>> table_items() {
  std::vector<std::pair<PyObject*, Policy>> out;
  for (auto& kv : table()) out.emplace_back(kv.first, kv.second.policy);
  return out;
}

const char kBannedMessage[] =
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` It "
    "requires that the output of the previous function be already a FloatTensor. \n\n"
    "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
    "    torch.nn.BCEWithLogitsLoss (torch.nn.functional.binary_cross_entropy_with_logits)\n"
    "to combine Sigmoid+BCELoss into a single layer that is compatible with amp.\n"
    "Another option is to add\n"
    "    amp.register_float_function(torch, 'sigmoid')\n"
    "before calling `amp.initialize()`.\n"
    "If you _really_ know what you are doing, you can disable this warning by passing "
    "allow_banned=True to `amp.init()` (or peak.amp.lists.set_allow_banned(True)).";

}  // namespace peak::caster
