// ort_kvlayout._C.plan_gqa_cuda(): the CUDA plan rules (cuda/plan_rules.h) on a modelled device,
// without a GPU, for tests.
#pragma once

#include <pybind11/pybind11.h>

namespace kvl {
void BindPlan(pybind11::module_& m);
}  // namespace kvl
