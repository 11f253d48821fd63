// The rules on one call's length values (seqlens_k, query_seqlens, position_ids), one batch entry
// or one token at a time, for host and device alike: the CPU op checks them on the host
// (CheckLengthsOnHost), the CUDA prepare or decode kernel on the device, recording the first
// violation for the op to report (docs/CONTRACT.md, "Length values on CUDA"). Both report a
// LengthViolation, worded once by LengthViolationMessage (check_inputs.h).
#pragma once

#include <cstdint>

#include "core/gqa_types.h"

namespace kvl {

enum class LengthRule : int32_t {
  kNone = 0,
  kSeqlensRange,        // seqlens_k[b] + 1 outside [1, total_sequence_length]
  kQuerySeqlensRange,   // query_seqlens[b] outside [0, min(S, seqlens_k[b] + 1)]
  kSeqlensBelowSeq,     // with past and no query_seqlens: seqlens_k[b] + 1 < S
  kSlidingPadded,       // a sliding window cache's first prompt with right padding
  kPastBeyondCapacity,  // the implied past exceeds past_key's capacity
  kPosition,            // a rotary position outside cos_cache/sin_cache
};

// One violation, with every number its message needs (no GqaShape: the CUDA op and the Python
// call word it from the record alone). Plain data, written by the device into host memory.
struct LengthViolation {
  int32_t rule;               // LengthRule
  int32_t from_position_ids;  // kPosition: 1 when position_ids gave it, 0 when implied
  int64_t batch;
  int64_t token;  // kPosition only
  int64_t value;  // the offending value (seqlens_k[b], query_seqlens[b] or the position)
  int64_t bound;  // the rule's bound as the message states it
  int64_t past;   // kPastBeyondCapacity: the past that seqlens_k implies
};

KVL_HOST_DEVICE LengthViolation NoLengthViolation() {
  return LengthViolation{static_cast<int32_t>(LengthRule::kNone), 0, 0, 0, 0, 0, 0};
}

KVL_HOST_DEVICE LengthViolation MakeLengthViolation(LengthRule rule, int64_t b, int64_t value,
                                                    int64_t bound) {
  LengthViolation v = NoLengthViolation();
  v.rule = static_cast<int32_t>(rule);
  v.batch = b;
  v.value = value;
  v.bound = bound;
  return v;
}

// The rules on batch entry b's lengths, in the order the CPU op checks them.
KVL_HOST_DEVICE LengthViolation CheckBatchLengths(const GqaShape& s, int64_t b, int32_t seqlens_k_b,
                                                  int32_t query_seqlens_b) {
  const int64_t total_b = static_cast<int64_t>(seqlens_k_b) + 1;
  if (total_b < 1 || total_b > s.total_seq_len) {
    return MakeLengthViolation(LengthRule::kSeqlensRange, b, seqlens_k_b, s.total_seq_len - 1);
  }
  if (s.has_query_seqlens &&
      (query_seqlens_b < 0 || query_seqlens_b > s.seq_len || query_seqlens_b > total_b)) {
    return MakeLengthViolation(LengthRule::kQuerySeqlensRange, b, query_seqlens_b,
                               s.seq_len < total_b ? s.seq_len : total_b);
  }
  if (!s.is_first_prompt() && !s.has_query_seqlens && total_b < s.seq_len) {
    return MakeLengthViolation(LengthRule::kSeqlensBelowSeq, b, seqlens_k_b, s.seq_len);
  }
  if (s.sliding_window_cache && s.is_first_prompt() && total_b != s.seq_len) {
    return MakeLengthViolation(LengthRule::kSlidingPadded, b, seqlens_k_b, s.seq_len);
  }
  const BatchGeometry g = GetBatchGeometry(s, seqlens_k_b, s.has_query_seqlens ? query_seqlens_b : 0);
  if (!s.sliding_window_cache && g.past > s.past_capacity) {
    LengthViolation v =
        MakeLengthViolation(LengthRule::kPastBeyondCapacity, b, seqlens_k_b, s.past_capacity);
    v.past = g.past;
    return v;
  }
  return NoLengthViolation();
}

// New tokens of a batch entry whose rotary position is used (and so checked): every row of a
// first prompt (padding rows are rotated too), else the valid new rows. For lengths that pass
// CheckBatchLengths.
KVL_HOST_DEVICE int64_t RotaryRowsUsed(const GqaShape& s, const BatchGeometry& g) {
  return s.is_first_prompt() ? s.seq_len : g.new_rows;
}

// The rule on the rotary position `pos` of token i of batch entry b.
KVL_HOST_DEVICE LengthViolation CheckRotaryPosition(const GqaShape& s, int64_t b, int64_t i,
                                                    int64_t pos) {
  if (pos >= 0 && pos < s.rotary_max_positions) return NoLengthViolation();
  LengthViolation v = MakeLengthViolation(LengthRule::kPosition, b, pos, s.rotary_max_positions);
  v.token = i;
  v.from_position_ids = s.has_position_ids ? 1 : 0;
  return v;
}

// What a CUDA kernel instance keeps in host-mapped memory (cudaHostAllocMapped): the device
// writes `violation`, then `written` = the record's generation; the host reads it when
// `written` != `taken`, then sets `taken` = `written`, which frees the slot for the next
// violation. The device decides who writes with an atomicCAS on a word in device memory
// (atomics on mapped host memory are not atomic across a PCIe link).
struct LengthRecord {
  volatile uint32_t written;  // device -> host
  volatile uint32_t taken;    // host -> device
  LengthViolation violation;
};

}  // namespace kvl
