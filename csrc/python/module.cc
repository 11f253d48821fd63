// ort_kvlayout._C: build facts and a direct call of the CPU kernel (tests, benchmarks), through
// the same validation as the ORT op.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <string>

#include "core/check_inputs.h"
#include "core/gqa_attributes.h"
#include "cpu/gqa_cpu.h"
#include "cpu/thread_pool.h"

namespace py = pybind11;

namespace {

kvl::DType DTypeOf(const py::array& a) {
  const std::string name = py::str(a.dtype().attr("name"));
  if (name == "float32") return kvl::DType::kFloat32;
  if (name == "float16") return kvl::DType::kFloat16;
  if (name == "bfloat16") return kvl::DType::kBFloat16;
  if (name == "int32") return kvl::DType::kInt32;
  if (name == "int64") return kvl::DType::kInt64;
  return kvl::DType::kOther;
}

// Attributes from a dict (the Source of ParseGqaAttributes), typed as onnx.helper.make_attribute
// would type them: an integer (or bool) is INT, a float FLOAT, a str STRING.
struct DictAttrs {
  const py::dict& d;
  static bool IsInt(const py::handle& v) {  // int, bool, numpy integers
    return py::isinstance<py::int_>(v) || py::hasattr(v, "__index__");
  }
  kvl::AttrType Type(const char* key) const {
    if (!d.contains(key)) return kvl::AttrType::kAbsent;
    const py::object v = d[key];
    if (py::isinstance<py::str>(v)) return kvl::AttrType::kString;
    if (IsInt(v)) return kvl::AttrType::kInt;
    if (py::isinstance<py::float_>(v) || py::hasattr(v, "__float__")) return kvl::AttrType::kFloat;
    return kvl::AttrType::kOther;
  }
  int64_t Int(const char* key) const { return d[key].cast<int64_t>(); }
  float Float(const char* key) const { return d[key].cast<float>(); }
  std::string String(const char* key) const { return d[key].cast<std::string>(); }
};

py::dict BuildInfo() {
  py::dict info;
  info["version"] = KVL_VERSION;
  info["ort_header_version"] = KVL_ORT_HEADER_VERSION;
  info["ort_api_version"] = KVL_ORT_API_VERSION;
#if defined(KVL_WITH_CUDA)
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_archs"] = KVL_CUDA_ARCHS;
  return info;
}

// inputs: name -> array (absent or None = not given), names as in the ONNX schema.
// shared=True appends into past_key/past_value in place (they are then the presents).
py::tuple GqaCpu(const py::dict& inputs, const py::dict& attrs_dict, bool shared, int threads) {
  kvl::GqaAttributes attrs;
  kvl::Status st = kvl::ParseGqaAttributes(DictAttrs{attrs_dict}, &attrs);
  if (!st.ok()) throw py::value_error(st.message());

  std::array<py::array, kvl::kGqaInputCount> arrays;
  kvl::GqaInputInfos infos;
  for (int i = 0; i < kvl::kGqaInputCount; ++i) {
    const char* name = kvl::GqaInputName(static_cast<kvl::GqaInput>(i));
    if (!inputs.contains(name) || inputs[name].is_none()) continue;
    py::array a = py::array::ensure(inputs[name], py::array::c_style);
    if (!a) throw py::type_error(std::string("input '") + name + "' must be a numpy array");
    if (shared && (i == static_cast<int>(kvl::GqaInput::kPastKey) ||
                   i == static_cast<int>(kvl::GqaInput::kPastValue))) {
      py::array given = inputs[name].cast<py::array>();
      if (!given.writeable() || given.ptr() != a.ptr()) {
        throw py::value_error(std::string("shared=True needs '") + name +
                              "' to be a writable C-contiguous array");
      }
    }
    arrays[i] = a;
    infos[i].exists = true;
    infos[i].dtype = DTypeOf(a);
    infos[i].shape.assign(a.shape(), a.shape() + a.ndim());
  }
  auto raw = [&](kvl::GqaInput which) -> const void* {
    const py::array& a = arrays[static_cast<int>(which)];
    return a ? a.data() : nullptr;
  };
  const auto& total_info = infos[static_cast<int>(kvl::GqaInput::kTotalSequenceLength)];
  const int32_t total = total_info.exists && total_info.dtype == kvl::DType::kInt32 &&
                                total_info.NumElements() == 1
                            ? *static_cast<const int32_t*>(raw(kvl::GqaInput::kTotalSequenceLength))
                            : 0;
  kvl::GqaShape shape;
  st = kvl::CheckGqaInputs(attrs, infos, total, &shape);
  if (!st.ok()) throw py::value_error(st.message());
  if (shared && !shape.has_past) throw py::value_error("shared=True needs past_key/past_value");

  const py::array& query = arrays[static_cast<int>(kvl::GqaInput::kQuery)];
  py::array output(query.dtype(), std::vector<int64_t>{shape.batch, shape.seq_len,
                                                       shape.num_heads * shape.head_size});
  const std::vector<int64_t> present_shape{shape.batch, shape.kv_num_heads,
                                           shape.present_capacity, shape.head_size};
  py::array present_k = shared ? arrays[static_cast<int>(kvl::GqaInput::kPastKey)]
                               : py::array(query.dtype(), present_shape);
  py::array present_v = shared ? arrays[static_cast<int>(kvl::GqaInput::kPastValue)]
                               : py::array(query.dtype(), present_shape);
  kvl::GqaCpuBuffers buf;
  buf.query = raw(kvl::GqaInput::kQuery);
  buf.key = raw(kvl::GqaInput::kKey);
  buf.value = raw(kvl::GqaInput::kValue);
  buf.past_key = raw(kvl::GqaInput::kPastKey);
  buf.past_value = raw(kvl::GqaInput::kPastValue);
  buf.seqlens_k = static_cast<const int32_t*>(raw(kvl::GqaInput::kSeqlensK));
  buf.cos_cache = shape.rotary_dim ? raw(kvl::GqaInput::kCosCache) : nullptr;
  buf.sin_cache = shape.rotary_dim ? raw(kvl::GqaInput::kSinCache) : nullptr;
  buf.position_ids = static_cast<const int64_t*>(raw(kvl::GqaInput::kPositionIds));
  buf.query_seqlens = static_cast<const int32_t*>(raw(kvl::GqaInput::kQuerySeqlens));
  buf.attention_bias = raw(kvl::GqaInput::kAttentionBias);
  buf.head_sink = raw(kvl::GqaInput::kHeadSink);
  buf.q_norm_weight = raw(kvl::GqaInput::kQNormWeight);
  buf.k_norm_weight = raw(kvl::GqaInput::kKNormWeight);
  buf.output = output.mutable_data();
  buf.present_key = present_k.mutable_data();
  buf.present_value = present_v.mutable_data();
  st = kvl::CheckLengthsOnHost(shape, buf.seqlens_k, buf.query_seqlens, buf.position_ids, shared);
  if (!st.ok()) throw py::value_error(st.message());
  {
    py::gil_scoped_release release;
    st = kvl::RunGqaCpu(shape, buf, kvl::StdThreadParallel(threads));
  }
  if (!st.ok()) throw py::value_error(st.message());
  return py::make_tuple(output, present_k, present_v);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ort-kvlayout native module: build info and direct kernel entry points";
  m.def("build_info", &BuildInfo, "Version, ORT header API version, CUDA build facts");
  m.def("gqa_cpu", &GqaCpu, py::arg("inputs"), py::arg("attrs"), py::arg("shared") = false,
        py::arg("threads") = 0,
        "Runs the CPU GroupQueryAttention on numpy arrays (names as in the ONNX schema); "
        "returns (output, present_key, present_value).");
}
