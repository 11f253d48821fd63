// Input validation shared by the CPU and CUDA ops: pure functions returning a Status whose message
// names the input or attribute, the rule, and the offending value.
#pragma once

#include <cstdint>
#include <string>

#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "core/length_rules.h"
#include "core/status.h"

namespace kvl {

// Attribute rules that do not depend on the inputs; run when the kernel is created. `caps`: what
// the caller's kernels implement beyond the base contract (the rest is refused by name).
Status CheckGqaAttributes(const GqaAttributes& attrs, const GqaKernelCaps& caps = {});

// Shapes, types and presence of the inputs, plus total_sequence_length (always host memory).
// Fills `shape` on success.
Status CheckGqaInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                      int32_t total_sequence_length, GqaShape* shape,
                      const GqaKernelCaps& caps = {});

// k_quant_type / v_quant_type as ORT reads them: NONE, PER_TENSOR or PER_CHANNEL, any case.
Status ParseKvQuant(const std::string& text, const char* attribute, KvQuant* quant);

// Values of k_scale / v_scale (host memory, sizes checked by CheckGqaInputs) of a quantized
// cache: every scale finite and > 0. No-op for an unquantized cache.
Status CheckKvScales(const GqaShape& shape, const float* k_scale, const float* v_scale);

// Past/present must share memory for both K and V or for neither.
Status CheckSharing(const GqaBuffers& buf);

// Bytes of one present cache (B, Nkv, C', cache_row) of the cache's element type.
size_t PresentBytes(const GqaShape& shape);

// total_sequence_length (a host input on both EPs) must fit a shared past/present buffer.
Status CheckSharedCapacity(const GqaShape& shape, bool shared_kv);

// Value checks that need seqlens_k / query_seqlens / position_ids on the host: the CPU op, and
// the CUDA op in strict mode (after copying them); else a CUDA prepare/decode kernel applies the
// same rules (core/length_rules.h) and records the first violation. `shared_kv` is true when
// past and present are the same memory. `query_seqlens` may be null when the input is absent.
Status CheckLengthsOnHost(const GqaShape& shape, const int32_t* seqlens_k,
                          const int32_t* query_seqlens, const int64_t* position_ids,
                          bool shared_kv);

// The op's message for a violated length rule (the same words on CPU and CUDA); empty for
// LengthRule::kNone.
std::string LengthViolationMessage(const LengthViolation& violation);

}  // namespace kvl
