#include "ort/gqa_op_common.h"

#include <string>
#include <utility>
#include <vector>

#include "core/gqa_attributes.h"

namespace kvl {
namespace {

// One node's attributes through OrtKernelInfo (the Source of ParseGqaAttributes). The C API has
// only typed getters by name (no way to list a node's attributes or ask one's type), so Type()
// probes: each scalar getter succeeds only for its own type; the array getters succeed for any
// attribute the node carries (ORT copies the list of that type, empty for another type), which
// also tells a present attribute of another type from an absent one.
struct KernelInfoAttrs {
  const OrtApi& api;
  const OrtKernelInfo* info;

  bool Ok(OrtStatus* st) const {
    if (st == nullptr) return true;
    api.ReleaseStatus(st);
    return false;
  }
  AttrType Type(const char* name) const {
    int64_t i = 0;
    float f = 0.0f;
    size_t size = 0;
    if (Ok(api.KernelInfoGetAttribute_int64(info, name, &i))) return AttrType::kInt;
    if (Ok(api.KernelInfoGetAttribute_float(info, name, &f))) return AttrType::kFloat;
    if (Ok(api.KernelInfoGetAttribute_string(info, name, nullptr, &size))) return AttrType::kString;
    size_t ints = 0, floats = 0;
    const bool ints_ok = Ok(api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &ints));
    const bool floats_ok = Ok(api.KernelInfoGetAttributeArray_float(info, name, nullptr, &floats));
    if (ints_ok && ints > 0) return AttrType::kInts;
    if (floats_ok && floats > 0) return AttrType::kFloats;
    OrtAllocator* alloc = nullptr;
    OrtValue* tensor = nullptr;
    if (Ok(api.GetAllocatorWithDefaultOptions(&alloc)) &&
        Ok(api.KernelInfoGetAttribute_tensor(info, name, alloc, &tensor))) {
      api.ReleaseValue(tensor);
      return AttrType::kTensor;
    }
    return ints_ok || floats_ok ? AttrType::kOther : AttrType::kAbsent;
  }
  int64_t Int(const char* name) const {
    int64_t value = 0;
    Ok(api.KernelInfoGetAttribute_int64(info, name, &value));
    return value;
  }
  float Float(const char* name) const {
    float value = 0.0f;
    Ok(api.KernelInfoGetAttribute_float(info, name, &value));
    return value;
  }
  std::string String(const char* name) const {
    size_t size = 0;
    if (!Ok(api.KernelInfoGetAttribute_string(info, name, nullptr, &size))) return {};
    std::string value(size, '\0');
    if (!Ok(api.KernelInfoGetAttribute_string(info, name, value.data(), &size))) return {};
    while (!value.empty() && value.back() == '\0') value.pop_back();
    return value;
  }
};

}  // namespace

Status ReadGqaAttributes(const OrtApi& api, const OrtKernelInfo* info, GqaAttributes* attrs,
                         const GqaKernelCaps& caps) {
  GqaAttributes a;
  KVL_RETURN_IF_ERROR(ParseGqaAttributes(KernelInfoAttrs{api, info}, &a));
  size_t outputs = 0;
  if (OrtStatus* st = api.KernelInfo_GetOutputCount(info, &outputs)) {
    api.ReleaseStatus(st);
    outputs = 0;
  }
  // Whether the node names output `which` (an empty name is an absent optional output).
  auto named = [&](GqaOutput which) {
    const size_t index = static_cast<size_t>(which);
    if (index >= outputs) return false;
    size_t size = 0;
    if (OrtStatus* st = api.KernelInfo_GetOutputName(info, index, nullptr, &size)) {
      api.ReleaseStatus(st);
      return false;
    }
    return size > 1;  // size counts the terminating NUL
  };
  a.output_qk_requested = named(GqaOutput::kOutputQk);
  a.present_key_scale_requested = named(GqaOutput::kPresentKeyScale);
  a.present_value_scale_requested = named(GqaOutput::kPresentValueScale);
  KVL_RETURN_IF_ERROR(CheckGqaAttributes(a, caps));
  *attrs = a;
  return Status::Ok();
}

Status ReadAndCheckInputs(Ort::KernelContext& ctx, const GqaAttributes& attrs, GqaShape* shape,
                          const GqaKernelCaps& caps) {
  const GqaInputInfos inputs = DescribeInputs<kGqaInputCount>(ctx);
  const int32_t* total = InputData<int32_t>(ctx, GqaInput::kTotalSequenceLength);
  const bool one = inputs[static_cast<int>(GqaInput::kTotalSequenceLength)].NumElements() == 1;
  // A malformed total_sequence_length reaches CheckGqaInputs, which names it.
  return CheckGqaInputs(attrs, inputs, one && total != nullptr ? *total : 0, shape, caps);
}

GqaBuffers CollectBuffers(Ort::KernelContext& ctx, const GqaShape& shape,
                          const GqaOutputs& outputs) {
  // The inputs the kernels read as bytes of T (or of the cache's storage).
  constexpr std::pair<GqaInput, const void* GqaBuffers::*> kBytes[] = {
      {GqaInput::kQuery, &GqaBuffers::query},
      {GqaInput::kKey, &GqaBuffers::key},
      {GqaInput::kValue, &GqaBuffers::value},
      {GqaInput::kPastKey, &GqaBuffers::past_key},
      {GqaInput::kPastValue, &GqaBuffers::past_value},
      {GqaInput::kAttentionBias, &GqaBuffers::attention_bias},
      {GqaInput::kHeadSink, &GqaBuffers::head_sink},
      {GqaInput::kQNormWeight, &GqaBuffers::q_norm_weight},
      {GqaInput::kKNormWeight, &GqaBuffers::k_norm_weight},
      {GqaInput::kCosCache, &GqaBuffers::cos_cache},
      {GqaInput::kSinCache, &GqaBuffers::sin_cache}};
  GqaBuffers buf;
  for (const auto& [input, field] : kBytes) {
    const bool rotary_cache = input == GqaInput::kCosCache || input == GqaInput::kSinCache;
    if (!rotary_cache || shape.rotary_dim > 0) buf.*field = InputData<void>(ctx, input);
  }
  buf.seqlens_k = InputData<int32_t>(ctx, GqaInput::kSeqlensK);
  buf.query_seqlens = InputData<int32_t>(ctx, GqaInput::kQuerySeqlens);
  buf.position_ids = InputData<int64_t>(ctx, GqaInput::kPositionIds);
  if (shape.quantized()) {
    buf.k_scale = InputData<float>(ctx, GqaInput::kKScale);
    buf.v_scale = InputData<float>(ctx, GqaInput::kVScale);
  }
  if (shape.per_token()) {
    buf.past_key_scale = InputData<float>(ctx, GqaInput::kPastKeyScale);
    buf.past_value_scale = InputData<float>(ctx, GqaInput::kPastValueScale);
    buf.present_key_scale = outputs.present_key_scale;
    buf.present_value_scale = outputs.present_value_scale;
  }
  buf.output = outputs.output;
  buf.present_key = outputs.present_key;
  buf.present_value = outputs.present_value;
  return buf;
}

Status AllocateOutputs(Ort::KernelContext& ctx, const GqaShape& s, GqaOutputs* out) {
  const size_t count = ctx.GetOutputCount();
  const std::vector<int64_t> out_shape{s.batch, s.seq_len, s.num_heads * s.head_size};
  out->output = ctx.GetOutput(static_cast<size_t>(GqaOutput::kOutput), out_shape)
                    .GetTensorMutableRawData();
  const std::vector<int64_t> present_shape{s.batch, s.kv_num_heads, s.present_capacity,
                                           s.cache_row};
  for (GqaOutput which : {GqaOutput::kPresentKey, GqaOutput::kPresentValue}) {
    const size_t index = static_cast<size_t>(which);
    void** slot = which == GqaOutput::kPresentKey ? &out->present_key : &out->present_value;
    if (index >= count) continue;
    try {
      Ort::UnownedValue value = ctx.GetOutput(index, present_shape);
      if (value) *slot = value.GetTensorMutableRawData();
    } catch (const Ort::Exception& e) {
      return Status::Error(
          std::string("ai.kvlayout::GroupQueryAttention: cannot provide output '") +
          GqaOutputName(which) + "' of shape (batch, kv_num_heads, max(total_sequence_length, " +
          "past capacity), " + (s.kv_bits == 4 ? "(head_size + 1) / 2" : "head_size") +
          ") = (" + std::to_string(s.batch) + ", " + std::to_string(s.kv_num_heads) + ", " +
          std::to_string(s.present_capacity) + ", " + std::to_string(s.cache_row) +
          ") of type " + DTypeName(s.cache_dtype) + ". When past and present share one buffer, " +
          "total_sequence_length (" + std::to_string(s.total_seq_len) +
          ") must not exceed its capacity. ONNX Runtime said: " + e.what());
    }
  }
  if (!s.per_token()) return Status::Ok();
  const std::vector<int64_t> scale_shape{s.batch, s.kv_num_heads, s.present_capacity};
  for (GqaOutput which : {GqaOutput::kPresentKeyScale, GqaOutput::kPresentValueScale}) {
    const size_t index = static_cast<size_t>(which);
    float** slot =
        which == GqaOutput::kPresentKeyScale ? &out->present_key_scale : &out->present_value_scale;
    const std::string what = std::string("ai.kvlayout::GroupQueryAttention: output '") +
                             GqaOutputName(which) + "' (float32, shape (batch, kv_num_heads, " +
                             "present capacity) = (" + std::to_string(s.batch) + ", " +
                             std::to_string(s.kv_num_heads) + ", " +
                             std::to_string(s.present_capacity) + "))";
    try {
      Ort::UnownedValue value = index < count ? ctx.GetOutput(index, scale_shape)
                                              : Ort::UnownedValue(nullptr);
      if (value) *slot = value.GetTensorMutableData<float>();
    } catch (const Ort::Exception& e) {
      return Status::Error("cannot provide " + what + ". When past and present scale caches " +
                           "share one buffer, total_sequence_length must not exceed its " +
                           "capacity. ONNX Runtime said: " + e.what());
    }
    if (*slot == nullptr) return Status::Error(what + " is required with k_quant_type=PER_TOKEN");
  }
  return Status::Ok();
}

}  // namespace kvl
