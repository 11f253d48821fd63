// The custom-op glue every op of the library shares (GroupQueryAttention, SampleTokens): the
// domain, element types, input descriptions, and statuses that never let an exception cross the
// C API.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>

#include "core/gqa_types.h"
#include "core/status.h"

namespace kvl {

constexpr const char* kDomain = "ai.kvlayout";

// The library's name of an ORT element type (DType::kOther for the types no op takes).
DType FromOrtType(ONNXTensorElementDataType type);

// Shapes, types and presence of a node's first N inputs as the kernel sees them this call (an
// absent optional input, or one past the node's count, stays `exists == false`).
template <size_t N>
std::array<TensorInfo, N> DescribeInputs(Ort::KernelContext& ctx) {
  std::array<TensorInfo, N> infos;
  const size_t count = std::min<size_t>(ctx.GetInputCount(), N);
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

// Converts a kvl::Status into an OrtStatus (nullptr when ok).
OrtStatusPtr ToOrtStatus(const Status& status);

// Runs an op's compute, fn(Ort::KernelContext&) -> Status, so that no exception (the C++ API
// throws Ort::Exception) crosses the C API: every failure becomes an OrtStatus.
template <typename Fn>
OrtStatusPtr GuardedCompute(OrtKernelContext* context, Fn&& fn) {
  try {
    Ort::KernelContext ctx(context);
    return ToOrtStatus(fn(ctx));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

}  // namespace kvl
