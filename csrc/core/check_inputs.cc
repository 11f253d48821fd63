// Validation of the op's calls (check_inputs.h). CheckGqaAttributes and CheckGqaInputs are each a
// family of checks run in a fixed order, one per concern (attributes: heads and scores, quantized
// cache, outputs; inputs: query/key/value, the cache's storage, the lengths, past and capacity,
// rotary, bias and sink, norms), each filling its part of the result; then the checks of values
// and buffers the kernels run before they write (scales, sharing, lengths on the host).
#include "core/check_inputs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>
#include <string>

#include "core/messages.h"

namespace kvl {
namespace {

// ---- attributes ----------------------------------------------------------------------------

// kv_layout, the head counts and the score rules.
Status CheckHeadAndScoreAttributes(const GqaAttributes& a) {
  if (a.kv_layout != 0 && a.kv_layout != 1) {
    return GqaError("attribute 'kv_layout' must be 0 (head-major BNSH) or 1 (seq-major BSNH), got ",
                    a.kv_layout);
  }
  if (a.num_heads <= 0 || a.kv_num_heads <= 0) {
    return GqaError("attributes 'num_heads' and 'kv_num_heads' must be positive, got num_heads=",
                    a.num_heads, ", kv_num_heads=", a.kv_num_heads);
  }
  if (a.num_heads % a.kv_num_heads != 0) {
    return GqaError("attribute 'num_heads' (", a.num_heads,
                    ") must be a multiple of 'kv_num_heads' (", a.kv_num_heads, ")");
  }
  // As ORT: softcap > 0 caps, any other value (0, negative, NaN, -inf) is off. +inf would make
  // every score inf * tanh(x / inf) = NaN in ORT: not supported (the patcher refuses it).
  if (std::isinf(a.softcap) && a.softcap > 0.0f) {
    return GqaError("attribute 'softcap' must be finite (<= 0 or NaN = off), got ", a.softcap);
  }
  if (!std::isfinite(a.scale)) return GqaError("attribute 'scale' must be finite, got ", a.scale);
  // smooth_softmax, do_rotary, rotary_interleaved, sliding_window_cache: as in ORT, 1 is on and
  // every other value off (ORT 1.32 runs smooth_softmax=2 or do_rotary=-1 as off), so any value is
  // accepted and CheckGqaInputs reads `== 1`. [tests/op/test_attribute_values.py]
  if (a.causal != 0 && a.causal != 1) {
    return GqaError("attribute 'causal' must be 0 or 1, got ", a.causal);
  }
  if (a.causal == 0 && a.local_window_size != -1) {
    return GqaError("attribute 'local_window_size' must be -1 when 'causal' is 0 (a window is ",
                    "causal), got ", a.local_window_size);
  }
  if (a.sliding_window_cache == 1 && a.local_window_size <= 0) {
    return GqaError("attribute 'sliding_window_cache'=1 needs 'local_window_size' > 0, got ",
                    a.local_window_size);
  }
  return Status::Ok();
}

// Quantized KV cache (ORT 1.32's CPU contract): k_quant_type == v_quant_type, and
// kv_cache_bit_width 8 or 4 exactly when quantized; what the caller's kernels implement.
Status CheckKvQuantAttributes(const GqaAttributes& a, const GqaKernelCaps& caps) {
  KvQuant kq = KvQuant::kNone, vq = KvQuant::kNone;
  KVL_RETURN_IF_ERROR(ParseKvQuant(a.k_quant_type, "k_quant_type", &kq));
  KVL_RETURN_IF_ERROR(ParseKvQuant(a.v_quant_type, "v_quant_type", &vq));
  if (kq != vq) {
    return GqaError("attributes 'k_quant_type' (", a.k_quant_type, ") and 'v_quant_type' (",
                    a.v_quant_type,
                    ") must be equal: the key and value caches are quantized alike ",
                    "(as ORT's CPU kernel requires)");
  }
  if (kq == KvQuant::kNone && a.kv_cache_bit_width != 0) {
    return GqaError("attribute 'kv_cache_bit_width' must be 0 (or absent) without quantization ",
                    "(k_quant_type = v_quant_type = NONE), got ", a.kv_cache_bit_width);
  }
  if (kq != KvQuant::kNone) {
    if (a.kv_cache_bit_width != 8 && a.kv_cache_bit_width != 4) {
      return GqaError(
          "attribute 'kv_cache_bit_width' must be 8 (int8 cache) or 4 (int4 cache, two ",
          "values per uint8) with k_quant_type=", a.k_quant_type, ", got ", a.kv_cache_bit_width);
    }
    if (!caps.quantized_kv) {
      return GqaError("quantized KV cache (k_quant_type=", a.k_quant_type,
                      ", kv_cache_bit_width=", a.kv_cache_bit_width,
                      ") runs on the CPU and CUDA ops (CPUExecutionProvider, ",
                      "CUDAExecutionProvider) only: this kernel entry does not support it");
    }
    if (kq == KvQuant::kPerToken && !caps.per_token_kv) {
      return GqaError(
          "k_quant_type=PER_TOKEN (per-token scales in scale caches) runs on the CPU op ",
          "(CPUExecutionProvider) only so far: these kernels do not support it");
    }
  }
  return Status::Ok();
}

// The outputs the node names: PER_TOKEN writes the scales of the rows it writes, so both present
// scale outputs are needed; without PER_TOKEN there are none to write. output_qk is not supported.
Status CheckOutputAttributes(const GqaAttributes& a) {
  KvQuant kq = KvQuant::kNone;
  KVL_RETURN_IF_ERROR(ParseKvQuant(a.k_quant_type, "k_quant_type", &kq));
  const struct {
    GqaOutput output;
    bool named;
  } scale_outputs[] = {{GqaOutput::kPresentKeyScale, a.present_key_scale_requested},
                       {GqaOutput::kPresentValueScale, a.present_value_scale_requested}};
  for (const auto& o : scale_outputs) {
    if (kq == KvQuant::kPerToken && !o.named) {
      return GqaError(
          "output '", GqaOutputName(o.output), "' (output ", static_cast<int>(o.output),
          ") is required with k_quant_type=PER_TOKEN: the float32 scales of the present ",
          "cache's rows, shape (batch, kv_num_heads, present capacity)");
    }
    if (kq != KvQuant::kPerToken && o.named) {
      return GqaError("output '", GqaOutputName(o.output), "' (output ", static_cast<int>(o.output),
                      ") is named but k_quant_type is ", a.k_quant_type,
                      ": scale caches belong to ", "k_quant_type = v_quant_type = PER_TOKEN");
    }
  }
  if (a.qk_output != 0) {
    return GqaError("attribute 'qk_output' = ", a.qk_output,
                    ": output_qk is not supported by ort-kvlayout v1");
  }
  if (a.output_qk_requested) {
    return GqaError(
        "output 'output_qk' is not supported by ort-kvlayout v1; remove the 4th output");
  }
  return Status::Ok();
}

// ---- inputs --------------------------------------------------------------------------------

const TensorInfo& In(const GqaInputInfos& inputs, GqaInput which) {
  return inputs[static_cast<int>(which)];
}

Status CheckRank(const GqaInputInfos& inputs, GqaInput which, size_t rank, const char* dims) {
  const TensorInfo& t = In(inputs, which);
  if (t.shape.size() != rank) {
    return GqaError("input '", GqaInputName(which), "' must have rank ", rank, " ", dims,
                    ", got shape ", ShapeString(t.shape));
  }
  return Status::Ok();
}

Status CheckDType(const GqaInputInfos& inputs, GqaInput which, DType expected) {
  const TensorInfo& t = In(inputs, which);
  if (t.dtype != expected) {
    return GqaError(
        "input '", GqaInputName(which), "' must be ", DTypeName(expected), " (the type of ",
        expected == DType::kInt32 || expected == DType::kInt64 ? "the contract" : "query",
        "), got ", DTypeName(t.dtype));
  }
  return Status::Ok();
}

Status CheckPair(const GqaInputInfos& inputs, GqaInput a, GqaInput b) {
  if (In(inputs, a).exists != In(inputs, b).exists) {
    return GqaError("inputs '", GqaInputName(a), "' and '", GqaInputName(b),
                    "' must be both present or both absent; got only '",
                    GqaInputName(In(inputs, a).exists ? a : b), "'");
  }
  return Status::Ok();
}

size_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    default: return 1;  // int8, uint8 (packed int4), float8e4m3fn
  }
}

// The quantized-cache attributes of a node, parsed (CheckGqaAttributes has accepted them).
struct KvQuantAttrs {
  KvQuant k = KvQuant::kNone;
  KvQuant v = KvQuant::kNone;
  bool quantized() const { return k != KvQuant::kNone; }
};

KvQuantAttrs ReadKvQuant(const GqaAttributes& a) {
  KvQuantAttrs q;
  ParseKvQuant(a.k_quant_type, "k_quant_type", &q.k);
  ParseKvQuant(a.v_quant_type, "v_quant_type", &q.v);
  return q;
}

// The cache element type a quantized node declares: int8 codes (8 bits), int4 pairs in uint8.
DType QuantCacheDType(int64_t bits) { return bits == 4 ? DType::kUInt8 : DType::kInt8; }

// past_key / past_value element type against the node's attributes.
Status CheckCacheDType(GqaInput which, DType got, const GqaShape& s, const GqaAttributes& a) {
  if (got == s.cache_dtype) return Status::Ok();
  if (!s.quantized() &&
      (got == DType::kInt8 || got == DType::kUInt8 || got == DType::kFloat8E4M3)) {
    return GqaError(
        "input '", GqaInputName(which), "' is ", DTypeName(got), ", a quantized cache: ",
        "it needs k_quant_type = v_quant_type = PER_TENSOR or PER_CHANNEL (inputs ",
        "k_scale/v_scale) or PER_TOKEN (scale caches), and kv_cache_bit_width (8: int8 ",
        "or float8e4m3fn, 4: uint8); an unquantized cache has the type of query (",
        DTypeName(s.dtype), ")");
  }
  if (s.quantized()) {
    const bool key = which == GqaInput::kPastKey;
    const char* want =
        key ? (s.kv_bits == 8 ? "int8 or float8e4m3fn" : "uint8") : DTypeName(s.cache_dtype);
    return GqaError("input '", GqaInputName(which), "' must be ", want,
                    key ? "" : " (the type of 'past_key')", " for kv_cache_bit_width=", s.kv_bits,
                    " (k_quant_type=", a.k_quant_type, "), got ", DTypeName(got));
  }
  return GqaError("input '", GqaInputName(which), "' must have the type of query (",
                  DTypeName(s.dtype), "), got ", DTypeName(got));
}

// k_scale / v_scale: present exactly when the cache is quantized; float32; 1 value per tensor,
// Nkv*H per channel (ORT checks the element count only, so any shape of that count runs).
Status CheckScale(const GqaInputInfos& inputs, GqaInput which, KvQuant quant, const char* attr,
                  const GqaShape& s) {
  const TensorInfo& t = In(inputs, which);
  if (quant == KvQuant::kPerToken) {
    if (!t.exists) return Status::Ok();
    return GqaError("input '", GqaInputName(which), "' must be absent with ", attr, "=PER_TOKEN: ",
                    "the scales are computed per token as rows are written and travel in the ",
                    "scale caches (inputs past_key_scale/past_value_scale, outputs ",
                    "present_key_scale/present_value_scale)");
  }
  if (quant == KvQuant::kNone) {
    if (!t.exists) return Status::Ok();
    return GqaError("input '", GqaInputName(which), "' is given but attribute '", attr,
                    "' is NONE: a scale belongs to a quantized cache (", attr,
                    " PER_TENSOR or PER_CHANNEL, with kv_cache_bit_width 8 or 4)");
  }
  if (!t.exists) {
    return GqaError("input '", GqaInputName(which), "' is required with ", attr, "=",
                    KvQuantName(quant), ": the float32 dequantization scale of the ",
                    which == GqaInput::kKScale ? "key" : "value", " cache");
  }
  if (t.dtype != DType::kFloat32) {
    return GqaError("input '", GqaInputName(which), "' must be float32, got ", DTypeName(t.dtype));
  }
  const int64_t want = quant == KvQuant::kPerTensor ? 1 : s.kv_num_heads * s.head_size;
  if (t.NumElements() != want) {
    if (quant == KvQuant::kPerTensor) {
      return GqaError("input '", GqaInputName(which), "' must hold 1 value (shape (1,)) for ", attr,
                      "=PER_TENSOR, got shape ", ShapeString(t.shape));
    }
    return GqaError("input '", GqaInputName(which), "' must hold kv_num_heads*head_size = ", want,
                    " values (shape (1, kv_num_heads, 1, head_size) = (1, ", s.kv_num_heads,
                    ", 1, ", s.head_size, ")) for ", attr, "=PER_CHANNEL, got shape ",
                    ShapeString(t.shape));
  }
  return Status::Ok();
}

// past_key_scale / past_value_scale (PER_TOKEN): float32 (B, Nkv, C) with C the capacity of
// past_key, both present exactly when a past is; refused without PER_TOKEN.
Status CheckScaleCaches(const GqaInputInfos& inputs, const GqaShape& s, const GqaAttributes& a) {
  for (GqaInput which : {GqaInput::kPastKeyScale, GqaInput::kPastValueScale}) {
    const TensorInfo& t = In(inputs, which);
    const bool key = which == GqaInput::kPastKeyScale;
    const char* cache = key ? "past_key" : "past_value";
    if (!s.per_token()) {
      if (!t.exists) continue;
      return GqaError("input '", GqaInputName(which), "' is given but k_quant_type is ",
                      a.k_quant_type,
                      ": a scale cache belongs to k_quant_type = v_quant_type = ", "PER_TOKEN");
    }
    if (!s.has_past) {
      if (!t.exists) continue;
      return GqaError("input '", GqaInputName(which), "' is given without '", cache,
                      "': a scale cache travels with its KV cache");
    }
    if (!t.exists) {
      return GqaError("input '", GqaInputName(which), "' is required with k_quant_type=PER_TOKEN ",
                      "and a past: the float32 scales of '", cache, "''s rows, shape (batch, ",
                      "kv_num_heads, capacity) = (", s.batch, ", ", s.kv_num_heads, ", ",
                      s.past_capacity, ")");
    }
    if (t.dtype != DType::kFloat32) {
      return GqaError("input '", GqaInputName(which), "' must be float32, got ",
                      DTypeName(t.dtype));
    }
    if (t.shape.size() != 3 || t.shape[0] != s.batch || t.shape[1] != s.kv_num_heads) {
      return GqaError("input '", GqaInputName(which), "' must have shape (batch, kv_num_heads, ",
                      "capacity) = (", s.batch, ", ", s.kv_num_heads, ", ", s.past_capacity,
                      "), got ", ShapeString(t.shape));
    }
    if (t.shape[2] != s.past_capacity) {
      return GqaError("input '", GqaInputName(which), "' has capacity ", t.shape[2],
                      ": a scale cache must have the capacity of its KV cache ('", cache,
                      "': ", s.past_capacity, ")");
    }
  }
  return Status::Ok();
}

// query: (B, S, N*H) or packed (B, S, (N + 2*Nkv)*H); key and value (B, S, Nkv*H) of query's type
// when not packed. Sets dtype, batch, seq_len, packed_qkv and head_size.
Status CheckQueryKeyValue(const GqaInputInfos& inputs, GqaShape* out) {
  GqaShape& s = *out;
  const TensorInfo& q = In(inputs, GqaInput::kQuery);
  KVL_RETURN_IF_ERROR(CheckRank(inputs, GqaInput::kQuery, 3, "(batch, sequence, hidden)"));
  if (q.dtype != DType::kFloat32 && q.dtype != DType::kFloat16 && q.dtype != DType::kBFloat16) {
    return GqaError("input 'query' must be float32, float16 or bfloat16, got ", DTypeName(q.dtype));
  }
  s.dtype = q.dtype;
  s.batch = q.shape[0];
  s.seq_len = q.shape[1];
  if (s.batch <= 0 || s.seq_len <= 0) {
    return GqaError("input 'query' must have batch and sequence length >= 1, got shape ",
                    ShapeString(q.shape));
  }
  KVL_RETURN_IF_ERROR(CheckPair(inputs, GqaInput::kKey, GqaInput::kValue));
  s.packed_qkv = !In(inputs, GqaInput::kKey).exists;
  const int64_t hidden = q.shape[2];
  if (s.packed_qkv) {
    const int64_t heads = s.num_heads + 2 * s.kv_num_heads;
    if (hidden <= 0 || hidden % heads != 0) {
      return GqaError("input 'query' is packed QKV (key and value absent): its last dim (", hidden,
                      ") must be (num_heads + 2*kv_num_heads) * head_size = ", heads,
                      " * head_size");
    }
    s.head_size = hidden / heads;
  } else {
    if (hidden <= 0 || hidden % s.num_heads != 0) {
      return GqaError("input 'query': last dim (", hidden, ") must be num_heads (", s.num_heads,
                      ") * head_size");
    }
    s.head_size = hidden / s.num_heads;
    for (GqaInput which : {GqaInput::kKey, GqaInput::kValue}) {
      const TensorInfo& t = In(inputs, which);
      KVL_RETURN_IF_ERROR(CheckRank(inputs, which, 3, "(batch, sequence, kv_hidden)"));
      KVL_RETURN_IF_ERROR(CheckDType(inputs, which, s.dtype));
      if (t.shape[0] != s.batch || t.shape[1] != s.seq_len ||
          t.shape[2] != s.kv_num_heads * s.head_size) {
        return GqaError("input '", GqaInputName(which), "' must have shape (batch, sequence, ",
                        "kv_num_heads*head_size) = (", s.batch, ", ", s.seq_len, ", ",
                        s.kv_num_heads * s.head_size, "), got ", ShapeString(t.shape));
      }
    }
  }
  return Status::Ok();
}

// The KV cache's storage: the element type a quantized node declares (an 8-bit cache is int8 or
// float8e4m3fn, as past_key says; without a past: int8), the row length, and k_scale / v_scale.
Status CheckCacheFormat(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                        const GqaKernelCaps& caps, GqaShape* out) {
  GqaShape& s = *out;
  const KvQuantAttrs quant = ReadKvQuant(attrs);
  s.k_quant = quant.k;
  s.v_quant = quant.v;
  s.kv_bits = quant.quantized() ? attrs.kv_cache_bit_width : 0;
  s.cache_dtype = quant.quantized() ? QuantCacheDType(s.kv_bits) : s.dtype;
  // An 8-bit cache is int8 or float8e4m3fn, as past_key says (without a past: int8).
  const TensorInfo& past_key = In(inputs, GqaInput::kPastKey);
  if (s.kv_bits == 8 && past_key.exists && past_key.dtype == DType::kFloat8E4M3) {
    if (!caps.fp8_kv) {
      return GqaError("input 'past_key' is float8e4m3fn: an fp8 KV cache runs on the CPU op ",
                      "(CPUExecutionProvider) only so far: these kernels do not support it");
    }
    s.cache_dtype = DType::kFloat8E4M3;
  }
  s.cache_row = KvRowElements(s.head_size, s.kv_bits);
  KVL_RETURN_IF_ERROR(CheckScale(inputs, GqaInput::kKScale, s.k_quant, "k_quant_type", s));
  KVL_RETURN_IF_ERROR(CheckScale(inputs, GqaInput::kVScale, s.v_quant, "v_quant_type", s));
  return Status::Ok();
}

// seqlens_k: (B) int32; total_sequence_length: an int32 scalar, already read from host memory;
// query_seqlens (B) int32 when given. Sets the call's case: first prompt, token generation or a
// subsequent prompt (chunked prefill).
Status CheckLengthInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                         int32_t total_sequence_length, GqaShape* out) {
  GqaShape& s = *out;
  const TensorInfo& seqlens = In(inputs, GqaInput::kSeqlensK);
  KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kSeqlensK, DType::kInt32));
  if (seqlens.shape.size() != 1 || seqlens.shape[0] != s.batch) {
    return GqaError("input 'seqlens_k' must have rank 1, shape (batch,) = (", s.batch, ",), got ",
                    "shape ", ShapeString(seqlens.shape));
  }
  const TensorInfo& total = In(inputs, GqaInput::kTotalSequenceLength);
  KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kTotalSequenceLength, DType::kInt32));
  if (total.NumElements() != 1) {
    return GqaError("input 'total_sequence_length' must hold one value, got shape ",
                    ShapeString(total.shape));
  }
  if (total_sequence_length < s.seq_len) {
    return GqaError("input 'total_sequence_length' (", total_sequence_length,
                    ") must be >= the query's sequence length (", s.seq_len, ")");
  }
  s.total_seq_len = total_sequence_length;
  if (In(inputs, GqaInput::kQuerySeqlens).exists) {
    const TensorInfo& t = In(inputs, GqaInput::kQuerySeqlens);
    KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kQuerySeqlens, DType::kInt32));
    if (t.NumElements() != s.batch || t.shape.size() != 1) {
      return GqaError("input 'query_seqlens' must have shape (batch,) = (", s.batch, ",), got ",
                      ShapeString(t.shape));
    }
    s.has_query_seqlens = true;
  }
  s.sliding_window_cache = attrs.sliding_window_cache == 1;
  if (s.has_query_seqlens) {  // a chunk of a longer sequence: never a first prompt
    s.gqa_case = s.seq_len == 1 ? GqaCase::kTokenGeneration : GqaCase::kSubsequentPrompt;
  } else if (s.seq_len == total_sequence_length) {
    s.gqa_case = GqaCase::kFirstPrompt;
  } else if (s.seq_len == 1) {
    s.gqa_case = GqaCase::kTokenGeneration;
  } else {
    s.gqa_case = GqaCase::kSubsequentPrompt;
  }
  return Status::Ok();
}

// past_key / past_value: (B, Nkv, C, H) in the byte order of kv_layout, required unless this is a
// first prompt; the PER_TOKEN scale caches beside them.
Status CheckPastInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                       int32_t total_sequence_length, GqaShape* out) {
  GqaShape& s = *out;
  KVL_RETURN_IF_ERROR(CheckPair(inputs, GqaInput::kPastKey, GqaInput::kPastValue));
  s.has_past = In(inputs, GqaInput::kPastKey).exists;
  if (s.has_past) {
    for (GqaInput which : {GqaInput::kPastKey, GqaInput::kPastValue}) {
      const TensorInfo& t = In(inputs, which);
      KVL_RETURN_IF_ERROR(
          CheckRank(inputs, which, 4, "(batch, kv_num_heads, capacity, head_size)"));
      KVL_RETURN_IF_ERROR(CheckCacheDType(which, t.dtype, s, attrs));
      if (t.shape[0] != s.batch || t.shape[1] != s.kv_num_heads || t.shape[3] != s.cache_row) {
        return GqaError("input '", GqaInputName(which), "' must have shape (batch, kv_num_heads, ",
                        "capacity, ", s.kv_bits == 4 ? "(head_size + 1) / 2" : "head_size", ") = (",
                        s.batch, ", ", s.kv_num_heads, ", C, ", s.cache_row, ")",
                        s.kv_bits == 4 ? " (int4 cache: two values per byte)" : "", ", got ",
                        ShapeString(t.shape));
      }
    }
    if (In(inputs, GqaInput::kPastKey).shape != In(inputs, GqaInput::kPastValue).shape) {
      return GqaError("inputs 'past_key' ", ShapeString(In(inputs, GqaInput::kPastKey).shape),
                      " and 'past_value' ", ShapeString(In(inputs, GqaInput::kPastValue).shape),
                      " must have the same shape");
    }
    s.past_capacity = In(inputs, GqaInput::kPastKey).shape[2];
  } else if (!s.is_first_prompt()) {
    return GqaError(
        "inputs 'past_key' and 'past_value' are required when the query's sequence length (",
        s.seq_len, ") is less than total_sequence_length (", total_sequence_length, ")");
  }
  KVL_RETURN_IF_ERROR(CheckScaleCaches(inputs, s, attrs));
  return Status::Ok();
}

// The present cache's capacity (max(total, past capacity), or a sliding window cache's past
// capacity, which must hold the window), what the past capacity allows, and ORT's rule for a
// batch of chunks.
Status CheckCapacity(const GqaAttributes& attrs, int32_t total_sequence_length, GqaShape* out) {
  GqaShape& s = *out;
  // ORT's rule: without per-entry chunk lengths, the past length of a chunk is seqlens_k + 1 - S
  // for one entry only; a batch of chunks needs query_seqlens.
  if (s.gqa_case == GqaCase::kSubsequentPrompt && !s.has_query_seqlens && s.batch > 1) {
    return GqaError("chunked prefill (query sequence length ", s.seq_len, " > 1 with past, less ",
                    "than total_sequence_length ", total_sequence_length, ") with batch ", s.batch,
                    " needs input 'query_seqlens' (the new tokens of each batch entry); without ",
                    "'query_seqlens' the batch must be 1");
  }
  if (s.sliding_window_cache) {
    // A window-sized cache: present has the past's capacity, which must hold the window.
    if (!s.has_past || s.past_capacity < attrs.local_window_size) {
      return GqaError(
          "attribute 'sliding_window_cache'=1 needs past_key/past_value with capacity >= ",
          "local_window_size (", attrs.local_window_size, "), got capacity ", s.past_capacity);
    }
    s.present_capacity = s.past_capacity;
  } else {
    if (!s.is_first_prompt() && s.past_capacity != total_sequence_length - s.seq_len &&
        s.past_capacity < total_sequence_length) {
      return GqaError("input 'past_key' has capacity ", s.past_capacity,
                      ": total_sequence_length (", total_sequence_length, ") must equal the past ",
                      "capacity + sequence length (", s.seq_len, ") for a growing cache, or be no ",
                      "greater than the past capacity for a preallocated (shared) cache");
    }
    s.present_capacity = std::max<int64_t>(total_sequence_length, s.past_capacity);
  }
  return Status::Ok();
}

// Rotary: cos_cache / sin_cache (max_positions, rotary_dim / 2) of query's type with
// do_rotary=1, and position_ids (B, S) int64, or positions 0 .. total - 1 that the caches hold.
Status CheckRotaryInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                         int32_t total_sequence_length, GqaShape* out) {
  GqaShape& s = *out;
  KVL_RETURN_IF_ERROR(CheckPair(inputs, GqaInput::kCosCache, GqaInput::kSinCache));
  if (attrs.do_rotary == 1) {
    if (!In(inputs, GqaInput::kCosCache).exists) {
      return GqaError("attribute 'do_rotary'=1 requires inputs 'cos_cache' and 'sin_cache'");
    }
    for (GqaInput which : {GqaInput::kCosCache, GqaInput::kSinCache}) {
      const TensorInfo& t = In(inputs, which);
      KVL_RETURN_IF_ERROR(CheckRank(inputs, which, 2, "(max_positions, rotary_dim / 2)"));
      KVL_RETURN_IF_ERROR(CheckDType(inputs, which, s.dtype));
      if (t.shape != In(inputs, GqaInput::kCosCache).shape) {
        return GqaError("inputs 'cos_cache' and 'sin_cache' must have the same shape, got ",
                        ShapeString(In(inputs, GqaInput::kCosCache).shape), " and ",
                        ShapeString(t.shape));
      }
    }
    const auto& cs = In(inputs, GqaInput::kCosCache).shape;
    if (cs[0] <= 0 || cs[1] <= 0 || 2 * cs[1] > s.head_size) {
      return GqaError(
          "input 'cos_cache' must have shape (max_positions >= 1, rotary_dim / 2) with ",
          "1 <= rotary_dim / 2 <= head_size / 2 = ", s.head_size / 2, ", got ", ShapeString(cs));
    }
    s.rotary_dim = 2 * cs[1];
    s.rotary_max_positions = cs[0];
    s.interleaved = attrs.rotary_interleaved == 1;  // as ORT: 1 on, any other value off
  }
  if (In(inputs, GqaInput::kPositionIds).exists) {
    const TensorInfo& t = In(inputs, GqaInput::kPositionIds);
    KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kPositionIds, DType::kInt64));
    KVL_RETURN_IF_ERROR(CheckRank(inputs, GqaInput::kPositionIds, 2, "(batch, sequence)"));
    if (t.shape[0] != s.batch || t.shape[1] != s.seq_len) {
      return GqaError("input 'position_ids' must have shape (batch, sequence) = (", s.batch, ", ",
                      s.seq_len, "), got ", ShapeString(t.shape));
    }
    s.has_position_ids = s.rotary_dim > 0;  // without rotary, positions have no effect
  }
  // Without position_ids the positions are 0 .. total_sequence_length - 1: checkable here, so
  // the CUDA op (which reads lengths on the device) refuses it too.
  if (s.rotary_dim > 0 && !s.has_position_ids && total_sequence_length > s.rotary_max_positions) {
    return GqaError("input 'cos_cache'/'sin_cache' has ", s.rotary_max_positions,
                    " positions, fewer ", "than total_sequence_length (", total_sequence_length,
                    ") needs");
  }
  return Status::Ok();
}

// attention_bias: (B or 1, N or 1, S, total_sequence_length), added to the scores; head_sink:
// (N), one extra logit per head.
Status CheckBiasAndSink(const GqaInputInfos& inputs, int32_t total_sequence_length, GqaShape* out) {
  GqaShape& s = *out;
  if (In(inputs, GqaInput::kAttentionBias).exists) {
    const TensorInfo& t = In(inputs, GqaInput::kAttentionBias);
    KVL_RETURN_IF_ERROR(
        CheckRank(inputs, GqaInput::kAttentionBias, 4, "(batch or 1, num_heads or 1, S, total)"));
    KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kAttentionBias, s.dtype));
    if ((t.shape[0] != 1 && t.shape[0] != s.batch) ||
        (t.shape[1] != 1 && t.shape[1] != s.num_heads) || t.shape[2] != s.seq_len ||
        t.shape[3] != total_sequence_length) {
      return GqaError(
          "input 'attention_bias' must have shape (batch or 1, num_heads or 1, sequence, ",
          "total_sequence_length) = (", s.batch, " or 1, ", s.num_heads, " or 1, ", s.seq_len, ", ",
          total_sequence_length, "), got ", ShapeString(t.shape));
    }
    s.has_attention_bias = true;
    s.bias_batch = t.shape[0];
    s.bias_heads = t.shape[1];
    s.bias_total = t.shape[3];
  }
  if (In(inputs, GqaInput::kHeadSink).exists) {
    const TensorInfo& t = In(inputs, GqaInput::kHeadSink);
    KVL_RETURN_IF_ERROR(CheckDType(inputs, GqaInput::kHeadSink, s.dtype));
    if (t.shape.size() != 1 || t.shape[0] != s.num_heads) {
      return GqaError("input 'head_sink' must have shape (num_heads,) = (", s.num_heads, ",), got ",
                      ShapeString(t.shape));
    }
    s.has_head_sink = true;
  }
  return Status::Ok();
}

// q_norm_weight / k_norm_weight: (H) of query's type, both or neither, and with them finite
// epsilons >= 0.
Status CheckNormInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs, GqaShape* out) {
  GqaShape& s = *out;
  for (GqaInput which : {GqaInput::kQNormWeight, GqaInput::kKNormWeight}) {
    const TensorInfo& t = In(inputs, which);
    if (!t.exists) continue;
    KVL_RETURN_IF_ERROR(CheckDType(inputs, which, s.dtype));
    if (t.shape.size() != 1 || t.shape[0] != s.head_size) {
      return GqaError("input '", GqaInputName(which), "' must have shape (head_size,) = (",
                      s.head_size, ",), got ", ShapeString(t.shape));
    }
  }
  KVL_RETURN_IF_ERROR(CheckPair(inputs, GqaInput::kQNormWeight, GqaInput::kKNormWeight));
  s.has_q_norm = In(inputs, GqaInput::kQNormWeight).exists;
  s.has_k_norm = In(inputs, GqaInput::kKNormWeight).exists;
  s.q_norm_epsilon = attrs.q_norm_epsilon >= 0.0f ? attrs.q_norm_epsilon : attrs.qk_norm_epsilon;
  s.k_norm_epsilon = attrs.k_norm_epsilon >= 0.0f ? attrs.k_norm_epsilon : attrs.qk_norm_epsilon;
  if ((s.has_q_norm || s.has_k_norm) &&
      !(s.q_norm_epsilon >= 0.0f && s.k_norm_epsilon >= 0.0f && std::isfinite(s.q_norm_epsilon) &&
        std::isfinite(s.k_norm_epsilon))) {
    return GqaError("with q/k norm weights, the norm epsilons (q_norm_epsilon / k_norm_epsilon, ",
                    "else qk_norm_epsilon) must be finite and >= 0, got ", s.q_norm_epsilon,
                    " and ", s.k_norm_epsilon);
  }
  return Status::Ok();
}

}  // namespace

Status ParseKvQuant(const std::string& text, const char* attribute, KvQuant* quant) {
  std::string upper = text;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (upper == "NONE") {
    *quant = KvQuant::kNone;
  } else if (upper == "PER_TENSOR") {
    *quant = KvQuant::kPerTensor;
  } else if (upper == "PER_CHANNEL") {
    *quant = KvQuant::kPerChannel;
  } else if (upper == "PER_TOKEN") {
    *quant = KvQuant::kPerToken;
  } else {
    return GqaError("attribute '", attribute,
                    "' must be NONE, PER_TENSOR, PER_CHANNEL or PER_TOKEN ",
                    "(any case; PER_TOKEN is ai.kvlayout's), got '", text, "'");
  }
  return Status::Ok();
}

const char* KvQuantName(KvQuant quant) {
  switch (quant) {
    case KvQuant::kPerTensor: return "PER_TENSOR";
    case KvQuant::kPerChannel: return "PER_CHANNEL";
    case KvQuant::kPerToken: return "PER_TOKEN";
    default: return "NONE";
  }
}

Status CheckGqaAttributes(const GqaAttributes& a, const GqaKernelCaps& caps) {
  KVL_RETURN_IF_ERROR(CheckHeadAndScoreAttributes(a));
  KVL_RETURN_IF_ERROR(CheckKvQuantAttributes(a, caps));
  KVL_RETURN_IF_ERROR(CheckOutputAttributes(a));
  // The norm epsilons are checked in CheckGqaInputs, only when norm weights are given: ORT runs
  // a node without them whatever the epsilons are (they are unused).
  return Status::Ok();
}

Status CheckGqaInputs(const GqaAttributes& attrs, const GqaInputInfos& inputs,
                      int32_t total_sequence_length, GqaShape* out, const GqaKernelCaps& caps) {
  KVL_RETURN_IF_ERROR(CheckGqaAttributes(attrs, caps));
  GqaShape s;
  s.num_heads = attrs.num_heads;
  s.kv_num_heads = attrs.kv_num_heads;
  s.layout = static_cast<KvLayout>(attrs.kv_layout);
  // In this order: a message names the first rule an input breaks.
  KVL_RETURN_IF_ERROR(CheckQueryKeyValue(inputs, &s));
  KVL_RETURN_IF_ERROR(CheckCacheFormat(attrs, inputs, caps, &s));
  KVL_RETURN_IF_ERROR(CheckLengthInputs(attrs, inputs, total_sequence_length, &s));
  KVL_RETURN_IF_ERROR(CheckPastInputs(attrs, inputs, total_sequence_length, &s));
  KVL_RETURN_IF_ERROR(CheckCapacity(attrs, total_sequence_length, &s));
  KVL_RETURN_IF_ERROR(CheckRotaryInputs(attrs, inputs, total_sequence_length, &s));
  KVL_RETURN_IF_ERROR(CheckBiasAndSink(inputs, total_sequence_length, &s));
  KVL_RETURN_IF_ERROR(CheckNormInputs(attrs, inputs, &s));
  s.smooth_softmax = attrs.smooth_softmax == 1;
  s.scale = attrs.scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(s.head_size)) : attrs.scale;
  s.softcap = attrs.softcap > 0.0f ? attrs.softcap : 0.0f;  // <= 0 or NaN: off, as ORT
  s.causal = attrs.causal == 1;
  s.local_window = attrs.local_window_size;
  *out = s;
  return Status::Ok();
}

Status CheckSharedCapacity(const GqaShape& s, bool shared_kv) {
  if (shared_kv && s.total_seq_len > s.past_capacity && !s.sliding_window_cache) {
    return GqaError("input 'total_sequence_length' (", s.total_seq_len,
                    ") exceeds the capacity of the shared past/present buffer (", s.past_capacity,
                    ")");
  }
  return Status::Ok();
}

Status CheckSharing(const GqaBuffers& buf) {
  // Crossed buffers (present_key over past_value, or one buffer for both presents) run without
  // a fault and append each cache's rows into the other's: wrong numbers, silently.
  if ((buf.present_key != nullptr && buf.present_key == buf.past_value) ||
      (buf.present_value != nullptr && buf.present_value == buf.past_key) ||
      (buf.present_key != nullptr && buf.present_key == buf.present_value)) {
    return GqaError("present_key and present_value must be two buffers, each shared with its ",
                    "own past (past_key, past_value) or with none: they are crossed");
  }
  if (buf.past_key != nullptr &&
      (buf.past_key == buf.present_key) != (buf.past_value == buf.present_value)) {
    return GqaError("past_key/present_key and past_value/present_value must either both share ",
                    "memory or both not");
  }
  // PER_TOKEN: a scale cache shares its memory exactly when its KV cache does.
  const bool shared = buf.shared();
  if ((buf.past_key_scale != nullptr && (buf.past_key_scale == buf.present_key_scale) != shared) ||
      (buf.past_value_scale != nullptr &&
       (buf.past_value_scale == buf.present_value_scale) != shared)) {
    return GqaError(
        "past_key_scale/present_key_scale and past_value_scale/present_value_scale must ",
        "share memory exactly when past_key/present_key do (", shared ? "they do" : "they do not",
        ")");
  }
  return Status::Ok();
}

size_t PresentBytes(const GqaShape& s) {
  return static_cast<size_t>(s.batch * s.kv_num_heads * s.present_capacity * s.cache_row) *
         DTypeBytes(s.cache_dtype);
}

Status CheckKvScales(const GqaShape& s, const float* k_scale, const float* v_scale) {
  const struct {
    GqaInput input;
    KvQuant quant;
    const float* data;
  } scales[] = {{GqaInput::kKScale, s.k_quant, k_scale}, {GqaInput::kVScale, s.v_quant, v_scale}};
  for (const auto& sc : scales) {
    if (sc.quant == KvQuant::kNone || sc.quant == KvQuant::kPerToken) continue;
    const int64_t n = sc.quant == KvQuant::kPerTensor ? 1 : s.kv_num_heads * s.head_size;
    for (int64_t i = 0; i < n; ++i) {
      const float v = sc.data[i];
      if (!(std::isfinite(v) && v > 0.0f)) {
        return GqaError(
            "input '", GqaInputName(sc.input), "'[", i, "] = ", v, ": every scale must ",
            "be finite and > 0 (the cache stores round(x / scale), reads code * scale)");
      }
    }
  }
  return Status::Ok();
}

std::string LengthViolationMessage(const LengthViolation& v) {
  std::ostringstream out;
  out << kGqaOp;
  switch (static_cast<LengthRule>(v.rule)) {
    case LengthRule::kNone: return std::string();
    case LengthRule::kSeqlensRange:
      out << "input 'seqlens_k'[" << v.batch << "] = " << v.value << " is out of range: it must "
          << "be in [0, total_sequence_length - 1] = [0, " << v.bound << "]";
      break;
    case LengthRule::kQuerySeqlensRange:
      out << "input 'query_seqlens'[" << v.batch << "] = " << v.value << " is out of range: it "
          << "must be in [0, min(sequence length, seqlens_k + 1)] = [0, " << v.bound << "]";
      break;
    case LengthRule::kSeqlensBelowSeq:
      out << "input 'seqlens_k'[" << v.batch << "] = " << v.value << " is too small: a batch "
          << "entry with past must have seqlens_k + 1 >= the query's sequence length (" << v.bound
          << ")";
      break;
    case LengthRule::kSlidingPadded:
      out << "input 'seqlens_k'[" << v.batch << "] = " << v.value << " is too small for "
          << "sequence length " << v.bound << ": a sliding window cache takes no right-padded "
          << "prompt";
      break;
    case LengthRule::kPastBeyondCapacity:
      out << "input 'seqlens_k'[" << v.batch << "] = " << v.value << " implies a past of " << v.past
          << " tokens, beyond the capacity of 'past_key' (" << v.bound << ")";
      break;
    case LengthRule::kPosition:
      out << (v.from_position_ids ? "input 'position_ids'" : "the implied position")
          << " gives position " << v.value << " for batch " << v.batch << " token " << v.token
          << ", outside 'cos_cache'/'sin_cache' rows [0, " << v.bound << ")";
      break;
    default: out << "length rule " << v.rule << " violated at batch " << v.batch;
  }
  return out.str();
}

Status CheckLengthsOnHost(const GqaShape& s, const int32_t* seqlens_k, const int32_t* query_seqlens,
                          const int64_t* position_ids, bool shared_kv) {
  KVL_RETURN_IF_ERROR(CheckSharedCapacity(s, shared_kv));
  auto query_len = [&](int64_t b) { return s.has_query_seqlens ? query_seqlens[b] : 0; };
  for (int64_t b = 0; b < s.batch; ++b) {
    const LengthViolation v = CheckBatchLengths(s, b, seqlens_k[b], query_len(b));
    if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
      return Status::Error(LengthViolationMessage(v));
    }
  }
  if (s.rotary_dim == 0) return Status::Ok();
  // Every position used to index cos_cache/sin_cache must exist.
  for (int64_t b = 0; b < s.batch; ++b) {
    const BatchGeometry g = GetBatchGeometry(s, seqlens_k[b], query_len(b));
    for (int64_t i = 0; i < RotaryRowsUsed(s, g); ++i) {
      const LengthViolation v =
          CheckRotaryPosition(s, b, i, RotaryPosition(s, g, position_ids, b, i));
      if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
        return Status::Error(LengthViolationMessage(v));
      }
    }
  }
  return Status::Ok();
}

}  // namespace kvl
