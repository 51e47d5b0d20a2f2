#include "cuda/cuda_ops.h"

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "core/counters.h"
#include "cuda/cuda_kernels.h"

// MPICH (mpi.h) and Open MPI (mpi-ext.h) provide MPIX_Query_cuda_support; other MPIs may not.
// A weak reference resolves to null where the MPI lacks it, so this builds and loads with any
// MPI.
extern "C" int MPIX_Query_cuda_support(void);
#pragma weak MPIX_Query_cuda_support

namespace osmm {
namespace cuda {
namespace {

ffi::Error CudaError(cudaError_t rc, const std::string& what) {
  return ffi::Error::Internal(what + " failed: " + cudaGetErrorName(rc) + " (" +
                              cudaGetErrorString(rc) + ")");
}

// --- pinned staging -------------------------------------------------------------------------

struct StagingBuffer {
  std::byte* data = nullptr;
  int64_t bytes = 0;
};

struct StagingTable {
  std::mutex mu;
  std::map<std::pair<uint64_t, int>, StagingBuffer> buffers;  // (comm key, Staging)
};

StagingTable& Stagings() {
  static StagingTable* table = new StagingTable();  // never destroyed: freed by FreeStaging
  return *table;
}

// The staging buffer `what` of `comm_key`, grown to at least `bytes` if `grow`.
ffi::Error GetStaging(uint64_t comm_key, Staging what, int64_t bytes, bool grow, std::byte** out) {
  StagingTable& t = Stagings();
  std::lock_guard<std::mutex> lock(t.mu);
  StagingBuffer& buffer = t.buffers[{comm_key, static_cast<int>(what)}];
  if (buffer.bytes < bytes) {
    if (!grow) {
      return ffi::Error::Internal("osmm_jax: staging buffer smaller than reserved (" +
                                  std::to_string(buffer.bytes) + " < " + std::to_string(bytes) +
                                  " bytes)");
    }
    if (buffer.data != nullptr) cudaFreeHost(buffer.data);
    buffer = StagingBuffer{};
    void* data = nullptr;
    // Portable: pinned for every device, whichever one the calling thread has current.
    if (cudaError_t rc = cudaHostAlloc(&data, static_cast<size_t>(bytes), cudaHostAllocPortable);
        rc != cudaSuccess) {
      return CudaError(rc, "cudaHostAlloc(" + std::to_string(bytes) + " bytes of staging)");
    }
    buffer.data = static_cast<std::byte*>(data);
    buffer.bytes = bytes;
  }
  *out = buffer.data;
  return ffi::Error::Success();
}

// --- pinned windows ---------------------------------------------------------------------------

struct PinnedWindows {
  std::mutex mu;
  std::map<std::byte*, bool> bases;  // window base -> pinned (false: cudaHostRegister refused)
};

PinnedWindows& Pinned() {
  static PinnedWindows* pinned = new PinnedWindows();
  return *pinned;
}

// Window release hook: unpins a window's memory before MPI frees it.
void UnpinWindow(std::byte* base, int64_t) {
  PinnedWindows& p = Pinned();
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.bases.find(base);
  if (it == p.bases.end()) return;
  if (it->second) cudaHostUnregister(base);
  p.bases.erase(it);
}

void PinWindow(std::byte* base, int64_t bytes) {
  static const bool hooked = [] {
    AddWindowReleaseHook(&UnpinWindow);
    return true;
  }();
  (void)hooked;
  PinnedWindows& p = Pinned();
  std::lock_guard<std::mutex> lock(p.mu);
  if (p.bases.count(base) != 0) return;
  // Pinning only makes the copies faster: where the driver refuses (e.g. some shared-memory
  // mappings), copies from pageable memory are just as correct.
  const cudaError_t rc =
      cudaHostRegister(base, static_cast<size_t>(bytes), cudaHostRegisterPortable);
  if (rc != cudaSuccess) cudaGetLastError();  // clear the (non-sticky) error
  p.bases[base] = rc == cudaSuccess;
}

// --- device windows (CUDA-aware MPI) ----------------------------------------------------------

class DeviceWindowMemory final : public WindowMemory {
 public:
  int64_t kind() const override { return 1; }
  ffi::Error Allocate(int64_t bytes, std::byte** base) override {
    void* data = nullptr;
    if (cudaError_t rc = cudaMalloc(&data, static_cast<size_t>(bytes)); rc != cudaSuccess) {
      return CudaError(rc, "cudaMalloc(" + std::to_string(bytes) + " bytes of window)");
    }
    if (cudaError_t rc = cudaMemset(data, 0, static_cast<size_t>(bytes)); rc != cudaSuccess) {
      cudaFree(data);
      return CudaError(rc, "cudaMemset of a new window");
    }
    *base = static_cast<std::byte*>(data);
    return ffi::Error::Success();
  }
  void Free(std::byte* base) override { cudaFree(base); }
};

DeviceWindowMemory& DeviceWindows() {
  static DeviceWindowMemory* memory = new DeviceWindowMemory();
  return *memory;
}

int64_t ItemSize(ffi::DataType dtype) { return static_cast<int64_t>(ffi::ByteWidth(dtype)); }

}  // namespace

int MpiCudaSupport() {
  if (&MPIX_Query_cuda_support == nullptr) return -1;
  return MPIX_Query_cuda_support() ? 1 : 0;
}

bool CudaAwareRequested() {
  static const bool requested = [] {
    const char* value = std::getenv("OSMM_CUDA_AWARE");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return requested;
}

CudaBufferOps::CudaBufferOps(cudaStream_t stream, int32_t device, ffi::ScratchAllocator* scratch)
    : stream_(stream), scratch_(scratch), aware_(CudaAwareRequested()) {
  // The calling thread's current device decides where cudaMalloc and kernels go.
  if (cudaError_t rc = cudaSetDevice(device); rc != cudaSuccess) {
    unusable_ = CudaError(rc, "cudaSetDevice(" + std::to_string(device) + ")").message();
  } else if (aware_ && MpiCudaSupport() != 1) {
    unusable_ =
        "OSMM_CUDA_AWARE=1 asks for windows in GPU memory, but this MPI does not report CUDA "
        "support (MPIX_Query_cuda_support() " +
        std::string(MpiCudaSupport() == 0 ? "returned 0" : "does not exist") +
        "); use a CUDA-aware MPI (e.g. MPICH built with CUDA and MPIR_CVAR_ENABLE_GPU=1) or "
        "unset OSMM_CUDA_AWARE for host staging";
  }
}

std::string CudaBufferOps::Unusable() const { return unusable_; }

WindowMemory* CudaBufferOps::window_memory() { return aware_ ? &DeviceWindows() : nullptr; }

ffi::Error CudaBufferOps::UseWindow(const WindowLease& lease) {
  if (!aware_) PinWindow(lease.base(), lease.bytes());
  return ffi::Error::Success();
}

ffi::Error CudaBufferOps::ReserveStaging(uint64_t comm_key, Staging what, int64_t bytes) {
  if (aware_) return ffi::Error::Success();  // RMA uses XLA's buffers directly
  std::byte* unused = nullptr;
  return GetStaging(comm_key, what, bytes, /*grow=*/true, &unused);
}

ffi::Error CudaBufferOps::Sync(const char* what) {
  if (cudaError_t rc = cudaStreamSynchronize(stream_); rc != cudaSuccess) {
    return CudaError(rc, std::string("cudaStreamSynchronize (") + what + ")");
  }
  return ffi::Error::Success();
}

ffi::Error CudaBufferOps::Copy(void* dst, const void* src, int64_t bytes, cudaMemcpyKind kind,
                               const char* what) {
  if (bytes <= 0) return ffi::Error::Success();
  const auto start = std::chrono::steady_clock::now();
  if (cudaError_t rc = cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), kind, stream_);
      rc != cudaSuccess) {
    return CudaError(rc, std::string("cudaMemcpyAsync (") + what + ")");
  }
  if (ffi::Error err = Sync(what); err.failure()) return err;
  if (kind != cudaMemcpyDeviceToDevice) {
    Counters& c = GlobalCounters();
    c.staged_bytes.fetch_add(bytes, std::memory_order_relaxed);
    c.staging_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now() - start)
                               .count(),
                           std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

ffi::Error CudaBufferOps::CopyToWindow(std::byte* dst, const void* src, int64_t bytes) {
  return Copy(dst, src, bytes, aware_ ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost,
              "block into the expose window");
}

ffi::Error CudaBufferOps::RmaSource(uint64_t comm_key, const void* src, int64_t bytes,
                                    int64_t offset, const std::byte** out) {
  if (aware_) {
    // MPI reads the chunk itself: wait until XLA's stream has produced it.
    *out = static_cast<const std::byte*>(src);
    return Sync("chunk before RMA");
  }
  std::byte* staging = nullptr;
  if (ffi::Error err = GetStaging(comm_key, Staging::kChunks, offset + bytes, false, &staging);
      err.failure()) {
    return err;
  }
  *out = staging + offset;
  return Copy(staging + offset, src, bytes, cudaMemcpyDeviceToHost, "chunk into staging");
}

ffi::Error CudaBufferOps::RmaDestination(uint64_t comm_key, void* dst, int64_t bytes,
                                         std::byte** out) {
  if (aware_) {
    // MPI writes the buffer itself: nothing earlier on the stream may still use its memory.
    *out = static_cast<std::byte*>(dst);
    return Sync("before RMA into the fetched buffer");
  }
  return GetStaging(comm_key, Staging::kFetched, bytes, false, out);
}

ffi::Error CudaBufferOps::FinishRmaDestination(void* dst, const std::byte* rma, int64_t bytes) {
  if (aware_) return ffi::Error::Success();
  return Copy(dst, rma, bytes, cudaMemcpyHostToDevice, "fetched pieces to the device");
}

ffi::Error CudaBufferOps::AddWindowInto(ffi::DataType dtype, const void* local, std::byte* window,
                                        void* out, int64_t n) {
  if (n <= 0) return ffi::Error::Success();
  const int64_t bytes = n * ItemSize(dtype);
  const void* received = window;
  if (!aware_) {
    // The sum arrived in host memory: bring it next to `local` first.
    std::optional<void*> scratch =
        scratch_ != nullptr ? scratch_->Allocate(static_cast<size_t>(bytes), 256) : std::nullopt;
    if (!scratch.has_value()) {
      std::memset(window, 0, static_cast<size_t>(bytes));
      return ffi::Error::Internal("osmm_reduce_finish: could not allocate " +
                                  std::to_string(bytes) + " bytes of GPU scratch memory");
    }
    if (ffi::Error err =
            Copy(*scratch, window, bytes, cudaMemcpyHostToDevice, "received sum to the device");
        err.failure()) {
      std::memset(window, 0, static_cast<size_t>(bytes));
      return err;
    }
    received = *scratch;
  }
  cudaError_t rc = LaunchAdd(dtype == ffi::DataType::F64, local, received, out, n, stream_);
  if (rc == cudaSuccess && aware_)
    rc = cudaMemsetAsync(window, 0, static_cast<size_t>(bytes), stream_);
  ffi::Error synced = Sync("adding the received sum");
  // The window must be all-zero before the next epoch opens, whatever happened.
  if (!aware_) std::memset(window, 0, static_cast<size_t>(bytes));
  if (rc != cudaSuccess) return CudaError(rc, "adding the received sum");
  return synced;
}

ffi::Error CudaBufferOps::WriteTicket(void* ticket, int32_t value) {
  // From pageable memory: returns once `value` has been copied out of it.
  if (cudaError_t rc =
          cudaMemcpyAsync(ticket, &value, sizeof(value), cudaMemcpyHostToDevice, stream_);
      rc != cudaSuccess) {
    return CudaError(rc, "cudaMemcpyAsync (ticket)");
  }
  return ffi::Error::Success();
}

ffi::Error CudaBufferOps::ZeroWindow(std::byte* window, int64_t bytes) {
  if (!aware_) {
    std::memset(window, 0, static_cast<size_t>(bytes));
    return ffi::Error::Success();
  }
  if (cudaError_t rc = cudaMemsetAsync(window, 0, static_cast<size_t>(bytes), stream_);
      rc != cudaSuccess) {
    return CudaError(rc, "cudaMemsetAsync (window)");
  }
  return Sync("clearing the window");
}

void FreeStaging() {
  StagingTable& t = Stagings();
  std::lock_guard<std::mutex> lock(t.mu);
  for (auto& entry : t.buffers) {
    if (entry.second.data != nullptr) cudaFreeHost(entry.second.data);
  }
  t.buffers.clear();
}

}  // namespace cuda
}  // namespace osmm
