#include "core/windows.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/rma.h"
#include "watchdog/watchdog.h"

namespace osmm {

// One cache slot. Entries are never destroyed (only their MPI window is), so a lease stays
// valid even if FreeWindows runs concurrently; the entry mutex serialises use of the window.
struct WindowEntry {
  uint64_t comm_key = 0;
  WindowSlot slot = WindowSlot::kReduce;
  WindowMemory* memory = nullptr;  // nullptr: MPI_Win_allocate
  std::mutex mu;
  MPI_Win win = MPI_WIN_NULL;
  std::byte* base = nullptr;
  int64_t bytes = 0;
  uint64_t generation = 0;        // windows this entry has had
  MPI_Comm comm = MPI_COMM_NULL;  // the window's communicator
  // A device-memory window's header (WindowHeader::kBytes of MPI_Win_allocate host memory).
  MPI_Win header_win = MPI_WIN_NULL;
  std::byte* header_base = nullptr;
};

namespace {

struct CommEntry {
  uint64_t comm_key = 0;
  MPI_Comm dup = MPI_COMM_NULL;
  bool network = false;  // some ranks of `dup` are not on this rank's node
};

struct Cache {
  std::mutex mu;  // guards everything below
  std::vector<void (*)(std::byte*, int64_t)> release_hooks;
  std::vector<std::unique_ptr<WindowEntry>> entries;  // creation order
  std::vector<CommEntry> comms;                       // creation order
  std::atomic<int64_t> live_count{0};                 // readable without mu
  std::atomic<int64_t> live_bytes{0};
};

Cache& GlobalCache() {
  // Never destroyed: no MPI call may run from a static destructor after MPI_Finalize.
  static Cache* cache = new Cache();
  return *cache;
}

// Rounds a request up to a multiple of 64 bytes (at least 64), identically on every rank.
int64_t AllocationSize(int64_t bytes) {
  constexpr int64_t kAlign = 64;
  if (bytes < kAlign) return kAlign;
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

// Frees entry->win (collective). Caller holds entry->mu and cache.mu.
ffi::Error FreeEntryLocked(Cache& cache, WindowEntry* entry) {
  if (entry->win == MPI_WIN_NULL) return ffi::Error::Success();
  if (entry->memory == nullptr) {
    for (auto hook : cache.release_hooks) hook(entry->base, entry->bytes);
  }
  if (ffi::Error err = BoundedBarrier(entry->comm, "MPI_Win_free"); err.failure()) return err;
  int rc = MPI_SUCCESS;
  {
    BlockingStep blocking(Step::kWindowFree, entry->comm);
    // Completes this rank's operations on the window; MPI_Win_free then waits for the others'.
    if (IsPassive(entry->slot)) rc = MPI_Win_unlock_all(entry->win);
    const int free_rc = MPI_Win_free(&entry->win);
    if (rc == MPI_SUCCESS) rc = free_rc;
    if (entry->header_win != MPI_WIN_NULL) {
      const int header_rc = MPI_Win_free(&entry->header_win);
      if (rc == MPI_SUCCESS) rc = header_rc;
    }
  }
  if (entry->memory != nullptr) entry->memory->Free(entry->base);
  cache.live_count -= 1;
  cache.live_bytes -= entry->bytes;
  entry->win = MPI_WIN_NULL;
  entry->base = nullptr;
  entry->bytes = 0;
  entry->header_win = MPI_WIN_NULL;
  entry->header_base = nullptr;
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_free");
  return ffi::Error::Success();
}

// Allocates the zeroed header window of a device-memory entry (collective), with the entry's
// window info. Caller holds entry->mu and cache.mu.
ffi::Error AllocateHeaderLocked(WindowEntry* entry, MPI_Comm comm, MPI_Info info) {
  void* header = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  int rc = MPI_Win_allocate(static_cast<MPI_Aint>(WindowHeader::kBytes), /*disp_unit=*/1, info,
                            comm, &header, &win);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_allocate (window header)");
  rc = MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) {
    MPI_Win_free(&win);
    return MpiError(rc, "MPI_Win_set_errhandler (window header)");
  }
  std::memset(header, 0, static_cast<size_t>(WindowHeader::kBytes));
  entry->header_win = win;
  entry->header_base = static_cast<std::byte*>(header);
  return ffi::Error::Success();
}

// Zeroes `bytes` bytes at `base`, a window's memory from MPI_Win_allocate, without making
// its whole pages resident where that memory is shared (MPICH's within a node: a file in
// /dev/shm): those are handed back to the kernel (MADV_REMOVE), which reads them as zeros
// until something writes them. Only the slots a product uses then take memory, not the
// accumulator or the slots of ranks it never hears from. Memory MADV_REMOVE does not apply
// to (private: a heap) is written with zeros.
void ZeroWindowMemory(std::byte* base, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base);
  const uintptr_t end = begin + bytes;
  const uintptr_t first = (begin + page - 1) / page * page;  // whole pages [first, last)
  const uintptr_t last = end / page * page;
  if (page > 0 && first < last &&
      madvise(reinterpret_cast<void*>(first), last - first, MADV_REMOVE) == 0) {
    std::memset(base, 0, first - begin);  // the parts of pages shared with other memory
    std::memset(reinterpret_cast<void*>(last), 0, end - last);
    return;
  }
  std::memset(base, 0, bytes);
}

// Allocates a zeroed window of `bytes` bytes for entry (collective). Caller holds entry->mu
// and cache.mu.
ffi::Error AllocateEntryLocked(Cache& cache, WindowEntry* entry, MPI_Comm comm, int64_t bytes) {
  MPI_Info info = MPI_INFO_NULL;
  const bool passive = IsPassive(entry->slot);
  if (MPI_Info_create(&info) == MPI_SUCCESS) {
    // Only fences synchronise the other windows, and accumulates are element-wise sums whose
    // order does not matter: let MPI skip lock bookkeeping and accumulate ordering there.
    // Passive windows keep both: they are locked, and one origin's accumulates into the same
    // slot must land in the order issued (the notified sum is reproducible).
    if (!passive) {
      MPI_Info_set(info, "no_locks", "true");
      MPI_Info_set(info, "accumulate_ordering", "none");
    }
    MPI_Info_set(info, "same_size", "true");
    MPI_Info_set(info, "same_disp_unit", "true");
  }
  std::byte* base = nullptr;
  MPI_Win win = MPI_WIN_NULL;
  int rc = MPI_SUCCESS;
  std::string what;
  if (ffi::Error err = BoundedBarrier(comm, "MPI_Win_allocate"); err.failure()) {
    if (info != MPI_INFO_NULL) MPI_Info_free(&info);
    return err;
  }
  BlockingStep blocking(Step::kWindowCreate, comm);
  if (entry->memory == nullptr) {
    void* allocated = nullptr;
    rc = MPI_Win_allocate(static_cast<MPI_Aint>(bytes + WindowHeader::kBytes), /*disp_unit=*/1,
                          info, comm, &allocated, &win);
    base = static_cast<std::byte*>(allocated);
    what = "MPI_Win_allocate";
  } else {
    // A rank that cannot allocate still joins the collective create (with no memory), and
    // then every rank learns of it and frees the window again: no rank is left waiting.
    ffi::Error err = entry->memory->Allocate(bytes, &base);
    if (err.failure()) base = nullptr;
    rc = MPI_Win_create(base, static_cast<MPI_Aint>(base != nullptr ? bytes : 0),
                        /*disp_unit=*/1, info, comm, &win);
    what = "MPI_Win_create";
    int all_allocated = base != nullptr ? 1 : 0;
    if (rc == MPI_SUCCESS) {
      rc = MPI_Allreduce(MPI_IN_PLACE, &all_allocated, 1, MPI_INT, MPI_MIN, comm);
      if (rc == MPI_SUCCESS && !all_allocated) MPI_Win_free(&win);
    }
    if (rc != MPI_SUCCESS || !all_allocated) {
      if (base != nullptr) entry->memory->Free(base);
      if (info != MPI_INFO_NULL) MPI_Info_free(&info);
      if (err.failure()) return err;
      if (rc == MPI_SUCCESS) {
        return ffi::Error::Internal("another rank could not allocate its window memory (" +
                                    std::to_string(bytes) + " bytes); its error says why");
      }
      return MpiError(rc, what + "(" + std::to_string(bytes) + " bytes)");
    }
    if (ffi::Error err = AllocateHeaderLocked(entry, comm, info); err.failure()) {
      MPI_Win_free(&win);
      entry->memory->Free(base);
      if (info != MPI_INFO_NULL) MPI_Info_free(&info);
      return err;
    }
  }
  if (info != MPI_INFO_NULL) MPI_Info_free(&info);
  if (rc != MPI_SUCCESS) {
    return MpiError(rc, what + "(" + std::to_string(bytes) + " bytes)");
  }
  rc = MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
  if (entry->memory == nullptr) {
    ZeroWindowMemory(base, static_cast<size_t>(bytes + WindowHeader::kBytes));
  }
  if (rc == MPI_SUCCESS && passive) {
    // The zeroed memory is this rank's before any other rank may write into it.
    rc = MPI_Win_lock_all(MPI_MODE_NOCHECK, win);
    if (rc == MPI_SUCCESS) rc = MPI_Win_sync(win);
    if (rc == MPI_SUCCESS) rc = MPI_Barrier(comm);
  }
  entry->comm = comm;
  entry->win = win;
  entry->base = base;
  entry->bytes = bytes;
  entry->generation += 1;
  cache.live_count += 1;
  cache.live_bytes += bytes;
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Win_set_errhandler");
  return ffi::Error::Success();
}

}  // namespace

MPI_Win WindowLease::win() const { return entry_->win; }
std::byte* WindowLease::base() const { return entry_->base; }
int64_t WindowLease::bytes() const { return entry_->bytes; }
uint64_t WindowLease::generation() const { return entry_->generation; }
int64_t* WindowLease::header() const {
  if (entry_->header_win != MPI_WIN_NULL) return reinterpret_cast<int64_t*>(entry_->header_base);
  return reinterpret_cast<int64_t*>(entry_->base + entry_->bytes);
}
MPI_Win WindowLease::header_win() const {
  return entry_->header_win != MPI_WIN_NULL ? entry_->header_win : entry_->win;
}
MPI_Aint WindowLease::header_disp() const {
  return entry_->header_win != MPI_WIN_NULL ? 0 : static_cast<MPI_Aint>(entry_->bytes);
}

ffi::Error FenceWithHeader(MPI_Win win, MPI_Win header_win, MPI_Comm comm, int assertion,
                           const char* what) {
  if (ffi::Error err = Fence(win, comm, assertion, what); err.failure()) return err;
  if (header_win == win) return ffi::Error::Success();
  const int opening = (assertion & MPI_MODE_NOSUCCEED) == 0 ? MPI_MODE_NOPRECEDE : 0;
  const std::string header_what = std::string(what) + " (window header)";
  return Fence(header_win, comm, assertion | opening, header_what.c_str());
}

ffi::Error AcquireWindow(MPI_Comm comm, WindowSlot slot, int64_t bytes, WindowLease* lease,
                         WindowMemory* memory) {
  if (bytes < 0) {
    return ffi::Error::InvalidArgument("window size must be >= 0, got " + std::to_string(bytes));
  }
  Cache& cache = GlobalCache();
  std::unique_lock<std::mutex> cache_lock(cache.mu);
  const uint64_t key = CommKey(comm);
  WindowEntry* entry = nullptr;
  for (auto& e : cache.entries) {
    if (e->comm_key == key && e->slot == slot &&
        (e->memory == nullptr ? 0 : e->memory->kind()) ==
            (memory == nullptr ? 0 : memory->kind())) {
      entry = e.get();
      break;
    }
  }
  if (entry == nullptr) {
    cache.entries.push_back(std::make_unique<WindowEntry>());
    entry = cache.entries.back().get();
    entry->comm_key = key;
    entry->slot = slot;
    entry->memory = memory;
  }
  std::unique_lock<std::mutex> entry_lock(entry->mu);
  if (entry->win == MPI_WIN_NULL || entry->bytes < bytes) {
    // Same decision on every rank: `bytes` and the cache history are identical everywhere.
    if (ffi::Error err = FreeEntryLocked(cache, entry); err.failure()) return err;
    if (ffi::Error err = AllocateEntryLocked(cache, entry, comm, AllocationSize(bytes));
        err.failure()) {
      return err;
    }
  }
  cache_lock.unlock();
  lease->entry_ = entry;
  lease->lock_ = std::move(entry_lock);
  return ffi::Error::Success();
}

bool WindowHolds(MPI_Comm comm, WindowSlot slot, int64_t bytes) {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> cache_lock(cache.mu);
  const uint64_t key = CommKey(comm);
  for (auto& e : cache.entries) {
    if (e->comm_key == key && e->slot == slot && e->memory == nullptr) {
      std::lock_guard<std::mutex> entry_lock(e->mu);
      return e->win != MPI_WIN_NULL && e->bytes >= bytes;
    }
  }
  return false;
}

void AddWindowReleaseHook(void (*hook)(std::byte* base, int64_t bytes)) {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  cache.release_hooks.push_back(hook);
}

ffi::Error PrivateComm(MPI_Comm comm, MPI_Comm* out) {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  const uint64_t key = CommKey(comm);
  for (const CommEntry& e : cache.comms) {
    if (e.comm_key == key && e.dup != MPI_COMM_NULL) {
      *out = e.dup;
      return ffi::Error::Success();
    }
  }
  MPI_Comm dup = MPI_COMM_NULL;
  {
    BlockingStep blocking(Step::kCommDup, comm);
    if (int rc = MPI_Comm_dup(comm, &dup); rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_dup");
  }
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  // Which ranks share this rank's node (collective over `dup`, like the duplication): the
  // others are reached through the network, where RMA needs the target's progress.
  bool network = false;
  {
    BlockingStep blocking(Step::kCommDup, comm);
    MPI_Comm node = MPI_COMM_NULL;
    int size = 0;
    int node_size = 0;
    if (int rc = MPI_Comm_split_type(dup, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
        rc != MPI_SUCCESS) {
      MPI_Comm_free(&dup);
      return MpiError(rc, "MPI_Comm_split_type");
    }
    MPI_Comm_size(dup, &size);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    network = node_size < size;
  }
  if (ffi::Error err = OpenStatusChannel(comm, dup); err.failure()) return err;
  bool reused = false;
  for (CommEntry& e : cache.comms) {
    if (e.comm_key == key) {
      e.dup = dup;
      e.network = network;
      reused = true;
      break;
    }
  }
  if (!reused) cache.comms.push_back(CommEntry{key, dup, network});
  *out = dup;
  return ffi::Error::Success();
}

bool CommUsesNetwork(MPI_Comm private_comm) {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  for (const CommEntry& e : cache.comms) {
    if (e.dup == private_comm && e.dup != MPI_COMM_NULL) return e.network;
  }
  return false;
}

namespace {

bool MpiRunning() {
  int finalized = 0;
  int initialized = 0;
  MPI_Finalized(&finalized);
  MPI_Initialized(&initialized);
  return initialized && !finalized;
}

// Frees the MPI window of every entry, in creation order; `can_free`: MPI may still be called.
// Caller holds cache.mu.
ffi::Error FreeEntriesLocked(Cache& cache, bool can_free) {
  ffi::Error first_error = ffi::Error::Success();
  for (auto& e : cache.entries) {
    std::lock_guard<std::mutex> entry_lock(e->mu);
    if (e->win == MPI_WIN_NULL) continue;
    // A communicator left with a pending collective after a timeout takes no more
    // collectives: its windows are abandoned (the job is ending anyway).
    if (can_free && CheckUsable(e->comm).success()) {
      ffi::Error err = FreeEntryLocked(cache, e.get());
      if (err.failure() && first_error.success()) first_error = std::move(err);
    } else {
      // MPI is gone, and its windows with it, or the window's communicator is unusable: just
      // forget them (memory of our own included: the device memory of a CUDA-aware window may
      // be unreachable by now).
      cache.live_count -= 1;
      cache.live_bytes -= e->bytes;
      e->win = MPI_WIN_NULL;
      e->base = nullptr;
      e->bytes = 0;
      e->header_win = MPI_WIN_NULL;
      e->header_base = nullptr;
    }
  }
  return first_error;
}

}  // namespace

ffi::Error ReleaseWindows(int64_t* released_bytes) {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> cache_lock(cache.mu);
  const int64_t before = cache.live_bytes.load();
  ffi::Error err = ffi::Error::Success();
  if (MpiRunning()) err = FreeEntriesLocked(cache, /*can_free=*/true);
  *released_bytes = before - cache.live_bytes.load();
  return err;
}

ffi::Error FreeWindows() {
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> cache_lock(cache.mu);
  const bool can_free = MpiRunning();
  if (can_free && !cache.comms.empty()) BeginTeardown();
  ffi::Error first_error = FreeEntriesLocked(cache, can_free);
  if (can_free) CloseStatusChannels();
  for (CommEntry& e : cache.comms) {
    if (e.dup == MPI_COMM_NULL) continue;
    if (can_free && CheckUsable(e.dup).success()) {
      BlockingStep blocking(Step::kWindowFree, e.dup);
      int rc = MPI_Comm_free(&e.dup);
      if (rc != MPI_SUCCESS && first_error.success()) first_error = MpiError(rc, "MPI_Comm_free");
    }
    e.dup = MPI_COMM_NULL;
  }
  return first_error;
}

int64_t LiveWindowCount() { return GlobalCache().live_count.load(); }

int64_t LiveWindowBytes() { return GlobalCache().live_bytes.load(); }

std::vector<WindowRegion> LiveWindowRegions() {
  std::vector<WindowRegion> regions;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return regions;
  Cache& cache = GlobalCache();
  std::lock_guard<std::mutex> lock(cache.mu);
  for (const auto& entry : cache.entries) {
    if (entry->win == MPI_WIN_NULL || entry->memory != nullptr) continue;
    int me = 0;
    int size = 0;
    MPI_Comm_rank(entry->comm, &me);
    MPI_Comm_size(entry->comm, &size);
    // The whole allocation, header included, as MPI_Win_shared_query gives the others'.
    const int64_t allocated = entry->bytes + WindowHeader::kBytes;
    regions.push_back({true, reinterpret_cast<uintptr_t>(entry->base), allocated});
    for (int r = 0; r < size; ++r) {
      MPI_Aint bytes = 0;
      int disp_unit = 0;
      void* base = nullptr;
      if (r == me ||
          MPI_Win_shared_query(entry->win, r, &bytes, &disp_unit, &base) != MPI_SUCCESS ||
          base == nullptr) {
        continue;
      }
      regions.push_back({false, reinterpret_cast<uintptr_t>(base), static_cast<int64_t>(bytes)});
    }
  }
  return regions;
}

}  // namespace osmm
