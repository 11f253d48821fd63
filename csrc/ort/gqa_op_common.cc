#include "ort/gqa_op_common.h"

#include <cstdlib>
#include <string>

#include "core/gqa_attributes.h"

namespace kvl {
namespace {

DType FromOrtType(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return DType::kFloat32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DType::kBFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return DType::kInt32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return DType::kInt64;
    default: return DType::kOther;
  }
}

// Reads attributes from an OrtKernelInfo; absent ones keep the contract's defaults.
struct KernelInfoAttrs {
  const OrtApi& api;
  const OrtKernelInfo* info;

  int64_t Int(const char* name, int64_t dflt) const {
    int64_t value = dflt;
    if (OrtStatus* st = api.KernelInfoGetAttribute_int64(info, name, &value)) {
      api.ReleaseStatus(st);
      return dflt;
    }
    return value;
  }
  float Float(const char* name, float dflt) const {
    float value = dflt;
    if (OrtStatus* st = api.KernelInfoGetAttribute_float(info, name, &value)) {
      api.ReleaseStatus(st);
      return dflt;
    }
    return value;
  }
  std::string String(const char* name, const char* dflt) const {
    size_t size = 0;
    if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, nullptr, &size)) {
      api.ReleaseStatus(st);
      return dflt;
    }
    std::string value(size, '\0');
    if (OrtStatus* st = api.KernelInfoGetAttribute_string(info, name, value.data(), &size)) {
      api.ReleaseStatus(st);
      return dflt;
    }
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
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    default:
      // T (float, float16, bfloat16): checked by CheckGqaInputs so the error names the input.
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
}

// Output types follow query; output (B, S, N*H); present (B, Nkv, C', H) where C' depends on
// total_sequence_length's value, so it stays unknown.
OrtStatusPtr InferOutputShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  size_t input_count = 0;
  if (OrtStatus* st = api.ShapeInferContext_GetInputCount(ctx, &input_count)) return st;
  if (input_count == 0) return nullptr;
  OrtTensorTypeAndShapeInfo* query_info = nullptr;
  if (OrtStatus* st = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &query_info)) {
    api.ReleaseStatus(st);
    return nullptr;  // nothing known about query: leave inference to run time
  }
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t rank = 0;
  std::vector<int64_t> qdims;
  auto ok = [&api](OrtStatus* st) {
    if (st == nullptr) return true;
    api.ReleaseStatus(st);
    return false;
  };
  bool known = ok(api.GetTensorElementType(query_info, &type)) &&
               ok(api.GetDimensionsCount(query_info, &rank));
  qdims.resize(rank);
  std::vector<const char*> qsyms(rank, nullptr);
  if (known && rank > 0) {
    known = ok(api.GetDimensions(query_info, qdims.data(), rank)) &&
            ok(api.GetSymbolicDimensions(query_info, qsyms.data(), rank));
  }
  // Infos from ShapeInferContext_GetInputTypeShape are owned by the context: not released here.
  if (!known) return nullptr;

  auto read_int = [&](const char* name, int64_t dflt) {
    const OrtOpAttr* attr = nullptr;
    if (OrtStatus* st = api.ShapeInferContext_GetAttribute(ctx, name, &attr)) {
      api.ReleaseStatus(st);
      return dflt;
    }
    if (attr == nullptr) return dflt;
    int64_t value = dflt;
    size_t out = 0;
    if (OrtStatus* st = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &value, sizeof(value), &out)) {
      api.ReleaseStatus(st);
      return dflt;
    }
    return value;
  };
  const int64_t n = read_int("num_heads", 0), nkv = read_int("kv_num_heads", 0);
  bool packed = true;  // key absent or empty
  if (input_count > 1) {
    OrtTensorTypeAndShapeInfo* key_info = nullptr;
    if (OrtStatus* st = api.ShapeInferContext_GetInputTypeShape(ctx, 1, &key_info)) {
      api.ReleaseStatus(st);
    } else {
      // An empty optional input comes back as an info of UNDEFINED type, not as null.
      ONNXTensorElementDataType key_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      if (key_info != nullptr && !ok(api.GetTensorElementType(key_info, &key_type))) {
        key_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      }
      packed = key_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    }
  }
  int64_t head_size = -1, hidden = -1;
  if (rank == 3 && qdims[2] > 0 && n > 0 && nkv > 0) {
    const int64_t heads = packed ? n + 2 * nkv : n;
    if (qdims[2] % heads == 0) {
      head_size = qdims[2] / heads;
      hidden = n * head_size;
    }
  }
  auto set_output = [&](size_t index, const std::vector<int64_t>& dims,
                        const std::vector<const char*>& syms) -> OrtStatusPtr {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if (OrtStatus* st = api.CreateTensorTypeAndShapeInfo(&info)) return st;
    OrtStatus* st = api.SetTensorElementType(info, type);
    if (!st && !dims.empty()) st = api.SetDimensions(info, dims.data(), dims.size());
    if (!st && !syms.empty()) st = api.SetSymbolicDimensions(info, const_cast<const char**>(syms.data()), syms.size());
    if (!st) st = api.ShapeInferContext_SetOutputTypeShape(ctx, index, info);
    api.ReleaseTensorTypeAndShapeInfo(info);
    return st;
  };
  if (rank != 3) {
    return set_output(0, {}, {});
  }
  const char* empty = "";
  if (OrtStatus* st = set_output(0, {qdims[0], qdims[1], hidden},
                                 {qsyms[0] ? qsyms[0] : empty, qsyms[1] ? qsyms[1] : empty, empty})) {
    return st;
  }
  for (size_t index : {1, 2}) {
    if (OrtStatus* st = set_output(index, {qdims[0], nkv > 0 ? nkv : -1, -1, head_size},
                                   {qsyms[0] ? qsyms[0] : empty, empty, empty, empty})) {
      // present outputs may be absent from the node: ignore that case.
      api.ReleaseStatus(st);
    }
  }
  return nullptr;
}

size_t GetMayInplace(int** input_index, int** output_index) {
  // past_key -> present_key, past_value -> present_value. ORT frees these with ReleaseMayInplace.
  *input_index = static_cast<int*>(std::malloc(2 * sizeof(int)));
  *output_index = static_cast<int*>(std::malloc(2 * sizeof(int)));
  (*input_index)[0] = static_cast<int>(GqaInput::kPastKey);
  (*input_index)[1] = static_cast<int>(GqaInput::kPastValue);
  (*output_index)[0] = static_cast<int>(GqaOutput::kPresentKey);
  (*output_index)[1] = static_cast<int>(GqaOutput::kPresentValue);
  return 2;
}

void ReleaseMayInplace(int* input_index, int* output_index) {
  std::free(input_index);
  std::free(output_index);
}

}  // namespace

GqaAttributes ReadGqaAttributes(const OrtApi& api, const OrtKernelInfo* info) {
  GqaAttributes a = ParseGqaAttributes(KernelInfoAttrs{api, info});
  size_t outputs = 0;
  if (OrtStatus* st = api.KernelInfo_GetOutputCount(info, &outputs)) {
    api.ReleaseStatus(st);
  } else if (outputs > static_cast<size_t>(GqaOutput::kOutputQk)) {
    size_t size = 0;
    const size_t index = static_cast<size_t>(GqaOutput::kOutputQk);
    if (OrtStatus* st = api.KernelInfo_GetOutputName(info, index, nullptr, &size)) {
      api.ReleaseStatus(st);
    } else {
      a.output_qk_requested = size > 1;  // size counts the terminating NUL
    }
  }
  return a;
}

GqaInputInfos DescribeInputs(Ort::KernelContext& ctx) {
  GqaInputInfos infos;
  const size_t count = std::min<size_t>(ctx.GetInputCount(), kGqaInputCount);
  for (size_t i = 0; i < count; ++i) {
    Ort::ConstValue value = ctx.GetInput(i);
    if (!value) continue;
    auto type_shape = value.GetTensorTypeAndShapeInfo();
    infos[i].exists = true;
    infos[i].dtype = FromOrtType(type_shape.GetElementType());
    infos[i].shape = type_shape.GetShape();
  }
  return infos;
}

Status ReadAndCheckInputs(Ort::KernelContext& ctx, const GqaAttributes& attrs, GqaShape* shape) {
  const GqaInputInfos inputs = DescribeInputs(ctx);
  const int32_t* total = InputData<int32_t>(ctx, GqaInput::kTotalSequenceLength);
  const bool one = inputs[static_cast<int>(GqaInput::kTotalSequenceLength)].NumElements() == 1;
  // A malformed total_sequence_length reaches CheckGqaInputs, which names it.
  return CheckGqaInputs(attrs, inputs, one && total != nullptr ? *total : 0, shape);
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
                                           s.head_size};
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
          "past capacity), head_size) = (" + std::to_string(s.batch) + ", " +
          std::to_string(s.kv_num_heads) + ", " + std::to_string(s.present_capacity) + ", " +
          std::to_string(s.head_size) + "). When past and present share one buffer, " +
          "total_sequence_length (" + std::to_string(s.total_seq_len) +
          ") must not exceed its capacity. ONNX Runtime said: " + e.what());
    }
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
