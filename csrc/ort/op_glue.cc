#include "ort/op_glue.h"

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

OrtStatusPtr ToOrtStatus(const Status& status) {
  if (status.ok()) return nullptr;
  return Ort::GetApi().CreateStatus(ORT_INVALID_ARGUMENT, status.message().c_str());
}

}  // namespace kvl
