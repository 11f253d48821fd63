// The CPU kernels at one CPU level: compiled once per level (CMakeLists.txt, isa_level.h says
// how), each copy in its own namespace; RunGqaCpu (gqa_cpu_dispatch.cc) calls the copy chosen for
// the process. Run, below, builds a call's Call<T> and runs its phases as tasks on the thread
// pool. The kernels are headers by concern, each compiled at the level only here:
//   simd.h            float32 vectors of the level, lane sums, exp, softcap
//   gqa_call.h        Call<T> (what every task reads), the tiling, task indices
//   row_io.h          T rows and quantized cache rows to float32 and back
//   prepare_tasks.h   queries and new K/V rows prepared, past rows copied, sliding present
//   score_kernels.h   the micro-kernels: scores of a row block over a tile, V rows weighted in
//   attention_rows.h  the online softmax of a row block over a tile
//   attention_task.h  one attention task: rows, tiles, outputs; MergeSplits
#include "cpu/gqa_cpu.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/check_inputs.h"
#include "core/dtype.h"
#include "core/kv_strides.h"
#include "cpu/attention_task.h"
#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/prepare_tasks.h"

KVL_ISA_BEGIN

// The buffers a call owns while it runs (Call<T> points into them).
struct CallBuffers {
  std::vector<float> q_scaled, part_o, part_m, part_l;
  std::vector<uint8_t> new_k, new_v;
  std::vector<float> new_k_scale, new_v_scale;
  std::vector<float> inv_scales[2];
};

// The scales of a quantized cache: static scales' inverses, computed once as ORT does
// (quantizing multiplies by them), or PER_TOKEN's scale caches and a sliding window's new rows'
// scales.
template <typename T>
void SetCacheScales(Call<T>& c, CallBuffers& cb) {
  const GqaShape& s = c.s;
  const GqaCpuBuffers& buf = c.buf;
  const KvQuant quant[2] = {s.k_quant, s.v_quant};
  for (int which = 0; which < 2 && s.quantized() && !s.per_token(); ++which) {
    const int64_t n = quant[which] == KvQuant::kPerChannel ? s.kv_num_heads * s.head_size : 1;
    for (int64_t i = 0; i < n; ++i) {
      cb.inv_scales[which].push_back(QuantInverseScale(c.scale[which][i]));
    }
    c.inv_scale[which] = cb.inv_scales[which].data();
    c.scale_pitch[which] = quant[which] == KvQuant::kPerChannel ? s.head_size : 0;
  }
  if (!s.per_token()) return;
  c.past_scale[0] = buf.past_key_scale;
  c.past_scale[1] = buf.past_value_scale;
  c.present_scale[0] = buf.present_key_scale;
  c.present_scale[1] = buf.present_value_scale;
  c.past_scale_strides = MakeKvScaleStrides(s.layout, s.kv_num_heads, s.past_capacity);
  c.present_scale_strides = MakeKvScaleStrides(s.layout, s.kv_num_heads, s.present_capacity);
  c.new_scale[0] = &cb.new_k_scale;
  c.new_scale[1] = &cb.new_v_scale;
  c.qmax = PerTokenQMax(s.kv_bits, s.fp8_cache());
  if (s.sliding_window_cache) {
    cb.new_k_scale.resize(static_cast<size_t>(s.batch * s.kv_num_heads * s.seq_len));
    cb.new_v_scale.resize(cb.new_k_scale.size());
  }
}

// The attention's task grid. Query blocks give a prefill enough rows to reuse each K/V tile; key
// splits give a decode (one query block) enough tasks to use every thread. The grid depends on
// sizes and thread count only, so results are deterministic for a given machine. Returns the
// number of tasks without the key splits.
template <typename T>
int64_t PlanAttention(Call<T>& c, CallBuffers& cb, const Parallel& parallel) {
  const GqaShape& s = c.s;
  const int64_t G = s.group_size();
  // ~256 rows per task amortize the K tile's transposition (S=2048 32/8/128: 0.86x -> 0.94x
  // of ORT against 128 rows); fewer when that starves threads.
  const int64_t want = 4 * static_cast<int64_t>(parallel.NumThreads());
  c.q_block = std::min(s.seq_len, std::max<int64_t>(1, 256 / G));
  while (c.q_block > 1 &&
         s.batch * s.kv_num_heads * ((s.seq_len + c.q_block - 1) / c.q_block) < want) {
    c.q_block /= 2;
  }
  c.num_q_blocks = (s.seq_len + c.q_block - 1) / c.q_block;
  // Token generation: micro-blocks of a head's query rows when it has <= 4 (1 to 4 rows: no
  // padding rows, whose FMAs and score sums a 4-row block paid for at G = 3, 2 or 1), and,
  // when a token's heads are adjacent in the cache (seq-major), one task over all of them so
  // the cache streams in address order; key splits then provide the parallelism.
  const bool decode_like = c.q_block * G <= kRowBlock;
  c.row_block = c.q_block * G <= 4 ? c.q_block * G : kRowBlock;
  const bool heads_adjacent = c.present_strides.head == s.cache_row && !s.sliding_window_cache;
  c.group_heads = decode_like && heads_adjacent ? s.kv_num_heads : 1;
  c.num_groups = s.kv_num_heads / c.group_heads;
  const int64_t base_tasks = s.batch * c.num_groups * c.num_q_blocks;
  const int64_t max_splits = std::max<int64_t>(1, s.total_seq_len / (4 * kTileKeys));
  c.num_splits =
      base_tasks >= want ? 1 : std::min(max_splits, (want + base_tasks - 1) / base_tasks);
  c.split_keys = RoundUp((s.total_seq_len + c.num_splits - 1) / c.num_splits, kTileKeys);
  if (c.num_splits > 1) {
    const int64_t slots = base_tasks * c.num_splits * c.rows_per_task();
    cb.part_o.assign(static_cast<size_t>(slots * c.head_pad), 0.0f);
    cb.part_m.assign(static_cast<size_t>(slots), -std::numeric_limits<float>::infinity());
    cb.part_l.assign(static_cast<size_t>(slots), 0.0f);
  }
  return base_tasks;
}

template <typename T>
Status Run(const GqaShape& s, const GqaCpuBuffers& buf, const Parallel& parallel) {
  CallBuffers cb;
  KVL_RETURN_IF_ERROR(CheckSharing(buf));
  const size_t cache_elem = s.quantized() ? 1 : sizeof(T);
  Call<T> c{s, buf, {}, {}, cache_elem, static_cast<size_t>(s.cache_row) * cache_elem,
            {buf.k_scale, buf.v_scale}, {}, {},
            RoundUp(s.head_size, kDimStep), cb.q_scaled, 1, 1, 1, 1, 1, 1, 1,
            &cb.part_o, &cb.part_m, &cb.part_l, &cb.new_k, &cb.new_v};
  c.past_strides = MakeKvStrides(s.layout, s.kv_num_heads, s.past_capacity, s.cache_row);
  c.present_strides = MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, s.cache_row);
  SetCacheScales(c, cb);
  cb.q_scaled.assign(static_cast<size_t>(s.batch * s.num_heads * s.seq_len * c.head_pad), 0.0f);

  const size_t kv_tasks = static_cast<size_t>(s.batch * s.kv_num_heads);
  if (s.sliding_window_cache) {
    const size_t rows = static_cast<size_t>(s.batch * s.kv_num_heads * s.seq_len) * c.row_bytes;
    cb.new_k.resize(rows);
    cb.new_v.resize(rows);
  } else if (!buf.shared()) {
    // 1. Past rows into a separate present (the new rows, written next, never overlap them).
    parallel.For(kv_tasks, CopyPast<T>, &c);
  }
  // A first prompt ignores past content: CopyPast copied nothing (past length 0).
  // 2. Queries normed/rotated/scaled; new K/V rows normed/rotated into present.
  parallel.For(static_cast<size_t>(s.batch * s.seq_len), PrepareToken<T>, &c);
  // 3. Attention, then the key splits merged.
  const int64_t base_tasks = PlanAttention(c, cb, parallel);
  parallel.For(static_cast<size_t>(base_tasks * c.num_splits), AttentionTask<T>, &c);
  if (c.num_splits > 1) parallel.For(static_cast<size_t>(base_tasks), MergeSplits<T>, &c);
  // 4. A sliding window cache's present, once the attention no longer reads the past.
  if (s.sliding_window_cache) parallel.For(kv_tasks, WriteSlidingPresent<T>, &c);
  return Status::Ok();
}

KVL_ISA_END

// The level's entry point (gqa_cpu.h), compiled at the level too.
KVL_ISA_TARGET_PUSH
namespace kvl {
namespace KVL_ISA_NS {

Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel) {
  switch (shape.dtype) {
    case DType::kFloat32: return Run<float>(shape, buffers, parallel);
    case DType::kFloat16: return Run<Half>(shape, buffers, parallel);
    case DType::kBFloat16: return Run<BFloat16>(shape, buffers, parallel);
    default:
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention: unsupported type ") +
                           DTypeName(shape.dtype));
  }
}

}  // namespace KVL_ISA_NS
}  // namespace kvl
KVL_ISA_TARGET_POP
