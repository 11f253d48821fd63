// RegisterCustomOps: the library's only exported symbol. ORT calls it from
// SessionOptions::RegisterCustomOpsLibrary with its own OrtApiBase; nothing links libonnxruntime.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <memory>
#include <mutex>
#include <vector>

#include "ort/gqa_cpu_op.h"
#include "ort/sample_op.h"
#if defined(KVL_WITH_CUDA)
#include "ort/gqa_cuda_op.h"
#endif

namespace {

// Domains must outlive every session that uses them; ORT keeps raw pointers.
std::mutex g_mutex;
std::vector<std::unique_ptr<Ort::CustomOpDomain>>& Domains() {
  static auto* domains = new std::vector<std::unique_ptr<Ort::CustomOpDomain>>();
  return *domains;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    // An ORT older than our headers cannot give us its API; no status can be created either.
    return nullptr == api_base ? nullptr
                               : api_base->GetApi(1)->CreateStatus(
                                     ORT_FAIL, "ort_kvlayout needs onnxruntime >= 1.21 (C API 21)");
  }
  Ort::InitApi(api);
  static kvl::GqaCpuOp cpu_op;
  static kvl::SampleCpuOp sample_cpu_op;
#if defined(KVL_WITH_CUDA)
  static kvl::GqaCudaOp cuda_op;
  static kvl::SampleCudaOp sample_cuda_op;
#endif
  try {
    auto domain = std::make_unique<Ort::CustomOpDomain>(kvl::kDomain);
    domain->Add(&cpu_op);
    domain->Add(&sample_cpu_op);
#if defined(KVL_WITH_CUDA)
    domain->Add(&cuda_op);
    domain->Add(&sample_cuda_op);
#endif
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(*domain);
    std::lock_guard<std::mutex> lock(g_mutex);
    Domains().push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return api->CreateStatus(e.GetOrtErrorCode(), e.what());
  }
  return nullptr;
}
