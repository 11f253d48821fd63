// Shape inference helpers of the custom ops (InferOutputShapeFn): reading an input's dimensions
// and declaring an output's, through the C API only, so that no exception can cross it.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvl {

// One inferred dimension: a value (>= 0) or a symbolic name. ORT turns a dimension without a
// name into dim_value = its integer, so an unknown dimension must carry a name: -1 without one
// becomes a fixed "-1" that never matches the run's shape, and ORT then logs a VerifyOutputSizes
// warning for every output of every node on every Run.
struct Dim {
  int64_t value = -1;
  std::string name;
};

// Dimensions of one input as the context knows them (empty: no input, no shape or a scalar;
// ORT gives an input of unknown rank rank 0).
struct InputDims {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<Dim> dims;
  bool exists = false;  // an empty optional input comes back as an info of UNDEFINED type
};

InputDims ReadInputDims(const OrtApi& api, OrtShapeInferContext* ctx, size_t index);

// `d` when it is known (a value or a name), else a dimension named `fallback`.
Dim KnownOr(const Dim& d, const std::string& fallback);

Dim DimAt(const InputDims& in, size_t i, const std::string& fallback);

std::string DimText(const Dim& d);

// Declares output `index` as `type` of shape `dims`.
OrtStatusPtr SetOutput(const OrtApi& api, OrtShapeInferContext* ctx, size_t index,
                       ONNXTensorElementDataType type, const std::vector<Dim>& dims);

}  // namespace kvl
