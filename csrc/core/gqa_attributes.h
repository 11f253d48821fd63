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

// The op's attribute table: every attribute the op reads, its type and the field it fills. The
// types are those of com.microsoft::GroupQueryAttention's schema (ORT 1.32), plus kv_layout. This
// table is the one owner of that knowledge: the parser below reads it, and the Python tools read
// it through ort_kvlayout._C.gqa_attribute_types() (a custom op cannot list a node's attributes,
// so the patcher and the metadata tool refuse names outside it; docs/CONTRACT.md section 11).
struct GqaAttributeSpec {
  const char* name;
  AttrType type;
  bool required;
  int64_t GqaAttributes::*int_field;
  float GqaAttributes::*float_field;
  std::string GqaAttributes::*string_field;
};

namespace detail {
constexpr GqaAttributeSpec IntAttr(const char* name, int64_t GqaAttributes::*f,
                                   bool required = false) {
  return {name, AttrType::kInt, required, f, nullptr, nullptr};
}
constexpr GqaAttributeSpec FloatAttr(const char* name, float GqaAttributes::*f) {
  return {name, AttrType::kFloat, false, nullptr, f, nullptr};
}
constexpr GqaAttributeSpec StringAttr(const char* name, std::string GqaAttributes::*f) {
  return {name, AttrType::kString, false, nullptr, nullptr, f};
}
}  // namespace detail

inline constexpr GqaAttributeSpec kGqaAttributeTable[] = {
    detail::IntAttr("num_heads", &GqaAttributes::num_heads, true),
    detail::IntAttr("kv_num_heads", &GqaAttributes::kv_num_heads, true),
    detail::FloatAttr("scale", &GqaAttributes::scale),
    detail::FloatAttr("softcap", &GqaAttributes::softcap),
    detail::IntAttr("local_window_size", &GqaAttributes::local_window_size),
    detail::IntAttr("do_rotary", &GqaAttributes::do_rotary),
    detail::IntAttr("rotary_interleaved", &GqaAttributes::rotary_interleaved),
    detail::IntAttr("smooth_softmax", &GqaAttributes::smooth_softmax),
    detail::FloatAttr("qk_norm_epsilon", &GqaAttributes::qk_norm_epsilon),
    detail::FloatAttr("q_norm_epsilon", &GqaAttributes::q_norm_epsilon),
    detail::FloatAttr("k_norm_epsilon", &GqaAttributes::k_norm_epsilon),
    detail::IntAttr("causal", &GqaAttributes::causal),
    detail::IntAttr("sliding_window_cache", &GqaAttributes::sliding_window_cache),
    detail::StringAttr("k_quant_type", &GqaAttributes::k_quant_type),
    detail::StringAttr("v_quant_type", &GqaAttributes::v_quant_type),
    detail::IntAttr("kv_cache_bit_width", &GqaAttributes::kv_cache_bit_width),
    detail::IntAttr("qk_output", &GqaAttributes::qk_output),
    detail::IntAttr("kv_layout", &GqaAttributes::kv_layout),
};

template <typename Source>
Status ParseGqaAttributes(const Source& src, GqaAttributes* out) {
  GqaAttributes a;  // the contract's defaults
  detail::AttrReader<Source> r(src);
  for (const GqaAttributeSpec& spec : kGqaAttributeTable) {
    if (spec.required) r.Required(spec.name);
  }
  for (const GqaAttributeSpec& spec : kGqaAttributeTable) {
    switch (spec.type) {
      case AttrType::kInt: r.Int(spec.name, &(a.*spec.int_field)); break;
      case AttrType::kFloat: r.Float(spec.name, &(a.*spec.float_field)); break;
      default: r.String(spec.name, &(a.*spec.string_field)); break;
    }
  }
  *out = a;
  return r.status();
}

}  // namespace kvl
