// The names of gqa_types.h's inputs, outputs and element types, as the messages write them.
#include "core/gqa_types.h"

namespace kvl {

int64_t TensorInfo::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* GqaInputName(GqaInput input) {
  static constexpr const char* kNames[kGqaInputCount] = {
      "query",     "key",        "value",          "past_key",      "past_value",
      "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache", "position_ids",
      "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight", "k_norm_weight",
      "query_seqlens", "past_key_scale", "past_value_scale"};
  return kNames[static_cast<int>(input)];
}

const char* GqaOutputName(GqaOutput output) {
  static constexpr const char* kNames[kGqaOutputCount] = {
      "output", "present_key", "present_value", "output_qk", "present_key_scale",
      "present_value_scale"};
  return kNames[static_cast<int>(output)];
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8e4m3fn";
    case DType::kUndefined: return "undefined";
    default: return "an unsupported type";
  }
}

}  // namespace kvl
