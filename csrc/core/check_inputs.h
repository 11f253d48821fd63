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

// Attribute rules that do not depend on the inputs; run when the kernel is created.
Status CheckGqaAttributes(const GqaAttributes& attrs);

// Shapes, types and presence of the inputs, plus total_sequence_length (always host memory).
// Fills `shape` on success.
Status CheckGqaInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                      int32_t total_sequence_length, GqaShape* shape);

// Past/present must share memory for both K and V or for neither.
Status CheckSharing(const GqaBuffers& buf);

// Bytes of one present cache (B, Nkv, C', H) of the op's type.
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
