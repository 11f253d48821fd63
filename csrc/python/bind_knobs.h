// ort_kvlayout._C.knobs() and knob_values(): the environment knob registry (core/knobs.h).
#pragma once

#include <pybind11/pybind11.h>

namespace kvl {
void BindKnobs(pybind11::module_& m);
}  // namespace kvl
