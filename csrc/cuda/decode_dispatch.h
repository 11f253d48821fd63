// The decode kernel's compiled instances as host function pointers: one instantiation file per
// (element type, head tile) defines DecodeInstanceFn for its tile (decode_kernel.cuh), and
// decode_dispatch.cu picks the instance for a call and launches it.
#pragma once

#include <cstdint>

#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "core/kv_strides.h"
#include "core/status.h"
#include "cuda/decode_geometry.h"

namespace kvl {
namespace cu {

// (shape, buffers, present strides, splits, split target, cluster, partials o / m / l,
// counters, scales early: GqaCudaPlan's fields of the same names, DecodeTcKernel's parameters)
using DecodeFn = void (*)(GqaShape, GqaBuffers, KvStrides, int64_t, int64_t, int, float*,
                          float*, float*, unsigned*, bool);

// The instance of tile HD for (form, warps), or null where it is not compiled.
template <typename T, int HD>
DecodeFn DecodeInstanceFn(DecodeForm form, int warps);

// The quantized instance of tile hd (64 or 128) for a cache of kBits-bit codes at `warps`
// warps, or null.
template <typename T, int kBits>
DecodeFn DecodeQuantInstanceFn(int hd, DecodeForm form, int warps);

// The kernel of a compiled instance (DecodeInstanceFor) for fp16 or bf16.
DecodeFn DecodeKernelOf(DType dtype, const DecodeInstance& inst);

}  // namespace cu
}  // namespace kvl
