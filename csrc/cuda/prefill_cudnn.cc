// Prefill through cuDNN's fused flash attention (the graph API's SDPA node, through the
// header-only cuDNN frontend). Host code only: cuDNN picks and runs its own Hopper kernels
// (wgmma, TMA); we describe the call to it. The caches are read in place through the layout's
// strides (K and V are (B, Nkv, S, H) views of the (B, Nkv, C, H) caches with KvStrides
// strides, so a seq-major cache needs no transpose), the queries are the prepare kernel's
// rotated copy (B, S, N, H) in the storage type, and the per-entry lengths reach cuDNN as
// device tensors written by the prepare kernel (seq_len_q = new rows, seq_len_kv = total), so
// nothing is read on the host and the launch is valid under CUDA graph capture. The causal mask
// is bottom-right aligned per entry (query row i of entry b sees keys [0, past_b + i]). It
// serves first prompts only (CudnnPrefillCovers says why); chunked prefill takes our kernels.
//
// libcudnn is opened at run time (the frontend's dynamic loading), never linked: the library
// loads and runs its own kernels on machines without cuDNN. A graph is built once per (device,
// shape, strides, scale) and cached; a shape cuDNN refuses is remembered as refused, and the
// call goes to our own kernels (plan.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/knobs.h"
#include "cuda/kernels.h"

#if KVL_HAVE_CUDNN
#include <dlfcn.h>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
// The frontend's dynamic loading resolves every cuDNN call through this handle (set below).
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend
#endif

namespace kvl {
namespace cu {
namespace {
// What cuDNN served in this process (OrtKvlayoutCudnnStatus).
std::atomic<int64_t> g_graphs_built{0}, g_graphs_refused{0}, g_launches{0};
}  // namespace

#if KVL_HAVE_CUDNN
namespace fe = cudnn_frontend;

struct CudnnPrefill {
  std::shared_ptr<fe::graph::Graph> graph;
  size_t workspace_bytes = 0;
};

namespace {

// Tensor uids of the variant pack.
enum : int64_t { kUidQ = 1, kUidK, kUidV, kUidO, kUidSeqQ, kUidSeqKv };

// Opens libcudnn once per process: the copy ORT's CUDA EP already loaded (same soname), else
// the one the loader finds, else ORT_KVLAYOUT_CUDNN_LIBRARY. Returns why it failed, or "".
const std::string& LoadCudnn() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    if (!Knobs().cudnn) {
      error = "disabled by ORT_KVLAYOUT_CUDNN=0";
      return;
    }
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    const std::string& path = Knobs().cudnn_library;
    if (h == nullptr && !path.empty()) h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* why = dlerror();
      error = std::string("libcudnn.so.9 not loadable: ") + (why ? why : "unknown");
      return;
    }
    fe::cudnn_dlhandle = h;
    try {
      const int64_t version = fe::detail::get_backend_version();
      if (version < 90600) {  // per-entry bottom-right causal masks with padding: cuDNN 9.6
        error = "cuDNN " + std::to_string(version) + " is older than 9.6";
      }
    } catch (const std::exception& e) {
      error = std::string("cuDNN unusable: ") + e.what();
    }
  });
  return error;
}

// One cuDNN handle per device, serialized by its mutex (a handle holds the stream it was last
// given). Kept until the process exits: destroying it after the CUDA runtime has shut down
// (static destructors) is not safe.
struct DeviceHandle {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
};

DeviceHandle* HandleFor(int device, Status* status) {
  static std::mutex mutex;
  static std::map<int, DeviceHandle*> handles;
  std::lock_guard<std::mutex> lock(mutex);
  DeviceHandle*& h = handles[device];
  if (h == nullptr) {
    auto fresh = std::make_unique<DeviceHandle>();
    try {
      const cudnnStatus_t st = fe::detail::create_handle(&fresh->handle);
      if (st != CUDNN_STATUS_SUCCESS) {
        *status = Status::Error(std::string("cudnnCreate failed: ") +
                                fe::detail::get_error_string(st));
        return nullptr;
      }
    } catch (const std::exception& e) {
      *status = Status::Error(std::string("cudnnCreate failed: ") + e.what());
      return nullptr;
    }
    h = fresh.release();
  }
  return h;
}

using GraphKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float>;

GraphKey KeyOf(const GqaShape& s, const CudaDeviceInfo& dev, KvStrides st) {
  return GraphKey{dev.device,        static_cast<int>(s.dtype), s.batch,   s.seq_len,
                  s.num_heads,       s.kv_num_heads,            s.head_size, s.present_capacity,
                  st.batch,          st.head,                   st.seq,      s.scale};
}

// The graph of one shape: Q (B, N, S, H) from the prepare kernel's copy, K/V the present
// caches in place, O the op's output (B, S, N * H), lengths per entry on the device.
std::shared_ptr<const CudnnPrefill> Build(const GqaShape& s, KvStrides st, cudnnHandle_t handle,
                                          std::string* why) {
  const int64_t B = s.batch, S = s.seq_len, N = s.num_heads, Nkv = s.kv_num_heads;
  const int64_t H = s.head_size;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(s.dtype == DType::kBFloat16 ? fe::DataType_t::BFLOAT16
                                                  : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::vector<int64_t> q_dim{B, N, S, H}, q_stride{S * N * H, H, N * H, 1};
  auto tensor = [&](const char* name, int64_t uid, std::vector<int64_t> dim,
                    std::vector<int64_t> stride) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim(std::move(dim))
                         .set_stride(std::move(stride)));
  };
  auto q = tensor("Q", kUidQ, q_dim, q_stride);
  // K and V hold S rows (a first prompt: S == total), viewed in the cache of C rows: cuDNN's
  // tile loads zero-fill rows past S instead of reading the cache's later rows, which may hold
  // anything (CudnnPrefillCovers).
  auto k = tensor("K", kUidK, {B, Nkv, S, H}, {st.batch, st.head, st.seq, 1});
  auto v = tensor("V", kUidV, {B, Nkv, S, H}, {st.batch, st.head, st.seq, 1});
  auto seq_q = tensor("seq_q", kUidSeqQ, {B, 1, 1, 1}, {1, 1, 1, 1});
  auto seq_kv = tensor("seq_kv", kUidSeqKv, {B, 1, 1, 1}, {1, 1, 1, 1});
  seq_q->set_data_type(fe::DataType_t::INT32);
  seq_kv->set_data_type(fe::DataType_t::INT32);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("gqa_prefill")
                     .set_generate_stats(false)
                     .set_attn_scale(s.scale)
                     .set_padding_mask(true)
                     .set_seq_len_q(seq_q)
                     .set_seq_len_kv(seq_kv)
                     .set_causal_mask_bottom_right(true);
  auto [o, stats] = g->sdpa(q, k, v, options);
  (void)stats;
  o->set_output(true).set_uid(kUidO).set_dim(q_dim).set_stride(q_stride);

  auto failed = [&](const char* step, fe::error_t e) {
    *why = std::string(step) + ": " + e.get_message();
    return nullptr;
  };
  if (auto e = g->validate(); e.is_bad()) return failed("validate", e);
  if (auto e = g->build_operation_graph(handle); e.is_bad()) return failed("operation graph", e);
  // cuDNN's default heuristic (mode A) and its first plan.
  if (auto e = g->create_execution_plans({fe::HeurMode_t::A}); e.is_bad()) {
    return failed("execution plans", e);
  }
  if (auto e = g->check_support(handle); e.is_bad()) return failed("support", e);
  if (auto e = g->build_plans(handle); e.is_bad()) return failed("build", e);
  int64_t ws = 0;
  if (auto e = g->get_workspace_size(ws); e.is_bad()) return failed("workspace size", e);
  auto built = std::make_shared<CudnnPrefill>();
  built->graph = std::move(g);
  built->workspace_bytes = static_cast<size_t>(ws);
  return built;
}

// Built graphs by shape, least recently used first out beyond kMaxGraphs (a plan holds its
// graph by shared_ptr, so an evicted graph lives until the call using it is done). A null
// entry remembers a shape cuDNN refused.
constexpr size_t kMaxGraphs = 64;
std::mutex g_graph_mutex;
std::list<std::pair<GraphKey, std::shared_ptr<const CudnnPrefill>>> g_graphs;

bool CudnnPrefillCovers(const GqaShape& s, const CudaDeviceInfo& dev) {
  const bool half = s.dtype == DType::kFloat16 || s.dtype == DType::kBFloat16;
  // Features outside this path's graph (bias, softcap, windows, sinks) stay on our kernels.
  // First prompts only: cuDNN's last key tile reads cache rows past an entry's live keys (a
  // masked score, but P x V still multiplies those rows), and in chunked prefill those rows lie
  // below the total length (ragged batches) or past it, in a buffer that may hold anything:
  // NaN or Inf there made the output NaN (H200, test_nonfinite_rows_past_the_live_keys_do_not_
  // leak). Our kernels zero-fill rows past each entry's length.
  return half && dev.cc_major >= 9 && s.is_first_prompt() && s.causal && s.local_window < 0 &&
         !s.sliding_window_cache &&
         s.softcap == 0.0f && !s.has_attention_bias && !s.has_head_sink && !s.smooth_softmax &&
         s.head_size % 8 == 0 && s.head_size <= 256;
}

}  // namespace

std::shared_ptr<const CudnnPrefill> FindCudnnPrefill(const GqaShape& s, const CudaDeviceInfo& dev,
                                                     KvStrides present_st) {
  if (!CudnnPrefillCovers(s, dev) || !LoadCudnn().empty()) return nullptr;
  const GraphKey key = KeyOf(s, dev, present_st);
  std::lock_guard<std::mutex> lock(g_graph_mutex);
  for (auto it = g_graphs.begin(); it != g_graphs.end(); ++it) {
    if (it->first == key) {
      g_graphs.splice(g_graphs.end(), g_graphs, it);  // most recently used last
      return g_graphs.back().second;
    }
  }
  Status status = Status::Ok();
  DeviceHandle* h = HandleFor(dev.device, &status);
  std::shared_ptr<const CudnnPrefill> built;
  if (h != nullptr) {
    std::lock_guard<std::mutex> handle_lock(h->mutex);
    std::string why;
    try {
      built = Build(s, present_st, h->handle, &why);
    } catch (const std::exception& e) {
      built = nullptr;
      why = e.what();
    }
    if (built == nullptr && Knobs().cudnn_verbose) {
      std::fprintf(stderr, "ort_kvlayout: cuDNN refused prefill B=%lld S=%lld C=%lld: %s\n",
                   static_cast<long long>(s.batch), static_cast<long long>(s.seq_len),
                   static_cast<long long>(s.present_capacity), why.c_str());
    }
  } else if (Knobs().cudnn_verbose) {
    std::fprintf(stderr, "ort_kvlayout: %s\n", status.message().c_str());
  }
  (built != nullptr ? g_graphs_built : g_graphs_refused).fetch_add(1);
  g_graphs.emplace_back(key, built);
  if (g_graphs.size() > kMaxGraphs) g_graphs.pop_front();
  return built;
}

size_t CudnnPrefillWorkspaceBytes(const CudnnPrefill& prefill) { return prefill.workspace_bytes; }

Status LaunchCudnnPrefill(const CudnnPrefill& prefill, const CudaDeviceInfo& dev,
                          const GqaCudaBuffers& buf, const Workspace& ws, cudaStream_t stream) {
  Status status = Status::Ok();
  DeviceHandle* h = HandleFor(dev.device, &status);
  if (h == nullptr) return status;
  std::unordered_map<int64_t, void*> pack{
      {kUidQ, ws.q_storage},        {kUidK, buf.present_key},      {kUidV, buf.present_value},
      {kUidO, buf.output},          {kUidSeqQ, ws.seq_len_q},      {kUidSeqKv, ws.seq_len_kv}};
  std::lock_guard<std::mutex> lock(h->mutex);
  try {
    const cudnnStatus_t st = fe::detail::set_stream(h->handle, stream);
    if (st != CUDNN_STATUS_SUCCESS) {
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): cudnnSetStream: ") +
                           fe::detail::get_error_string(st));
    }
    fe::error_t e = prefill.graph->execute(h->handle, pack, ws.cudnn);
    if (e.is_bad()) {
      return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): cuDNN attention: " +
                           e.get_message());
    }
    g_launches.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): cuDNN: ") + e.what());
  }
  return Status::Ok();
}

std::string CudnnStatus() {
  const std::string& error = LoadCudnn();
  if (!error.empty()) return "unavailable (" + error + ")";
  return "cuDNN " + std::to_string(fe::detail::get_backend_version());
}

#else  // built without the cuDNN headers: every call stays on our own kernels

struct CudnnPrefill {};

std::shared_ptr<const CudnnPrefill> FindCudnnPrefill(const GqaShape&, const CudaDeviceInfo&,
                                                     KvStrides) {
  return nullptr;
}

size_t CudnnPrefillWorkspaceBytes(const CudnnPrefill&) { return 0; }

Status LaunchCudnnPrefill(const CudnnPrefill&, const CudaDeviceInfo&, const GqaCudaBuffers&,
                          const Workspace&, cudaStream_t) {
  return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): built without cuDNN");
}

std::string CudnnStatus() { return "not built (no cuDNN headers at build time)"; }

#endif

}  // namespace cu
}  // namespace kvl

// "cuDNN <version>: graphs built B, refused R, launches L", or why cuDNN does not serve
// (python: ort_kvlayout.cudnn_status()). Returns the message length; copies what fits.
extern "C" __attribute__((visibility("default"))) size_t OrtKvlayoutCudnnStatus(char* buffer,
                                                                                 size_t size) {
  using namespace kvl::cu;
  const std::string message = CudnnStatus() + ": graphs built " +
                              std::to_string(g_graphs_built.load()) + ", refused " +
                              std::to_string(g_graphs_refused.load()) + ", launches " +
                              std::to_string(g_launches.load());
  if (buffer != nullptr && size > 0) {
    const size_t n = std::min(message.size(), size - 1);
    std::memcpy(buffer, message.data(), n);
    buffer[n] = '\0';
  }
  return message.size();
}
