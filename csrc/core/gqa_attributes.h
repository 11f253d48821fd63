// The op's attribute names and defaults, in one place. `Source` reads one attribute by name:
//   int64_t Int(const char*, int64_t); float Float(const char*, float);
//   std::string String(const char*, const char*)
// each returning the default when the node does not carry the attribute.
#pragma once

#include "core/gqa_types.h"

namespace kvl {

template <typename Source>
GqaAttributes ParseGqaAttributes(const Source& src) {
  GqaAttributes a;
  a.num_heads = src.Int("num_heads", 0);
  a.kv_num_heads = src.Int("kv_num_heads", 0);
  a.scale = src.Float("scale", 0.0f);
  a.softcap = src.Float("softcap", 0.0f);
  a.local_window_size = src.Int("local_window_size", -1);
  a.do_rotary = src.Int("do_rotary", 0);
  a.rotary_interleaved = src.Int("rotary_interleaved", 0);
  a.smooth_softmax = src.Int("smooth_softmax", -1);
  a.qk_norm_epsilon = src.Float("qk_norm_epsilon", 1e-6f);
  a.q_norm_epsilon = src.Float("q_norm_epsilon", -1.0f);
  a.k_norm_epsilon = src.Float("k_norm_epsilon", -1.0f);
  a.causal = src.Int("causal", 1);
  a.sliding_window_cache = src.Int("sliding_window_cache", 0);
  a.k_quant_type = src.String("k_quant_type", "NONE");
  a.v_quant_type = src.String("v_quant_type", "NONE");
  a.kv_cache_bit_width = src.Int("kv_cache_bit_width", 0);
  a.qk_output = src.Int("qk_output", 0);
  a.kv_layout = src.Int("kv_layout", 0);
  return a;
}

}  // namespace kvl
