// Small helpers shared by the osmm_jax native sources: MPI handle conversion, MPI error
// formatting, and checked integer arithmetic for validating transfer records.
#ifndef OSMM_JAX_XLA_FFI_COMMON_H_
#define OSMM_JAX_XLA_FFI_COMMON_H_

#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace osmm {

namespace ffi = xla::ffi;

// mpi4py's `comm.handle` as an int64. MPICH's MPI_Comm is an int, OpenMPI's a pointer: the
// low sizeof(MPI_Comm) bytes of the (little-endian) int64 are the handle in both cases.
inline MPI_Comm CommFromHandle(int64_t handle) {
  static_assert(sizeof(MPI_Comm) <= sizeof(int64_t), "MPI_Comm wider than int64");
  MPI_Comm comm;
  std::memcpy(&comm, &handle, sizeof(MPI_Comm));
  return comm;
}

// The XLA execution (ffi::RunId) whose handler call runs on this thread, set by the CPU
// handlers for their call (RunScope); 0 outside one, and on platforms that do not set it. It
// names the program run a notified product belongs to (notify.cc: which program a failure
// happened in). Defined in libosmm_core (run.cc), so that the handler modules and the core
// see one variable per thread.
int64_t CurrentRun();
void SetCurrentRun(int64_t run);

class RunScope {
 public:
  explicit RunScope(int64_t run) : previous_(CurrentRun()) { SetCurrentRun(run); }
  ~RunScope() { SetCurrentRun(previous_); }
  RunScope(const RunScope&) = delete;
  RunScope& operator=(const RunScope&) = delete;

 private:
  int64_t previous_;
};

// A key that identifies a communicator in the window cache.
inline uint64_t CommKey(MPI_Comm comm) {
  uint64_t key = 0;
  std::memcpy(&key, &comm, sizeof(MPI_Comm));
  return key;
}

// "<what> failed: <MPI_Error_string>" for a non-success MPI return code.
inline ffi::Error MpiError(int rc, std::string_view what) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  std::string message = std::string(what) + " failed (MPI error " + std::to_string(rc) + ")";
  if (MPI_Error_string(rc, text, &length) == MPI_SUCCESS && length > 0) {
    message += ": ";
    message.append(text, static_cast<size_t>(length));
  }
  return ffi::Error::Internal(std::move(message));
}

// Succeeds iff MPI is initialised and not yet finalised.
inline ffi::Error RequireMpiReady() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized) {
    return ffi::Error::Internal(
        "MPI is not initialised: import mpi4py.MPI before running osmm_jax operations");
  }
  if (finalized) {
    return ffi::Error::Internal("MPI has already been finalised");
  }
  return ffi::Error::Success();
}

// A collective handler's communicator (from mpi4py's handle) and its size.
struct CallComm {
  MPI_Comm comm = MPI_COMM_NULL;
  int size = 0;
};

// The prologue of every collective handler: MPI must be ready; resolves the `comm` attribute.
inline ffi::Error OpenCall(const char* op, int64_t comm_handle, CallComm* out) {
  if (ffi::Error err = RequireMpiReady(); err.failure()) return err;
  out->comm = CommFromHandle(comm_handle);
  if (int rc = MPI_Comm_size(out->comm, &out->size); rc != MPI_SUCCESS) {
    return MpiError(rc, std::string(op) + ": MPI_Comm_size");
  }
  return ffi::Error::Success();
}

// Checked int64 arithmetic: false on overflow.
inline bool MulOk(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline bool AddOk(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_COMMON_H_
