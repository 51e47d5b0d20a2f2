// Persistent MPI windows, cached per (communicator, slot), and a private duplicate of each
// communicator for the native layer's own small collectives.
//
// Creating an MPI window is collective and expensive, and memory from MPI_Win_allocate is much
// faster to accumulate into than a window created over an arbitrary buffer. So each
// (communicator, slot) pair owns one allocated window that lives across calls: it is created
// lazily by the first handler that needs it and replaced by a larger one (collectively) when
// a call asks for more bytes than it has. Every call passes a size that is identical on all
// ranks, and all ranks run the same custom calls in the same order, so every rank takes the
// same create/grow decisions at the same point.
//
// Windows use byte displacements (disp_unit 1) and MPI_ERRORS_RETURN. The memory of a
// freshly (re)allocated window is zeroed; the reduce handlers keep their window all-zero
// between calls. Every window has a small header in host memory (WindowHeader): each call
// writes its id there so that a neighbour can check, inside the same epoch, that both run the
// same call, and a rank that abandons a reduce epoch marks it there. A host window
// (MPI_Win_allocate) holds its header after its `bytes` bytes; a device-memory window holds
// none, so it is paired with a host window of the header alone, created, fenced and freed
// with it (FenceWithHeader).
//
// Creating, growing and freeing windows are watched blocking steps (watchdog.h).
#ifndef OSMM_JAX_XLA_FFI_WINDOWS_H_
#define OSMM_JAX_XLA_FFI_WINDOWS_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/common.h"

namespace osmm {

enum class WindowSlot : int {
  kReduce = 0,  // receives partial C blocks (accumulate / put targets)
  kExpose = 1,  // holds this rank's A and B blocks for remote gets
  kSlots = 2,   // a notified reduce's accumulator and slots (notify.h)
  kSync = 3,    // a notified reduce's stamps and credits (notify.h)
};

// Whether windows of `slot` are used under a passive-target epoch for their whole lifetime
// (MPI_Win_lock_all right after creation, MPI_Win_unlock_all right before freeing) rather
// than fence epochs.
inline bool IsPassive(WindowSlot slot) {
  return slot == WindowSlot::kSlots || slot == WindowSlot::kSync;
}

// Memory for windows that MPI_Win_allocate does not provide: device memory for CUDA-aware MPI.
// Windows over such memory are made with MPI_Win_create and cached apart from host windows.
class WindowMemory {
 public:
  virtual ~WindowMemory() = default;
  // Nonzero, and distinct per kind of memory (0 stands for MPI_Win_allocate host memory).
  virtual int64_t kind() const = 0;
  // `bytes` bytes of zeroed memory, or an error.
  virtual ffi::Error Allocate(int64_t bytes, std::byte** base) = 0;
  // Frees what Allocate returned, after its window is freed.
  virtual void Free(std::byte* base) = 0;
};

struct WindowEntry;  // defined in windows.cc

// A window's header (int64 fields), at byte `WindowLease::header_disp()` of
// `WindowLease::header_win()`.
struct WindowHeader {
  static constexpr int64_t kBytes = 64;
  static constexpr int kCallId = 0;      // id of the call that last opened an epoch here
  static constexpr int kCallNumber = 1;  // that call's number on the owning rank
  static constexpr int kAbandoned = 2;   // 1 + a rank that abandoned the open reduce epoch
};

// A cached window, held: while a lease is alive, no other lease on the same window can be
// taken, so the window cannot be grown or freed under it. A lease does not outlive one handler
// call. The reduce epoch keeps using its window (from later calls and from the issuer thread)
// after its start call has dropped the lease; that is safe because the ordered-effect token
// runs no other call on the same communicator until the epoch's finish, and free_windows stops
// the issuer thread before it frees any window.
class WindowLease {
 public:
  WindowLease() = default;
  WindowLease(WindowLease&&) = default;
  WindowLease& operator=(WindowLease&&) = default;

  MPI_Win win() const;
  std::byte* base() const;
  int64_t bytes() const;
  // Which window of its (communicator, slot) this is: 1 for the first, then one more each
  // time it is created again (grown, or after FreeWindows). The same on every rank.
  uint64_t generation() const;
  // The window's header (WindowHeader), in host memory.
  int64_t* header() const;
  // The window that holds the header, and the header's byte displacement in it: win() and
  // bytes() for a host window; for a device-memory window, its header's own window and 0.
  MPI_Win header_win() const;
  MPI_Aint header_disp() const;

 private:
  friend ffi::Error AcquireWindow(MPI_Comm, WindowSlot, int64_t, WindowLease*, WindowMemory*);
  WindowEntry* entry_ = nullptr;
  std::unique_lock<std::mutex> lock_;
};

// Returns (in *lease) the window of (comm, slot, memory kind) with at least `bytes` bytes,
// creating or growing it first if needed. Collective over `comm` whenever it creates or grows;
// `bytes` and `memory`'s kind must be identical on every rank. The handlers pass their private
// duplicate as `comm`. `memory` (kept for the window's lifetime) provides the window's memory;
// nullptr means MPI_Win_allocate host memory.
ffi::Error AcquireWindow(MPI_Comm comm, WindowSlot slot, int64_t bytes, WindowLease* lease,
                         WindowMemory* memory = nullptr);

// Whether AcquireWindow(comm, slot, bytes) with host memory would return the window that
// exists now, without creating or growing one (local).
bool WindowHolds(MPI_Comm comm, WindowSlot slot, int64_t bytes);

// One watched MPI_Win_fence (rma.h) on `win`, a window over `comm`, then, where its header
// lives in a window of its own (`header_win` != `win`: device-memory windows), one on
// `header_win` with the same assertion (an opening fence there adds MPI_MODE_NOPRECEDE: the
// header's previous epoch closed with MPI_MODE_NOSUCCEED, so no RMA call precedes it). Every
// rank fences both, in this order; stops at the first failure.
ffi::Error FenceWithHeader(MPI_Win win, MPI_Win header_win, MPI_Comm comm, int assertion,
                           const char* what);

// Registers `hook`, called (local, under the cache lock) with the base and size of every
// MPI_Win_allocate window just before it is freed: a platform that pinned that memory
// (cudaHostRegister) unpins it there.
void AddWindowReleaseHook(void (*hook)(std::byte* base, int64_t bytes));

// Returns (in *out) this layer's private duplicate of `comm`, creating it (MPI_Comm_dup,
// collective over `comm`) on first use. The handlers' own collectives (agreement, window
// creation) run on the duplicate, so they can never be confused with collectives the caller
// issues on `comm`, possibly from another thread while a computation is in flight. Creating
// it ahead of time from the caller's thread (prepare_comm in the Python module) removes the
// one remaining collective on `comm` from the handlers.
ffi::Error PrivateComm(MPI_Comm comm, MPI_Comm* out);

// Whether `private_comm` (a duplicate made by PrivateComm) has ranks that this rank reaches
// through the network module: fewer ranks share this rank's node (MPI_COMM_TYPE_SHARED, found
// once when the duplicate is made) than the communicator has. Under MPICH's
// MPIR_CVAR_NOLOCAL=1 every rank counts as a node of its own. False for unknown communicators.
bool CommUsesNetwork(MPI_Comm private_comm);

// Frees every cached window, in creation order (identical on all ranks), then the private
// communicators, in creation order. Collective over all communicators that own windows.
// Idempotent; once MPI is finalised it only forgets the handles.
ffi::Error FreeWindows();

// Frees every cached window, in creation order (identical on all ranks), between products:
// the private communicators, the watchdog's channels and the rank's state stay, and the next
// call that needs a window creates it again (collectively, at the size that call needs).
// Collective over all communicators that own windows. Sets *released_bytes to the bytes of
// window memory freed on this rank. Does nothing once MPI is finalised.
ffi::Error ReleaseWindows(int64_t* released_bytes);

// Number of live windows and their total size in bytes.
int64_t LiveWindowCount();
int64_t LiveWindowBytes();

// Where a live window's memory lies in this process: this rank's own, or another rank's
// mapped here because the window is shared within a node (MPI_Win_shared_query).
struct WindowRegion {
  bool own = false;
  uintptr_t address = 0;
  int64_t bytes = 0;
};

// The regions of every live host window (MPI_Win_allocate): this rank's memory, and the
// memory of the other ranks whose windows MPI maps into this process (none across nodes).
// Writes into another rank's region make its pages resident in this process's resident set
// too, which a per-rank memory measurement must tell apart from the rank's own (memory.py).
std::vector<WindowRegion> LiveWindowRegions();

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_WINDOWS_H_
