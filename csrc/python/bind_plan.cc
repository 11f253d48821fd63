// ort_kvlayout._C.plan_gqa_cuda(): see bind_plan.h.
#include "python/bind_plan.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/check_inputs.h"
#include "core/gqa_types.h"
#include "cuda/plan_model.h"

namespace py = pybind11;

namespace kvl {

void BindPlan(py::module_& m) {
  m.def(
      "plan_gqa_cuda",
      [](const py::dict& shape, const py::dict& device, const py::dict& knobs) {
        kvl::GqaShape s;
        s.batch = shape["batch"].cast<int64_t>();
        s.seq_len = shape["seq_len"].cast<int64_t>();
        s.num_heads = shape["num_heads"].cast<int64_t>();
        s.kv_num_heads = shape["kv_num_heads"].cast<int64_t>();
        s.head_size = shape["head_size"].cast<int64_t>();
        s.layout = static_cast<kvl::KvLayout>(shape["kv_layout"].cast<int>());
        s.past_capacity = shape["past_capacity"].cast<int64_t>();
        s.present_capacity = shape["present_capacity"].cast<int64_t>();
        s.has_past = s.past_capacity > 0;
        s.gqa_case = s.has_past ? kvl::GqaCase::kTokenGeneration : kvl::GqaCase::kFirstPrompt;
        const std::string dtype = shape["dtype"].cast<std::string>();
        s.dtype = dtype == "float16"    ? kvl::DType::kFloat16
                  : dtype == "bfloat16" ? kvl::DType::kBFloat16
                                        : kvl::DType::kFloat32;
        // A quantized cache ("kv_bits": 8 or 4; "kv_quant": PER_TENSOR, PER_CHANNEL or PER_TOKEN
        // for K and V, default PER_CHANNEL).
        if (shape.contains("kv_bits")) {
          s.kv_bits = shape["kv_bits"].cast<int64_t>();
          const std::string q =
              shape.contains("kv_quant") ? shape["kv_quant"].cast<std::string>() : "PER_CHANNEL";
          const kvl::Status st = kvl::ParseKvQuant(q, "kv_quant", &s.k_quant);
          if (!st.ok()) throw py::value_error(st.message());
          s.v_quant = s.k_quant;
        }
        kvl::CudaDeviceInfo dev;
        dev.sm_count = device["sm_count"].cast<int>();
        dev.cc_major = device["cc_major"].cast<int>();
        dev.max_smem_optin = device["max_smem_optin"].cast<int>();
        kvl::cu::PlanKnobs k;
        auto get = [&](const char* key, auto* field) {
          if (knobs.contains(key)) *field = knobs[key].cast<std::decay_t<decltype(*field)>>();
        };
        get("decode_splits", &k.decode_splits);
        get("decode_clusters", &k.decode_clusters);
        get("decode_group_clusters", &k.decode_group_clusters);
        get("decode_wide", &k.decode_wide);
        get("decode_packed", &k.decode_packed);
        get("decode_quant_bytes", &k.decode_quant_bytes);
        get("cudnn_min_rows", &k.cudnn_min_rows);
        const kvl::cu::ModelDecodeOccupancy occ(dev, device["smem_per_sm"].cast<int>());
        const kvl::GqaCudaPlan p = kvl::cu::PlanRules(s, kvl::cu::PlanBuffers{}, dev, occ, k);
        static const char* kKernels[] = {"prefill_tc", "decode_tc", "portable", "prefill_cudnn"};
        py::dict out;
        out["kernel"] = kKernels[static_cast<int>(p.kernel)];
        out["splits"] = p.splits;
        out["split_target"] = p.split_target;
        out["cluster"] = p.cluster;
        out["decode_ctas_per_sm"] = p.decode_ctas_per_sm;
        out["decode_threads"] = p.decode_threads;
        out["decode_packed"] = p.decode_packed;
        out["decode_scales_early"] = p.decode_scales_early;
        out["row_blocks"] = p.row_blocks;
        out["workspace_bytes"] = p.WorkspaceBytes();
        out["counter_bytes"] = p.counter_bytes;
        return out;
      },
      py::arg("shape"), py::arg("device"), py::arg("knobs") = py::dict(),
      "The CUDA plan rules (csrc/cuda/plan_rules.h) for a shape on a modelled device "
      "(plan_model.h: occupancy from shared memory), without a GPU: for tests");
}

}  // namespace kvl
