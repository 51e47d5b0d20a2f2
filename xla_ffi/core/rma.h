// RMA building blocks shared by the fetch and the reduce: one strided rect per record, and
// counted fences.
#ifndef OSMM_JAX_XLA_FFI_RMA_H_
#define OSMM_JAX_XLA_FFI_RMA_H_

#include <mpi.h>

#include <algorithm>
#include <cstdint>

#include "core/common.h"
#include "core/counters.h"
#include "watchdog/watchdog.h"

namespace osmm {

// Largest count handed to a single MPI call (fits an int with room to spare).
inline constexpr int64_t kMaxCount = int64_t{1} << 30;

// Issues the RMA calls that move one rows x cols rect: contiguous on the origin, at byte
// displacement `disp` with a row stride of `ld` units on the target. Sizes are in units of
// `unit` (an MPI datatype of `unit_bytes` bytes). `issue(origin_units, count, target_disp,
// target_type, target_count)` makes one MPI call and returns its code.
template <typename Issue>
int IssueRect(int64_t rows, int64_t cols, int64_t ld, int64_t unit_bytes, MPI_Aint disp,
              MPI_Datatype unit, const Issue& issue) {
  if (cols == ld || rows == 1) {
    const int64_t total = rows * cols;
    for (int64_t done = 0; done < total; done += kMaxCount) {
      const int64_t n = std::min(kMaxCount, total - done);
      int rc = issue(done, n, disp + static_cast<MPI_Aint>(done * unit_bytes), unit, n);
      if (rc != MPI_SUCCESS) return rc;
    }
    return MPI_SUCCESS;
  }
  const int64_t rows_per_call = std::max<int64_t>(1, kMaxCount / cols);
  for (int64_t r = 0; r < rows; r += rows_per_call) {
    const int64_t nr = std::min(rows_per_call, rows - r);
    MPI_Datatype strided = MPI_DATATYPE_NULL;
    int rc = MPI_Type_vector(static_cast<int>(nr), static_cast<int>(cols), static_cast<int>(ld),
                             unit, &strided);
    if (rc != MPI_SUCCESS) return rc;
    rc = MPI_Type_commit(&strided);
    if (rc == MPI_SUCCESS) {
      rc =
          issue(r * cols, nr * cols, disp + static_cast<MPI_Aint>(r * ld * unit_bytes), strided, 1);
    }
    // Freeing a datatype that pending RMA operations use is allowed: MPI keeps it alive.
    MPI_Type_free(&strided);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// One MPI_Win_fence on `win` (a window over `comm`), watched: an opening fence (no
// MPI_MODE_NOSUCCEED) or a closing one. In raise mode every fence is preceded by a bounded
// barrier (see watchdog.h), opening ones too: MPI_MODE_NOPRECEDE does not keep MPICH's fence
// from waiting for its peers (a rank that failed between products leaves the others in the
// next product's opening fence).
inline ffi::Error Fence(MPI_Win win, MPI_Comm comm, int assertion, const char* what) {
  if (ffi::Error err = BoundedBarrier(comm, what); err.failure()) return err;
  GlobalCounters().fences.fetch_add(1, std::memory_order_relaxed);
  BlockingStep blocking(
      (assertion & MPI_MODE_NOSUCCEED) != 0 ? Step::kClosingFence : Step::kOpeningFence, comm);
  int rc = MPI_Win_fence(assertion, win);
  if (rc != MPI_SUCCESS) return MpiError(rc, what);
  return ffi::Error::Success();
}

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_RMA_H_
