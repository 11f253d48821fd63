#include "ort/shape_infer.h"

namespace kvl {

InputDims ReadInputDims(const OrtApi& api, OrtShapeInferContext* ctx, size_t index) {
  InputDims out;
  size_t count = 0;
  if (OrtStatus* st = api.ShapeInferContext_GetInputCount(ctx, &count)) {
    api.ReleaseStatus(st);
    return out;
  }
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  if (index >= count) return out;
  if (OrtStatus* st = api.ShapeInferContext_GetInputTypeShape(ctx, index, &info)) {
    api.ReleaseStatus(st);
    return out;
  }
  auto ok = [&api](OrtStatus* st) {
    if (st == nullptr) return true;
    api.ReleaseStatus(st);
    return false;
  };
  size_t rank = 0;
  if (info == nullptr || !ok(api.GetTensorElementType(info, &out.type)) ||
      !ok(api.GetDimensionsCount(info, &rank))) {
    return out;
  }
  out.exists = out.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> values(rank);
  std::vector<const char*> names(rank, nullptr);
  if (rank > 0 && (!ok(api.GetDimensions(info, values.data(), rank)) ||
                   !ok(api.GetSymbolicDimensions(info, names.data(), rank)))) {
    return out;
  }
  for (size_t i = 0; i < rank; ++i) {
    out.dims.push_back(Dim{values[i], names[i] != nullptr ? names[i] : ""});
  }
  return out;
}

Dim KnownOr(const Dim& d, const std::string& fallback) {
  if (d.value >= 0 || !d.name.empty()) return d;
  return Dim{-1, fallback};
}

Dim DimAt(const InputDims& in, size_t i, const std::string& fallback) {
  return i < in.dims.size() ? KnownOr(in.dims[i], fallback) : Dim{-1, fallback};
}

std::string DimText(const Dim& d) { return d.value >= 0 ? std::to_string(d.value) : d.name; }

OrtStatusPtr SetOutput(const OrtApi& api, OrtShapeInferContext* ctx, size_t index,
                       ONNXTensorElementDataType type, const std::vector<Dim>& dims) {
  std::vector<int64_t> values;
  std::vector<const char*> names;
  for (const Dim& d : dims) {
    values.push_back(d.value >= 0 ? d.value : -1);
    names.push_back(d.value >= 0 ? "" : d.name.c_str());
  }
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* st = api.CreateTensorTypeAndShapeInfo(&info)) return st;
  OrtStatus* st = api.SetTensorElementType(info, type);
  if (!st) st = api.SetDimensions(info, values.data(), values.size());
  if (!st) st = api.SetSymbolicDimensions(info, names.data(), names.size());
  if (!st) st = api.ShapeInferContext_SetOutputTypeShape(ctx, index, info);
  api.ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

}  // namespace kvl
