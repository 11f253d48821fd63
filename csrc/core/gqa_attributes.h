// The op's attribute names, types and defaults, in one place. A custom op has no schema that ORT
// checks, so this parser does what ORT's schema check does for com.microsoft: an attribute of
// the wrong type is an error naming the attribute, the expected and the actual type (read as
// another type it would silently keep its default), and a required attribute must be present.
//
// `Source` describes one node's attributes:
//   AttrType Type(const char* name) const;        // kAbsent when the node does not carry it
//   int64_t Int(const char*) const; float Float(const char*) const;
//   std::string String(const char*) const;        // called only when Type() says so
#pragma once

#include <string>

#include "core/gqa_types.h"
#include "core/status.h"

namespace kvl {

enum class AttrType { kAbsent, kInt, kFloat, kString, kInts, kFloats, kTensor, kOther };

inline const char* AttrTypeName(AttrType t) {
  switch (t) {
    case AttrType::kAbsent: return "absent";
    case AttrType::kInt: return "INT";
    case AttrType::kFloat: return "FLOAT";
    case AttrType::kString: return "STRING";
    case AttrType::kInts: return "INTS";
    case AttrType::kFloats: return "FLOATS";
    case AttrType::kTensor: return "TENSOR";
    default: return "a type other than INT, FLOAT, STRING, INTS, FLOATS or TENSOR";
  }
}

namespace detail {

// Reads typed attributes into fields that hold the contract's defaults; keeps the first error.
template <typename Source>
class AttrReader {
 public:
  explicit AttrReader(const Source& src) : src_(src) {}

  void Int(const char* name, int64_t* field) {
    if (Expect(name, AttrType::kInt)) *field = src_.Int(name);
  }
  void Float(const char* name, float* field) {
    if (Expect(name, AttrType::kFloat)) *field = src_.Float(name);
  }
  void String(const char* name, std::string* field) {
    if (Expect(name, AttrType::kString)) *field = src_.String(name);
  }
  void Required(const char* name) {
    if (status_.ok() && src_.Type(name) == AttrType::kAbsent) {
      status_ = Status::Error(std::string("ai.kvlayout::GroupQueryAttention: attribute '") +
                              name + "' is required");
    }
  }
  const Status& status() const { return status_; }

 private:
  bool Expect(const char* name, AttrType want) {
    const AttrType got = src_.Type(name);
    if (got == AttrType::kAbsent) return false;
    if (got != want && status_.ok()) {
      status_ = Status::Error(std::string("ai.kvlayout::GroupQueryAttention: attribute '") + name +
                              "' must be of type " + AttrTypeName(want) + ", got " +
                              AttrTypeName(got));
    }
    return got == want;
  }

  const Source& src_;
  Status status_;
};

}  // namespace detail

// The types are those of com.microsoft::GroupQueryAttention's schema (ORT 1.32), plus kv_layout.
template <typename Source>
Status ParseGqaAttributes(const Source& src, GqaAttributes* out) {
  GqaAttributes a;  // the contract's defaults
  detail::AttrReader<Source> r(src);
  r.Required("num_heads");
  r.Required("kv_num_heads");
  r.Int("num_heads", &a.num_heads);
  r.Int("kv_num_heads", &a.kv_num_heads);
  r.Float("scale", &a.scale);
  r.Float("softcap", &a.softcap);
  r.Int("local_window_size", &a.local_window_size);
  r.Int("do_rotary", &a.do_rotary);
  r.Int("rotary_interleaved", &a.rotary_interleaved);
  r.Int("smooth_softmax", &a.smooth_softmax);
  r.Float("qk_norm_epsilon", &a.qk_norm_epsilon);
  r.Float("q_norm_epsilon", &a.q_norm_epsilon);
  r.Float("k_norm_epsilon", &a.k_norm_epsilon);
  r.Int("causal", &a.causal);
  r.Int("sliding_window_cache", &a.sliding_window_cache);
  r.String("k_quant_type", &a.k_quant_type);
  r.String("v_quant_type", &a.v_quant_type);
  r.Int("kv_cache_bit_width", &a.kv_cache_bit_width);
  r.Int("qk_output", &a.qk_output);
  r.Int("kv_layout", &a.kv_layout);
  *out = a;
  return r.status();
}

}  // namespace kvl
