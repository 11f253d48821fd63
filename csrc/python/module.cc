// ort_kvlayout._C: build facts and a direct call of the CPU kernel (tests, benchmarks), through
// the same validation as the ORT op.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/check_inputs.h"
#include "core/gqa_attributes.h"
#include "cpu/cpu_isa.h"
#include "cpu/gqa_cpu.h"
#include "cpu/thread_pool.h"
#include "python/bind_knobs.h"
#include "python/bind_plan.h"
#if defined(KVL_WITH_CUDA)
#include "kv/cuda_vmm.h"
#endif

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
  // CPU kernel levels: built, the best this CPU supports, the one in use (None when
  // ORT_KVLAYOUT_CPU_ISA was refused; cpu_isa_error then says why).
  py::list built;
  for (kvl::CpuIsa isa : kvl::BuiltCpuIsas()) built.append(kvl::CpuIsaName(isa));
  info["cpu_isas"] = built;
  info["cpu_isa_best"] = kvl::CpuIsaName(kvl::BestSupportedCpuIsa());
  const kvl::CpuIsaChoice& choice = kvl::ChosenCpuIsa();
  info["cpu_isa"] = choice.error.empty() ? py::object(py::str(kvl::CpuIsaName(choice.isa)))
                                         : py::object(py::none());
  info["cpu_isa_error"] = choice.error;
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
  // An absent input is null: a default py::array is an empty array, not a null handle, and its
  // data pointer would pass for an input (position_ids, attention_bias, norm weights...).
  auto raw = [&](kvl::GqaInput which) -> const void* {
    const int i = static_cast<int>(which);
    return infos[i].exists ? arrays[i].data() : nullptr;
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

#if defined(KVL_WITH_CUDA)
// Python face of kvl::vmm (used by ort_kvlayout.kv_memory.DeviceReservation). A failed CUDA
// call raises _C.CudaError whose message names the call and the CUDA error.
class PyVmmReservation {
 public:
  PyVmmReservation(int device, size_t size) {
    Check(kvl::vmm::Reservation::Create(device, size, &r_));
  }
  uint64_t ptr() const { return r_->ptr(); }
  size_t size() const { return r_->size(); }
  size_t granularity() const { return r_->granularity(); }
  size_t mapped_bytes() const { return r_->mapped_bytes(); }
  bool closed() const { return r_->closed(); }
  size_t Map(size_t offset, size_t size) {
    size_t added = 0;
    kvl::Status st;
    {
      py::gil_scoped_release release;
      st = r_->Map(offset, size, &added);
    }
    Check(st);
    return added;
  }
  void Unmap(size_t offset, size_t size) { Check(r_->Unmap(offset, size)); }
  py::bytes CopyToHost(size_t offset, size_t bytes) const {
    std::string out(bytes, '\0');
    Check(r_->CopyToHost(offset, out.data(), bytes));
    return py::bytes(out);
  }
  void CopyFromHost(size_t offset, const py::bytes& data) {
    const std::string in = data;
    Check(r_->CopyFromHost(offset, in.data(), in.size()));
  }
  void Close() { Check(r_->Close()); }

  static void Check(const kvl::Status& st) {
    if (!st.ok()) throw CudaError(st.message());
  }
  struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
  };

 private:
  std::unique_ptr<kvl::vmm::Reservation> r_;
};

void BindCudaVmm(py::module_& m) {
  py::register_exception<PyVmmReservation::CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::class_<PyVmmReservation>(m, "VmmReservation",
                               "A CUDA virtual address range with physical granules mapped on "
                               "demand (cuMemAddressReserve / cuMemCreate / cuMemMap)")
      .def(py::init<int, size_t>(), py::arg("device"), py::arg("size"))
      .def_property_readonly("ptr", &PyVmmReservation::ptr)
      .def_property_readonly("size", &PyVmmReservation::size)
      .def_property_readonly("granularity", &PyVmmReservation::granularity)
      .def_property_readonly("mapped_bytes", &PyVmmReservation::mapped_bytes)
      .def_property_readonly("closed", &PyVmmReservation::closed)
      .def("map", &PyVmmReservation::Map, py::arg("offset"), py::arg("size"),
           "Maps the unmapped granules of [offset, offset+size); returns the bytes added")
      .def("unmap", &PyVmmReservation::Unmap, py::arg("offset"), py::arg("size"))
      .def("copy_to_host", &PyVmmReservation::CopyToHost, py::arg("offset"), py::arg("size"))
      .def("copy_from_host", &PyVmmReservation::CopyFromHost, py::arg("offset"), py::arg("data"))
      .def("close", &PyVmmReservation::Close);
  m.def("vmm_stats", [] {
    const kvl::vmm::Stats s = kvl::vmm::GetStats();
    py::dict d;
    d["reservations"] = s.reservations;
    d["reserved_bytes"] = s.reserved_bytes;
    d["committed_bytes"] = s.mapped_bytes;
    d["handles"] = s.handles;
    return d;
  });
  m.def(
      "vmm_driver_times",
      [] {
        py::dict d;
        for (int i = 0; i < static_cast<int>(kvl::vmm::DriverCall::kCount); ++i) {
          const auto call = static_cast<kvl::vmm::DriverCall>(i);
          const kvl::vmm::DriverTime t = kvl::vmm::GetDriverTime(call);
          py::dict entry;
          entry["calls"] = t.calls;
          entry["ns"] = t.ns;
          d[kvl::vmm::DriverCallName(call)] = entry;
        }
        return d;
      },
      "Cumulative calls and wall ns of the driver's memory calls (cuMemCreate, cuMemMap, "
      "cuMemSetAccess, cuMemUnmap, cuMemRelease, cuCtxSynchronize) since the process began");
  m.def("vmm_fail_after", &kvl::vmm::FailCreateAfter, py::arg("after"),
        "Test hook: the (after+1)-th next cuMemCreate fails (CUDA_ERROR_OUT_OF_MEMORY); "
        "after < 0 disarms it");
  m.def(
      "cuda_copy",
      [](uint64_t dst, uint64_t src, size_t bytes, int device) {
        PyVmmReservation::Check(kvl::vmm::CopyDeviceToDevice(device, dst, src, bytes));
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("device"),
      "Synchronous device-to-device copy on `device` (its primary context made current)");
}
#endif  // KVL_WITH_CUDA

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ort-kvlayout native module: build info and direct kernel entry points";
  m.def(
      "gqa_attribute_types",
      [] {
        py::dict types;  // in the table's order
        for (const kvl::GqaAttributeSpec& spec : kvl::kGqaAttributeTable) {
          types[spec.name] = kvl::AttrTypeName(spec.type);
        }
        return types;
      },
      "The op's attribute table (core/gqa_attributes.h): {name: 'INT' | 'FLOAT' | 'STRING'}");
  m.def("build_info", &BuildInfo,
        "Version, ORT header API version, CUDA build facts, CPU kernel levels");
  m.def("gqa_cpu", &GqaCpu, py::arg("inputs"), py::arg("attrs"), py::arg("shared") = false,
        py::arg("threads") = 0,
        "Runs the CPU GroupQueryAttention on numpy arrays (names as in the ONNX schema); "
        "returns (output, present_key, present_value).");
  kvl::BindKnobs(m);
  kvl::BindPlan(m);
#if defined(KVL_WITH_CUDA)
  BindCudaVmm(m);
#endif
}
