#include "ort/gqa_schema.h"

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/gqa_types.h"
#include "ort/op_glue.h"
#include "ort/shape_infer.h"

namespace kvl {
namespace {

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

void SetGqaSchema(OrtCustomOp* op) {
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
