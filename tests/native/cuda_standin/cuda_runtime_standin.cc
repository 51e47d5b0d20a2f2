// The host stand-in for the CUDA runtime (see cuda_runtime_api.h), and LaunchAdd of
// xla_ffi/cuda/cuda_kernels.h (cuda_kernels.cu's kernel) as a host loop run on the stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "cuda/cuda_kernels.h"

struct CUstream_st {
  std::vector<std::function<void()>> queued;
};

namespace {

constexpr unsigned char kPoison = 0xA5;  // what cudaMalloc and cudaHostAlloc memory starts as
constexpr size_t kAlignment = 256;       // as cudaMalloc's

using Ranges = std::map<uintptr_t, size_t>;  // base -> bytes

struct State {
  std::recursive_mutex mu;
  Ranges device, pinned, registered;
  std::set<CUstream_st*> streams;
  CUstream_st legacy;  // the default stream (a null cudaStream_t)
  cudaError_t last_error = cudaSuccess;
  cuda_standin::Stats stats;
};

State& Global() {
  static State* state = new State();
  return *state;
}

bool Within(const Ranges& ranges, const void* ptr, size_t bytes) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto it = ranges.upper_bound(p);
  if (it == ranges.begin()) return false;
  --it;
  return p + bytes <= it->first + it->second;
}

bool Overlaps(const Ranges& ranges, const void* ptr, size_t bytes) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  for (const auto& [base, size] : ranges) {
    if (p < base + size && base < p + bytes) return true;
  }
  return false;
}

// kStraddling: partly inside an allocation or registration, partly outside (past its end).
enum class Memory { kPageable, kPinned, kDevice, kStraddling };

Memory Where(const void* ptr, size_t bytes) {
  State& s = Global();
  if (Within(s.device, ptr, bytes)) return Memory::kDevice;
  if (Within(s.pinned, ptr, bytes) || Within(s.registered, ptr, bytes)) return Memory::kPinned;
  if (Overlaps(s.device, ptr, bytes) || Overlaps(s.pinned, ptr, bytes) ||
      Overlaps(s.registered, ptr, bytes)) {
    return Memory::kStraddling;
  }
  return Memory::kPageable;
}

cudaError_t Refuse(cudaError_t rc, const char* call, const void* ptr) {
  State& s = Global();
  s.last_error = rc;
  s.stats.refused += 1;
  std::fprintf(stderr, "cuda stand-in: %s refused (%s) at %p\n", call, cudaGetErrorName(rc), ptr);
  return rc;
}

CUstream_st* StreamOf(cudaStream_t stream) { return stream != nullptr ? stream : &Global().legacy; }

void Flush(CUstream_st* stream) {
  std::vector<std::function<void()>> work;
  work.swap(stream->queued);
  for (auto& op : work) op();
}

void FlushAll() {
  State& s = Global();
  Flush(&s.legacy);
  for (CUstream_st* stream : s.streams) Flush(stream);
}

// Queues `op` on `stream` if it touches no pageable memory, else runs it now, after the queue.
void Run(cudaStream_t stream, bool pageable, std::function<void()> op) {
  CUstream_st* st = StreamOf(stream);
  if (pageable) {
    Flush(st);
    op();
  } else {
    Global().stats.queued += 1;
    st->queued.push_back(std::move(op));
  }
}

void* Allocate(size_t bytes) {
  void* ptr = std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  if (ptr != nullptr) std::memset(ptr, kPoison, bytes);
  return ptr;
}

cudaError_t Release(Ranges& ranges, void* ptr, const char* call) {
  if (ptr == nullptr) return cudaSuccess;
  FlushAll();
  auto it = ranges.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == ranges.end()) return Refuse(cudaErrorInvalidValue, call, ptr);
  ranges.erase(it);
  std::free(ptr);
  return cudaSuccess;
}

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};

const ErrorText& Describe(cudaError_t error) {
  static const ErrorText kTexts[] = {
      {cudaSuccess, "cudaSuccess", "no error"},
      {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
      {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
      {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
      {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
       "an illegal memory access was encountered"},
      {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
       "part or all of the requested memory range is already mapped"},
      {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
       "pointer does not correspond to a registered memory region"},
  };
  for (const ErrorText& text : kTexts) {
    if (text.error == error) return text;
  }
  static const ErrorText kUnknown = {error, "cudaErrorUnknown", "unknown error"};
  return kUnknown;
}

template <typename T>
void Add(const void* local, const void* add, void* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    static_cast<T*>(out)[i] = static_cast<const T*>(local)[i] + static_cast<const T*>(add)[i];
  }
}

}  // namespace

const char* cudaGetErrorName(cudaError_t error) { return Describe(error).name; }

const char* cudaGetErrorString(cudaError_t error) { return Describe(error).text; }

cudaError_t cudaGetLastError() {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  const cudaError_t rc = s.last_error;
  s.last_error = cudaSuccess;
  return rc;
}

cudaError_t cudaSetDevice(int device) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  return device == 0 ? cudaSuccess : Refuse(cudaErrorInvalidDevice, "cudaSetDevice", nullptr);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  *stream = new CUstream_st();
  Global().streams.insert(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  if (Global().streams.erase(stream) == 0) {
    return Refuse(cudaErrorInvalidValue, "cudaStreamDestroy", stream);
  }
  Flush(stream);
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  Flush(StreamOf(stream));
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  *ptr = Allocate(bytes);
  if (*ptr == nullptr) return Refuse(cudaErrorMemoryAllocation, "cudaMalloc", nullptr);
  s.device[reinterpret_cast<uintptr_t>(*ptr)] = bytes;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  return Release(Global().device, ptr, "cudaFree");
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  *ptr = Allocate(bytes == 0 ? 1 : bytes);
  if (*ptr == nullptr) return Refuse(cudaErrorMemoryAllocation, "cudaHostAlloc", nullptr);
  s.pinned[reinterpret_cast<uintptr_t>(*ptr)] = bytes == 0 ? 1 : bytes;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  return Release(Global().pinned, ptr, "cudaFreeHost");
}

cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (ptr == nullptr || bytes == 0) return Refuse(cudaErrorInvalidValue, "cudaHostRegister", ptr);
  if (Overlaps(s.registered, ptr, bytes) || Overlaps(s.pinned, ptr, bytes) ||
      Overlaps(s.device, ptr, bytes)) {
    return Refuse(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister", ptr);
  }
  s.registered[reinterpret_cast<uintptr_t>(ptr)] = bytes;
  s.stats.registrations += 1;
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (s.registered.erase(reinterpret_cast<uintptr_t>(ptr)) == 0) {
    return Refuse(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister", ptr);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (bytes == 0) return cudaSuccess;
  const Memory from = Where(src, bytes);
  const Memory to = Where(dst, bytes);
  const bool from_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  const bool to_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  if (from == Memory::kStraddling || (from == Memory::kDevice) != from_device) {
    return Refuse(cudaErrorInvalidValue, "cudaMemcpyAsync (source)", src);
  }
  if (to == Memory::kStraddling || (to == Memory::kDevice) != to_device) {
    return Refuse(cudaErrorInvalidValue, "cudaMemcpyAsync (destination)", dst);
  }
  s.stats.copies[kind] += 1;
  Run(stream, from == Memory::kPageable || to == Memory::kPageable,
      [dst, src, bytes] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  FlushAll();
  const cudaError_t rc = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  FlushAll();
  return rc;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  if (bytes == 0) return cudaSuccess;
  if (Where(ptr, bytes) != Memory::kDevice) {
    return Refuse(cudaErrorInvalidValue, "cudaMemsetAsync", ptr);
  }
  Run(stream, false, [ptr, value, bytes] { std::memset(ptr, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(Global().mu);
  FlushAll();
  const cudaError_t rc = cudaMemsetAsync(ptr, value, bytes, nullptr);
  FlushAll();
  return rc;
}

namespace osmm {
namespace cuda {

cudaError_t LaunchAdd(bool double_precision, const void* local, const void* add, void* out,
                      int64_t n, cudaStream_t stream) {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  if (n <= 0) return cudaSuccess;
  const size_t bytes = static_cast<size_t>(n) * (double_precision ? sizeof(double) : sizeof(float));
  for (const void* ptr : {local, add, static_cast<const void*>(out)}) {
    if (Where(ptr, bytes) != Memory::kDevice) {
      return Refuse(cudaErrorIllegalAddress, "LaunchAdd", ptr);
    }
  }
  s.stats.adds += 1;
  Run(stream, false,
      [=] { double_precision ? Add<double>(local, add, out, n) : Add<float>(local, add, out, n); });
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace osmm

namespace cuda_standin {

Stats GetStats() {
  State& s = Global();
  std::lock_guard<std::recursive_mutex> lock(s.mu);
  Stats stats = s.stats;
  stats.live_registered = static_cast<int64_t>(s.registered.size());
  stats.live_pinned = static_cast<int64_t>(s.pinned.size());
  stats.live_device = static_cast<int64_t>(s.device.size());
  return stats;
}

}  // namespace cuda_standin
