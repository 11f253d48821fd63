#include "ort/length_errors.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/check_inputs.h"

namespace kvl {
namespace {

struct Entry {
  LengthRecord* record;
  std::string node_name;
};

// Live records in creation order. The mutex also orders a Run's take against the Python one.
std::mutex g_mutex;
std::vector<Entry>& Records() {
  static auto* records = new std::vector<Entry>();  // never destroyed: kernels may outlive exit
  return *records;
}

// Reads a published record and frees it for the next violation (LengthRecord's protocol).
// Caller holds g_mutex.
bool TakeLocked(LengthRecord* r, LengthViolation* out) {
  const uint32_t written = __atomic_load_n(&r->written, __ATOMIC_ACQUIRE);
  if (written == r->taken) return false;
  std::memcpy(out, &r->violation, sizeof(LengthViolation));
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
  r->taken = written;
  return true;
}

}  // namespace

RegisteredLengthRecord::RegisteredLengthRecord(LengthRecord* record, std::string node_name)
    : record_(record) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Records().push_back(Entry{record, std::move(node_name)});
}

RegisteredLengthRecord::~RegisteredLengthRecord() {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& records = Records();
  records.erase(std::remove_if(records.begin(), records.end(),
                               [this](const Entry& e) { return e.record == record_; }),
                records.end());
}

Status RegisteredLengthRecord::Take() const {
  LengthViolation v;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!TakeLocked(record_, &v)) return Status::Ok();
  }
  return Status::Error(LengthViolationMessage(v) +
                       " (recorded on the GPU by an earlier Run of this node: the CUDA op reads "
                       "lengths on the device and reports them at the node's next Run)");
}

}  // namespace kvl

extern "C" size_t OrtKvlayoutTakeLengthError(char* buffer, size_t size) {
  using namespace kvl;
  std::string message;
  int count = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const Entry& e : Records()) {
      LengthViolation v;
      if (!TakeLocked(e.record, &v)) continue;
      if (count++ == 0) {
        message = LengthViolationMessage(v) + " (recorded on the GPU by node '" + e.node_name + "'";
      }
    }
  }
  if (count == 0) return 0;
  message += count > 1 ? "; " + std::to_string(count) + " nodes recorded a violation)" : ")";
  if (buffer != nullptr && size > 0) {
    const size_t n = std::min(message.size(), size - 1);
    std::memcpy(buffer, message.data(), n);
    buffer[n] = '\0';
  }
  return message.size();
}
