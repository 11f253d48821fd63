// The decode CTA's prologue: its indices, the lengths and the key partition (Partition), then
// the first steps' loads, the append of the new K/V rows and the query fragments (Prologue).
// Everything here is on every CTA's path to its first key, which at B=1 is most of the call:
// the order of the source is the order of the issue (a warp issues in order).
#pragma once

#include "cuda/decode_cta.cuh"

namespace kvl {
namespace cu {

template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::Begin() {
  // The XOR address forms need the tiles on 128-byte boundaries (an invariant of the build:
  // dec_smem's alignment, so never taken).
  if (DecSwizzled(HD) && (ptx::SharedAddress(dec_smem) & 127u) != 0) __trap();
  trace.Start();
  prologue_trace.Start();
  Gi = static_cast<int>(s.num_heads) / static_cast<int>(s.kv_num_heads);
  H = s.head_size;
  G = Gi;
  N = s.num_heads;
  nkv = static_cast<int>(s.kv_num_heads);
  rows = kPack ? nkv * G : s.seq_len * G;
  bg = blockIdx.y;
  b = kPack ? bg : int(blockIdx.y) / nkv;
  g = kPack ? 0 : int(blockIdx.y) % nkv;
  inv_g = __frcp_rn(static_cast<float>(Gi));
  split = blockIdx.x;
  lane = threadIdx.x % kWarp;
  warp = threadIdx.x / kWarp;
  gq = lane / 4;
  tq = lane % 4;
  wsm = reinterpret_cast<T*>(dec_smem) + size_t(warp) * ST * DecSlotElems(HD);
  x = reinterpret_cast<float*>(wsm + ST * DecSlotElems(HD)) - HD;
  q_raw = x - QR * HD;
  q_tile = reinterpret_cast<T*>(dec_smem) + (ST - 1) * DecSlotElems(HD);
}

// The lengths first in the source (every later step waits on them; LoadNow, common.cuh), then
// the raw queries of this warp's rows (r = warp + W j), whose addresses do not depend on them,
// kept raw in registers: the partition and the first steps' copies go out before anything waits
// on a query (a conversion or store of a query value here held up the whole prologue until the
// query loads landed). Then this split's share of the live keys, partitioned here from the
// lengths on the device. False: the CTA has no keys and leaves.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::Partition() {
  const EntryLengths lengths = ReadLengths<true>(s, buf, b);
  prologue_trace.Mark(lengths.seqlens_k);  // the lengths landed
#pragma unroll
  for (int j = 0; j < QR; ++j) {
    // Row 0's address for rows past S x G (never read): no branch around the address
    // arithmetic, whose block boundaries let the compiler sink the lengths load below them.
    const int r = warp + j * kDecWarps, rr = r < rows ? r : 0;
    const T* src = TokenInputs<T>(s, buf, b, RowTok(rr)).q + RowHead(rr) * H;
#pragma unroll
    for (int e = 0; e < QE; ++e) {
      const int64_t d = lane + e * kWarp;
      qv[j][e] = r < rows && d < H ? src[d] : FromF<T>(0.0f);
    }
  }
  if constexpr (kQuant) {  // the static scales on their way to L1 before the first steps' copies
    if (scales_early) PrefetchKvScales<HD>(s, buf, static_cast<int>(g), threadIdx.x);
  }
  geo = ClampedBatchGeometry(s, lengths.seqlens_k, lengths.query_len);

  // Keys any row needs (rows of one token share a range), then this split's share of them.
  key_lo = INT64_MAX;
  key_hi = 0;
  for (int64_t tok = 0; tok < s.seq_len; ++tok) {
    const KeyRange kr = QueryKeyRange(s, geo, tok);
    if (kr.lo < kr.hi) {
      key_lo = min(key_lo, kr.lo);
      key_hi = max(key_hi, kr.hi);
    }
  }
  k_begin = 0;
  k_end = 0;
  chunk = 1;
  if (key_lo < key_hi) {
    // In 32 bits (SplitChunk): live keys number at most 2^31 (int32 lengths), targets 256.
    using U = uint32_t;
    const U keys = static_cast<U>(key_hi - key_lo);
    const U target = DecodeMergeTree::SplitTarget<U>(split_target, keys, rows, H);
    chunk = SplitChunk<U>(keys, target, KS, kMinDecodeSplitKeys);
    k_begin = min(key_hi, key_lo + split * chunk);
    k_end = min(key_hi, k_begin + chunk);
  }
  // The splits that hold live keys are a prefix of the grid, the same in every CTA of the row
  // (the partition follows the live length; the capacity only sized the grid). Split 0 always
  // counts, so a row without live keys is still written. The others have no keys, no new row to
  // append (a row's owner holds its key) and a partial that would weigh exactly 0 in every
  // merge: they leave now, and the merges take the live prefix only (the same bits: an empty
  // partial adds nothing). With a large cache and a short sequence, most of the grid.
  // At most the launched splits (the plan sizes the grid for the most keys a row can hold):
  // clamped all the same, since a count above the grid would leave a counter kept across calls
  // non-zero and every later merge on the stream early.
  live = min(splits, key_lo < key_hi
                         ? int64_t(uint32_t(key_hi - key_lo + chunk - 1) / uint32_t(chunk))
                         : int64_t(1));
  extra = s.has_head_sink || s.smooth_softmax;
  prologue_trace.Mark(k_end ^ live);  // the partition known
  if constexpr (kDecodeTrace) {       // the case each trace line names
    const int64_t live_keys = key_lo < key_hi ? key_hi - key_lo : 0;
    trace.Case(static_cast<int>(H), rows, live_keys, s.batch * s.kv_num_heads);
    prologue_trace.Case(static_cast<int>(H), rows, live_keys, s.batch * s.kv_num_heads);
  }
  KVL_DECODE_STOP_AFTER(1, (k_begin ^ k_end ^ live) == 0x5a5a5a5a)
  // In a cluster too: a CTA that exits no longer holds up the cluster's barriers.
  return split < live;
}

// Issues the copies of this warp's i-th step into its stage slot.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::Issue(int64_t i) {
  if constexpr (kQuant) {
    IssueQuant(i);
    return;
  }
  T* ks = StepSlot(i);
  T* vs = ks + KS * P;
  const int64_t k0 = StepKey(i);  // < k_end: a row of the cache
  const T* kstep = pk + (k0 - geo.cache_base) * seq_stride;
  const T* vstep = pv + (k0 - geo.cache_base) * seq_stride;
  const int rows_here = static_cast<int>(min(int64_t(KS), k_end - k0));
  // Every step but a split's last holds KS rows: its copies need no row test, zero-fill operand
  // or select, and their offsets from the lane's first copy are compile-time for the shared side
  // and one multiply-add for the global side (the predicated form below cost about 11
  // instructions per 16-byte copy).
  if (kWarp % CPR == 0 && rows_here == KS) {
    // A lane copies chunk c = lane % CPR of rows lane / CPR + R it: one pointer per tensor,
    // advanced by R rows per copy (head sizes 32, 64, 128, 256; the others take the general
    // form below).
    constexpr int R = kWarp % CPR == 0 ? kWarp / CPR : 1;  // rows per warp-wide copy
    const int c = lane % CPR, j0 = lane / CPR;
    if constexpr (DecSwizzled(HD)) {
      // Swizzled tiles: a lane copies chunk c of RL consecutive rows from j0 RL on (RL is a
      // multiple of 8, so row j0 RL + it's chunk c lands at position c ^ it % 8: it known at
      // compile time, one XOR per copy); a warp-wide copy reads R rows RL apart, each whole.
      // Every tile starts on a 128-byte boundary and a row is a whole number of 128-byte lines,
      // so bits 4-6 of a chunk's address are its chunk index mod 8.
      constexpr int RL = KS / R;
      static_assert(RL % 8 == 0, "rows per lane: whole swizzle periods");
      const int jb = j0 * RL;  // the lane's first row
      if (c < chunks) {
        const T* kg = kstep + jb * seq_stride + c * 8;
        const T* vg = vstep + jb * seq_stride + c * 8;
        const unsigned ka = ptx::SharedAddress(ks + jb * HD + c * 8);  // bits 4-6: c
#pragma unroll
        for (int it = 0; it < RL; ++it) {
          const unsigned a = (ka ^ unsigned((it & 7) << 4)) + unsigned(it * HD * 2);
          ptx::CpAsync16At(a, kg + it * seq_stride);
          ptx::CpAsync16At(a + unsigned(KS * P * 2), vg + it * seq_stride);
        }
      }
      return;
    }
    if (c < chunks) {
      const T* kg = kstep + j0 * seq_stride + c * 8;
      const T* vg = vstep + j0 * seq_stride + c * 8;
      const int64_t step_r = R * seq_stride;
      // V through kd + KS * P (vs's offset as an immediate), not a second pointer: one more
      // live register spilled at head size 128.
      T* kd = ks + j0 * P + c * 8;
#pragma unroll
      for (int it = 0; it < KS / R; ++it) {
        ptx::CpAsync16(kd + it * R * P, kg + it * step_r);
        ptx::CpAsync16(kd + KS * P + it * R * P, vg + it * step_r);
      }
    }
    return;
  }
#pragma unroll
  for (int it = 0; it < kCopies; ++it) {
    const int idx = lane + it * kWarp, j = idx / CPR, c = idx % CPR;  // compile-time divisor
    if (idx >= KS * CPR || c >= chunks) continue;
    const bool valid = j < rows_here;  // past the split's end: zero rows (row k0 is read)
    const int32_t off = valid ? j * stride32 + c * 8 : 0;
    ptx::CpAsync16(ks + DecKvAt<HD>(j, c * 8), kstep + off, valid);
    ptx::CpAsync16(vs + DecKvAt<HD>(j, c * 8), vstep + off, valid);
  }
}

// Issues the copies of this warp's i-th step of a quantized cache: the raw codes of KS rows of K
// and of V, zeros past the split's end (their keys are masked; zero bytes are finite codes).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::IssueQuant(int64_t i) {
  unsigned char* kt = reinterpret_cast<unsigned char*>(StepSlot(i));
  unsigned char* vt = kt + KST * P * sizeof(T);
  const int64_t k0 = StepKey(i);  // < k_end: a row of the cache
  const unsigned char* kstep = code_k + (k0 - geo.cache_base) * seq_stride;
  const unsigned char* vstep = code_v + (k0 - geo.cache_base) * seq_stride;
  const int rows_here = static_cast<int>(min(int64_t(KS), k_end - k0));
  static_assert((KS * QCR) % kWarp == 0, "whole warp-wide copies");
  // Iteration it copies chunk lane % QCR of row lane / QCR + RPI it (QLaneAt: of octet
  // it / IPO, at a lane offset set once), at this lane's source offset plus it RPI rows.
  constexpr int RPI = kWarp / QCR, IPO = QLaneAt ? 8 / RPI : 1;
  const int r0 = lane / QCR;
  const int32_t src0 = r0 * stride32 + (lane % QCR) * 16;
#pragma unroll
  for (int it = 0; it < KS * QCR / kWarp; ++it) {
    const bool valid = r0 + it * RPI < rows_here;
    const uint32_t off = valid ? uint32_t(src0 + it * RPI * stride32) : 0u;
    const int at = QLaneAt ? (it / IPO) * QLS + qc_at[it % IPO]
                           : DecQuantAt<QCR>(r0 + it * RPI, lane % QCR);
    ptx::CpAsync16(kt + at, kstep + off, valid);
    ptx::CpAsync16(vt + at, vstep + off, valid);
  }
  if (s.per_token()) {  // the keys' scales beside the codes (0 past the split's end)
    const int64_t first = (k0 - geo.cache_base) * tok_stride;
#pragma unroll
    for (int it = 0; it < (KS + kWarp - 1) / kWarp; ++it) {
      const int j = lane + it * kWarp;
      if (j < KS) {
        const bool valid = j < rows_here;
        const int64_t at = valid ? first + int64_t(j) * tok_stride : 0;
        ptx::CpAsync4(kt + kQuantScaleAt + 4 * j, tok_k + at, valid);
        ptx::CpAsync4(vt + kQuantScaleAt + 4 * j, tok_v + at, valid);
      }
    }
  }
}

// A quantized cache: the head dimension of k-step kk's B register `reg` (b0, b1), value `half`
// (low, high), for this lane (tq). A lane reads QKB bytes of a key row in vectors of QKV bytes,
// vector v at byte (4 v + tq) QKV; each 32-bit word of it is one k-step of int8 codes (pairs
// (0, 1), (2, 3)) or two of int4 codes (pairs (0, 4), (1, 5), then (2, 6), (3, 7): Int4x8ToPairs).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ int DecodeCta<T, HD, kForm, W, C>::QuantKDim(int kk, int reg,
                                                                        int half) const {
  constexpr int WPV = QKV / 4;  // words per vector
  const int ki = QBITS == 8 ? kk : kk / 2;
  const int o = ((ki / WPV) * 4 + tq) * QKV + 4 * (ki % WPV);  // the word's byte in the row
  if constexpr (QBITS == 8) return o + 2 * reg + half;
  return 2 * o + 2 * (kk % 2) + reg + 4 * half;
}

// Whether this CTA appends new row i: the CTA whose split reads it (split 0 takes the rows no
// split reads, a first prompt's padding), found without a division on the path.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::Appends(int64_t i) const {
  const int64_t p = geo.past + i;
  return (key_lo <= p && p < key_hi) ? (k_begin <= p && p < k_end) : split == 0;
}

// The first steps' loads, the new K/V rows appended, the query tile and its fragments. The new
// rows (positions past + i) are appended by the CTA whose split reads them; the other CTAs never
// read them. That CTA first issues the steps that read old rows only, then appends and waits
// for every warp's rows, then issues the rest: only the loads of new rows wait.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::Prologue() {
  steps = (k_end - k_begin + KS - 1) / KS;  // of the CTA; warp w takes w, w+W, ...
  my_steps = steps > warp ? (steps - warp + kDecWarps - 1) / kDecWarps : 0;
  // Rows of this (batch, kv head): key j at base + (j - cache_base) * seq stride, in either
  // layout (cache_base: 0 unless a sliding window cache stages the rows, sliding.cu).
  pk = static_cast<const T*>(buf.present_key) + present_st.Offset(b, g, 0);
  pv = static_cast<const T*>(buf.present_value) + present_st.Offset(b, g, 0);
  if constexpr (kQuant) {  // strides in bytes (codes or packed int4 pairs)
    code_k = static_cast<const unsigned char*>(buf.present_key) + present_st.Offset(b, g, 0);
    code_v = static_cast<const unsigned char*>(buf.present_value) + present_st.Offset(b, g, 0);
    if (s.per_token()) {  // scale (b, g, j) at the cache row's offset / CacheRow (ScaleIndex)
      tok_k = buf.present_key_scale + ScaleIndex(s, present_st.Offset(b, g, 0));
      tok_v = buf.present_value_scale + ScaleIndex(s, present_st.Offset(b, g, 0));
      tok_stride = static_cast<int32_t>(ScaleIndex(s, present_st.seq));
    }
    if constexpr (QLaneAt) {  // IssueQuant's: rows lane / QCR + RPI o1, chunk lane % QCR
#pragma unroll
      for (int o1 = 0; o1 < QCR / 4; ++o1) {
        qc_at[o1] = DecQuantAt<QCR>(lane / QCR + o1 * (kWarp / QCR), lane % QCR);
      }
    }
  }
  seq_stride = present_st.seq;
  row_width = kPack ? nkv * H : H;               // elements of a stage row (packed: HD)
  chunks = static_cast<int>(row_width / 8);      // 16-byte chunks of a row (H % 8 == 0)
  // Offsets inside a step in 32 bits: KS rows x the seq stride (<= kv heads x H, bounded by
  // CheckCudaSupport) fit, and the issue is on every step's path (64-bit offset math was a third
  // of a short split's instructions).
  stride32 = static_cast<int32_t>(seq_stride);

  const int64_t written = WrittenRows(s, geo);
  appended = false;
  for (int64_t i = 0; i < written && !appended; ++i) appended = Appends(i);
  // The appending CTA loads each warp's first new (token, kv head) rows now, raw, every slice at
  // once: they land while the first steps go out and the queries are stored (loaded slice by
  // slice in the append, they made that CTA the last of its merge at B = 1: prepare_rows.cuh).
  const int nh = kPack ? nkv : 1;  // kv heads a CTA appends
  const int64_t first_i = kPack ? warp / nh : warp;
  NewKvRow<T, KE> first_row;
  if (appended && first_i < written) {
    first_row.Load(s, buf, b, first_i, kPack ? warp % nh : g, lane);
  }
  auto reads_new_rows = [&](int i) { return appended && min(StepKey(i) + KS, k_end) > geo.past; };
  int issued = 0;  // the first ST - 1 steps, each its own group (empty ones too: the wait
                   // below counts groups)
  for (; issued < ST - 1 && issued < my_steps && !reads_new_rows(issued); ++issued) {
    Issue(issued);
    ptx::CpAsyncCommit();
  }
  // The raw queries to the warp's scratch rows: the first wait on their loads, now behind the
  // first steps' copies.
#pragma unroll
  for (int j = 0; j < QR; ++j) {
#pragma unroll
    for (int e = 0; e < QE; ++e) q_raw[j * HD + lane + e * kWarp] = ToF(qv[j][e]);
  }
  if (appended) {
    // Packed: the rows of every kv head, one (token, head) per warp in turn; the warp's first
    // was loaded above.
    for (int64_t ih = warp; ih < written * nh; ih += kDecWarps) {
      const int64_t i = kPack ? ih / nh : ih, hk = kPack ? ih % nh : g;
      if (!Appends(i)) continue;
      NewKvRow<T, KE> row = first_row;
      if (ih != warp) row.Load(s, buf, b, i, hk, lane);
      AppendKvRow<T, C>(s, buf, present_st, geo, b, i, hk,
                        ClampedRotaryPosition(s, buf, geo, b, i), row, x, lane);
    }
    __syncthreads();  // every warp's rows before any warp's copies read them
  }
  for (; issued < ST - 1; ++issued) {
    if (issued < my_steps) Issue(issued);
    ptx::CpAsyncCommit();
  }
  prologue_trace.Mark();  // the first steps issued (after the append, in the appending CTA)

  // The queries, while the first steps load: row r (token r / G, head g * G + r % G) normed,
  // rotated and scaled, rounded to T into the query tile (zeros past H, past S x G rows and for
  // tokens past query_seqlens, which are never read), then as A fragments in registers for the
  // whole kernel: rows gq and gq + 8.
#pragma unroll
  for (int j = 0; j < QR; ++j) {
    const int r = warp + j * kDecWarps;
    const int64_t tok = RowTok(r);
    T* qt = q_tile + r * P;
    if (r < rows && (s.is_first_prompt() || tok < geo.new_rows)) {
      float* qr = q_raw + j * HD;  // the warp's own row: normed and rotated in place
      __syncwarp();                // every lane's raw values before rotary pairs cross lanes
      NormRotate<T>(s, buf, true, ClampedRotaryPosition(s, buf, geo, b, tok), qr, lane);
      if constexpr (kQuant) {  // K's static scales folded into the query (H == HD)
        const bool token = s.per_token();  // PER_TOKEN: the scores take them (StepQuant)
        for (int64_t d = lane; d < SH; d += kWarp) {
          const float ks = token ? 1.0f : ChannelScale(buf.k_scale, s.k_quant, H, g, d);
          qt[d] = FromF<T>(qr[d] * s.scale * ks);
        }
      } else {
        for (int64_t d = lane; d < SH; d += kWarp) qt[d] = FromF<T>(d < H ? qr[d] * s.scale : 0.0f);
      }
    } else {
      for (int64_t d = lane; d < SH; d += kWarp) qt[d] = FromF<T>(0.0f);
    }
  }
  __syncthreads();
  if constexpr (kQuant) {  // the columns in the order of the lane's key codes (QuantKDim)
#pragma unroll
    for (int kk = 0; kk < KTQ; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const T* qrow = q_tile + (gq + (e % 2) * 8) * P;
        qa[kk][e] = ptx::PackPair<T>(ToF(qrow[QuantKDim(kk, e / 2, 0)]),
                                     ToF(qrow[QuantKDim(kk, e / 2, 1)]));
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < KTQ; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = kk * 16 + (e / 2) * 8 + 2 * tq;
        qa[kk][e] = *reinterpret_cast<const uint32_t*>(q_tile + (gq + (e % 2) * 8) * P + d);
      }
    }
  }
  __syncthreads();  // every warp holds its fragments: warp 0's free slot may take a step
  prologue_trace.Mark();  // the query tile in every warp's fragments
  KVL_DECODE_STOP_AFTER(2, qa[0][0] == 0x5a5a5a5au && qa[KTQ - 1][3] == 0xa5a5a5a5u)
  return true;
}

}  // namespace cu
}  // namespace kvl
