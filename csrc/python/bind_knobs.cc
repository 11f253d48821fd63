#include "python/bind_knobs.h"

#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "core/knobs.h"

namespace py = pybind11;

namespace kvl {
namespace {

const char* ClassName(KnobClass c) {
  switch (c) {
    case KnobClass::kProduct: return "product";
    case KnobClass::kDiagnostic: return "diagnostic";
    case KnobClass::kTuning: return "tuning-unstable";
  }
  return "?";
}

const char* ReadName(KnobRead r) {
  switch (r) {
    case KnobRead::kCpuOnce: return "CPU op, once per process";
    case KnobRead::kCudaOnce: return "CUDA op, once per process";
    case KnobRead::kCudaOpCreation: return "CUDA op, when one is created";
  }
  return "?";
}

// The parsed value of the knob `name` (a KnobValues field), as Python sees it.
py::object ValueOf(const KnobValues& k, const char* name) {
  const std::string n = name;
  if (n == "ORT_KVLAYOUT_CPU_ISA") return py::str(k.cpu_isa.empty() ? "auto" : k.cpu_isa);
  if (n == "ORT_KVLAYOUT_CUDNN") return py::bool_(k.cudnn);
  if (n == "ORT_KVLAYOUT_CUDNN_LIBRARY") return py::str(k.cudnn_library);
  if (n == "ORT_KVLAYOUT_STRICT_LENGTHS") return py::bool_(k.strict_lengths);
  if (n == "ORT_KVLAYOUT_CUDNN_VERBOSE") return py::bool_(k.cudnn_verbose);
  if (n == "ORT_KVLAYOUT_CUDNN_MIN_ROWS") return py::int_(k.cudnn_min_rows);
  if (n == "ORT_KVLAYOUT_DECODE_SPLITS") return py::int_(k.decode_splits);
  if (n == "ORT_KVLAYOUT_DECODE_CLUSTERS") return py::bool_(k.decode_clusters);
  if (n == "ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS") return py::bool_(k.decode_group_clusters);
  if (n == "ORT_KVLAYOUT_DECODE_WIDE") return py::bool_(k.decode_wide);
  if (n == "ORT_KVLAYOUT_DECODE_PACKED") return py::int_(k.decode_packed);
  if (n == "ORT_KVLAYOUT_DECODE_QUANT_PLAN") {
    return py::str(k.decode_quant_bytes ? "bytes" : "fp16");
  }
  throw std::logic_error(n + " has no value in bind_knobs.cc");  // tests/op/test_knobs.py
}

}  // namespace

void BindKnobs(py::module_& m) {
  m.def(
      "knobs",
      [] {
        py::list out;
        for (const KnobSpec& s : kKnobSpecs) {
          py::dict d;
          d["name"] = s.name;
          d["default"] = s.default_value;
          d["class"] = ClassName(s.cls);
          d["read"] = ReadName(s.read);
          d["values"] = s.values;
          d["doc"] = s.doc;
          out.append(d);
        }
        return out;
      },
      "The environment knob registry (csrc/core/knobs.h): one dict per knob with name, "
      "default, class, read (who reads it, when), values and doc");
  m.def(
      "knob_values",
      [](bool now) {
        const KnobValues k = now ? ReadKnobs() : Knobs();
        py::dict d;
        for (const KnobSpec& s : kKnobSpecs) d[s.name] = ValueOf(k, s.name);
        std::string all;  // every bad knob, those read at op creation too
        for (const std::string& e : k.errors) {
          if (!e.empty()) all += (all.empty() ? "" : "; ") + e;
        }
        d["error"] = all;
        return d;
      },
      py::arg("now") = false,
      "The knobs as parsed (once per process, or the environment now with now=True): "
      "{name: value, 'error': every bad knob, '' when none}");
}

}  // namespace kvl
