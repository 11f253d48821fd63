#include "ort/gqa_op_common.h"

#include <cstdlib>
#include <utility>
#include <string>

#include "core/gqa_attributes.h"
#include "ort/shape_infer.h"

namespace kvl {

DType FromOrtType(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DType::kFloat32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DType::kBFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return DType::kInt32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return DType::kInt64;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return DType::kInt8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return DType::kUInt8;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN: return DType::kFloat8E4M3;
    default: return DType::kOther;
  }
}

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

ONNXTensorElementDataType InputType(size_t index) {
  switch (static_cast<GqaInput>(index)) {
    case GqaInput::kSeqlensK:
    case GqaInput::kTotalSequenceLength:
    case GqaInput::kQuerySeqlens:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case GqaInput::kPositionIds:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    case GqaInput::kKScale:
    case GqaInput::kVScale:
    case GqaInput::kPastKeyScale:
    case GqaInput::kPastValueScale:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    default:
      // T (float, float16, bfloat16): checked by CheckGqaInputs so the error names the input.
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
}

int64_t ReadIntAttr(const OrtApi& api, OrtShapeInferContext* ctx, const char* name, int64_t dflt) {
  const OrtOpAttr* attr = nullptr;
  if (OrtStatus* st = api.ShapeInferContext_GetAttribute(ctx, name, &attr)) {
    api.ReleaseStatus(st);
    return dflt;
  }
  int64_t value = dflt;
  size_t out = 0;
  if (attr == nullptr) return dflt;
  if (OrtStatus* st = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &value, sizeof(value), &out)) {
    api.ReleaseStatus(st);
    return dflt;  // absent or not an INT: kernel creation reports the type
  }
  return value;
}

// A quantized cache's element type from kv_cache_bit_width (int8 codes, or int4 pairs in uint8);
// UNDEFINED for an unquantized node (0) or a width kernel creation refuses.
ONNXTensorElementDataType QuantCacheType(int64_t bits) {
  if (bits == 8) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  if (bits == 4) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

// Output types follow query, present types past (without past: query, or the quantized cache's
// type that kv_cache_bit_width names). output: (B, S, N*H); present: (B, Nkv, C', H) with
// C' = max(total_sequence_length, past capacity), or the past capacity with a sliding window
// cache; H is (H + 1) / 2 bytes for an int4 cache. Every dimension is a value or a name (see
// Dim); unknown ones get names in our own namespace ("ai.kvlayout:..."), so they neither fix a
// size nor alias a model's own symbols. A dimension the model declares (a graph output's shape)
// keeps the model's name.
OrtStatusPtr InferOutputShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  const InputDims query = ReadInputDims(api, ctx, static_cast<size_t>(GqaInput::kQuery));
  if (query.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED) return nullptr;  // left to run time
  const InputDims key = ReadInputDims(api, ctx, static_cast<size_t>(GqaInput::kKey));
  const InputDims past = ReadInputDims(api, ctx, static_cast<size_t>(GqaInput::kPastKey));
  const int64_t n = ReadIntAttr(api, ctx, "num_heads", 0);
  const int64_t nkv = ReadIntAttr(api, ctx, "kv_num_heads", 0);
  const bool sliding = ReadIntAttr(api, ctx, "sliding_window_cache", 0) == 1;
  const int64_t bits = ReadIntAttr(api, ctx, "kv_cache_bit_width", 0);
  const std::string ns = std::string(kDomain) + ":";

  // A query of another rank fails at run time; every valid run has rank 3.
  const bool rank3 = query.dims.size() == 3;
  Dim head_size{-1, ns + "head_size"};
  Dim hidden{-1, ns + "num_heads*head_size"};
  if (rank3 && query.dims[2].value > 0 && n > 0 && nkv > 0) {
    const int64_t heads = key.exists ? n : n + 2 * nkv;
    if (query.dims[2].value % heads == 0) {
      head_size.value = query.dims[2].value / heads;
      hidden.value = n * head_size.value;
    }
  } else if (rank3 && key.exists) {
    hidden = KnownOr(query.dims[2], hidden.name);  // separate Q/K/V: output has query's width
  }
  const Dim batch = rank3 ? DimAt(query, 0, ns + "batch_size") : Dim{-1, ns + "batch_size"};
  const Dim seq = rank3 ? DimAt(query, 1, ns + "sequence_length") : Dim{-1, ns + "sequence_length"};
  if (OrtStatus* st = SetOutput(api, ctx, 0, query.type, {batch, seq, hidden})) return st;

  Dim capacity;
  if (past.exists && past.dims.size() == 4) {
    capacity = DimAt(past, 2, ns + "past_capacity");
    if (!sliding) capacity = Dim{-1, ns + "max(total_sequence_length," + DimText(capacity) + ")"};
  } else {
    capacity = Dim{-1, ns + "total_sequence_length"};
  }
  const Dim kv_heads = nkv > 0 ? Dim{nkv, ""} : Dim{-1, ns + "kv_num_heads"};
  ONNXTensorElementDataType cache_type = query.type;
  if (past.exists) {
    cache_type = past.type;
  } else if (QuantCacheType(bits) != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED) {
    cache_type = QuantCacheType(bits);
  }
  Dim row = head_size;  // stored elements per cache row
  if (bits == 4 && cache_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
    row = head_size.value > 0 ? Dim{KvRowElements(head_size.value, 4), ""}
                              : Dim{-1, ns + "(head_size+1)/2"};
  }
  for (GqaOutput which : {GqaOutput::kPresentKey, GqaOutput::kPresentValue}) {
    const std::vector<Dim> dims{batch, kv_heads, capacity, row};
    if (OrtStatus* st = SetOutput(api, ctx, static_cast<size_t>(which), cache_type, dims)) {
      api.ReleaseStatus(st);  // the node does not produce this output
    }
  }
  // PER_TOKEN scale caches: float32 (B, Nkv, C'), when the node names them.
  for (GqaOutput which : {GqaOutput::kPresentKeyScale, GqaOutput::kPresentValueScale}) {
    const std::vector<Dim> dims{batch, kv_heads, capacity};
    if (OrtStatus* st = SetOutput(api, ctx, static_cast<size_t>(which),
                                  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, dims)) {
      api.ReleaseStatus(st);
    }
  }
  return nullptr;
}

size_t GetMayInplace(int** input_index, int** output_index) {
  // past_key -> present_key, past_value -> present_value, and the PER_TOKEN scale caches alike.
  // ORT frees these with ReleaseMayInplace.
  constexpr std::pair<GqaInput, GqaOutput> kPairs[] = {
      {GqaInput::kPastKey, GqaOutput::kPresentKey},
      {GqaInput::kPastValue, GqaOutput::kPresentValue},
      {GqaInput::kPastKeyScale, GqaOutput::kPresentKeyScale},
      {GqaInput::kPastValueScale, GqaOutput::kPresentValueScale}};
  constexpr size_t n = sizeof(kPairs) / sizeof(kPairs[0]);
  *input_index = static_cast<int*>(std::malloc(n * sizeof(int)));
  *output_index = static_cast<int*>(std::malloc(n * sizeof(int)));
  for (size_t i = 0; i < n; ++i) {
    (*input_index)[i] = static_cast<int>(kPairs[i].first);
    (*output_index)[i] = static_cast<int>(kPairs[i].second);
  }
  return n;
}

void ReleaseMayInplace(int* input_index, int* output_index) {
  std::free(input_index);
  std::free(output_index);
}

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
  GqaBuffers buf;
  buf.query = InputData<void>(ctx, GqaInput::kQuery);
  buf.key = InputData<void>(ctx, GqaInput::kKey);
  buf.value = InputData<void>(ctx, GqaInput::kValue);
  buf.past_key = InputData<void>(ctx, GqaInput::kPastKey);
  buf.past_value = InputData<void>(ctx, GqaInput::kPastValue);
  buf.seqlens_k = InputData<int32_t>(ctx, GqaInput::kSeqlensK);
  buf.query_seqlens = InputData<int32_t>(ctx, GqaInput::kQuerySeqlens);
  if (shape.rotary_dim > 0) {
    buf.cos_cache = InputData<void>(ctx, GqaInput::kCosCache);
    buf.sin_cache = InputData<void>(ctx, GqaInput::kSinCache);
  }
  buf.position_ids = InputData<int64_t>(ctx, GqaInput::kPositionIds);
  buf.attention_bias = InputData<void>(ctx, GqaInput::kAttentionBias);
  buf.head_sink = InputData<void>(ctx, GqaInput::kHeadSink);
  buf.q_norm_weight = InputData<void>(ctx, GqaInput::kQNormWeight);
  buf.k_norm_weight = InputData<void>(ctx, GqaInput::kKNormWeight);
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

OrtStatusPtr ToOrtStatus(const Status& status) {
  if (status.ok()) return nullptr;
  return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, status.message().c_str());
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

void SetCommonSchema(OrtCustomOp* op) {
  op->GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return kGqaInputCount; };
  op->GetInputType = [](const OrtCustomOp*, size_t index) { return InputType(index); };
  op->GetInputCharacteristic = [](const OrtCustomOp*, size_t index) {
    const auto which = static_cast<GqaInput>(index);
    const bool required = which == GqaInput::kQuery || which == GqaInput::kSeqlensK ||
                          which == GqaInput::kTotalSequenceLength;
    return required ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  };
  op->GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return kGqaOutputCount; };
  op->GetOutputType = [](const OrtCustomOp*, size_t) {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // the type of query, set by shape inference
  };
  op->GetOutputCharacteristic = [](const OrtCustomOp*, size_t index) {
    return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  };
  // total_sequence_length is read on the host by both ops (it sizes present).
  op->GetInputMemoryType = [](const OrtCustomOp*, size_t index) {
    return static_cast<GqaInput>(index) == GqaInput::kTotalSequenceLength ? OrtMemTypeCPUInput
                                                                          : OrtMemTypeDefault;
  };
  op->InferOutputShapeFn = InferOutputShape;
  op->GetMayInplace = GetMayInplace;
  op->ReleaseMayInplace = ReleaseMayInplace;
}

}  // namespace kvl
