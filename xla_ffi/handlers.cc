// Transfer records
// ----------------
// The handlers receive their transfers as a flat int64 array attribute of 8-int64 records
//
//   osmm_reduce_start "transfers": [op, target, offset, rows, cols, row0, col0, ld]
//       op 0 = accumulate (MPI_SUM), 1 = put. Sends the contiguous row-major rows x cols block
//       at element `offset` of its chunk into `target`'s reduce window, whose memory holds the
//       target's local C block row-major with `ld` elements per row, at element (row0, col0).
//       Records are grouped by chunk: "chunk_ends" gives each chunk's end (exclusive, in
//       records) and "chunk_sizes" its buffer's length in elements.
//   osmm_fetch "gets":         [matrix, target, offset, rows, cols, row0, col0, ld]
//       matrix 0 = A, 1 = B. Copies the rows x cols rect at (row0, col0) of `target`'s exposed
//       block (row stride `ld` elements) into fetched[offset : offset + rows*cols] row-major.
//
// Errors
// ------
// Every rank validates its operands and records before anything moves, then all ranks agree
// (one small MPI_Allreduce on this layer's private duplicate of the communicator, see
// PrivateComm in windows.h; windows are created over that duplicate too) on whether every rank
// accepted its inputs and on the attributes that must be identical everywhere (window size,
// B offset). If anything is wrong, every rank returns an error and no rank issues RMA or
// touches a window: a bad record on one rank can neither hang the others in a fence nor leave
// the windows half-written. Only MPI failures after the agreement can differ between ranks.
// The checks depend only on a call's static signature (its rank-independent call_id,
// attributes and operand shapes), so a signature all ranks have accepted once is not agreed on
// again: the steady state of a jitted loop pays no agreement collective. (This assumes what
// the rest of the design does too: all ranks run the same compiled programs in the same order.)
//
// Synchronisation
// ---------------
// osmm_fetch: one fence epoch per call: local window setup, MPI_Win_fence, gets,
// MPI_Win_fence, local use of the fetched data.
//
// The reduce is one fence epoch spread over several calls, so that communication overlaps the
// GEMMs XLA runs between them: osmm_reduce_start validates every chunk's records, agrees, opens
// the epoch and issues chunk 0; osmm_reduce_issue issues chunk i; osmm_reduce_finish waits for
// the issuer, closes the epoch and adds what arrived to the local block. With "overlap" set the
// chunks are issued by a background thread (issuer.h) and the calls return at once; the finish
// takes every chunk buffer as an operand, so XLA keeps them alive until the transfers are
// done. Every rank runs one start and one finish per product (chunk counts may differ). The
// closing fence completes every operation on every rank, so no state carries over between
// products except the window contents described in windows.h.

#include "handlers.h"

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "counters.h"
#include "issuer.h"
#include "windows.h"
#include "xla/ffi/api/ffi.h"

namespace osmm {
namespace {

constexpr size_t kRecordLength = 8;
// Largest count handed to a single MPI call (fits an int with room to spare).
constexpr int64_t kMaxCount = int64_t{1} << 30;
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

struct Record {
  int64_t kind;  // reduce: op (0 accumulate, 1 put); fetch: matrix (0 A, 1 B)
  int64_t target;
  int64_t offset;
  int64_t rows;
  int64_t cols;
  int64_t row0;
  int64_t col0;
  int64_t ld;
};

Record RecordAt(ffi::Span<const int64_t> flat, size_t i) {
  const int64_t* r = flat.begin() + i * kRecordLength;
  return Record{r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
}

size_t RecordCount(ffi::Span<const int64_t> flat) { return flat.size() / kRecordLength; }

std::string Describe(const char* what, size_t index, const Record& r) {
  return std::string(what) + " record " + std::to_string(index) + " [" + std::to_string(r.kind) +
         ", " + std::to_string(r.target) + ", " + std::to_string(r.offset) + ", " +
         std::to_string(r.rows) + ", " + std::to_string(r.cols) + ", " + std::to_string(r.row0) +
         ", " + std::to_string(r.col0) + ", " + std::to_string(r.ld) + "]: ";
}

// Checks every record; returns an empty string if all are valid, else a description of the
// first bad one. `region_base(kind)` is the byte offset of the target region of that kind
// inside the window; the target rect must end within `window_bytes`.
template <typename RegionBase>
std::string ValidateRecords(ffi::Span<const int64_t> flat, const char* what, int64_t num_kinds,
                            int comm_size, int64_t origin_elements, int64_t itemsize,
                            int64_t window_bytes, RegionBase region_base) {
  if (flat.size() % kRecordLength != 0) {
    return std::string(what) + " has " + std::to_string(flat.size()) +
           " entries, not a multiple of " + std::to_string(kRecordLength);
  }
  for (size_t i = 0; i < RecordCount(flat); ++i) {
    const Record r = RecordAt(flat, i);
    if (r.kind < 0 || r.kind >= num_kinds) {
      return Describe(what, i, r) + "kind must be in [0, " + std::to_string(num_kinds) + ")";
    }
    if (r.target < 0 || r.target >= comm_size) {
      return Describe(what, i, r) + "target outside the communicator of size " +
             std::to_string(comm_size);
    }
    if (r.rows < 0 || r.cols < 0 || r.offset < 0 || r.row0 < 0 || r.col0 < 0) {
      return Describe(what, i, r) + "negative offset, size or position";
    }
    int64_t elements = 0;
    int64_t origin_end = 0;
    if (!MulOk(r.rows, r.cols, &elements) || !AddOk(r.offset, elements, &origin_end) ||
        origin_end > origin_elements) {
      return Describe(what, i, r) + "origin range exceeds the " + std::to_string(origin_elements) +
             "-element local buffer";
    }
    if (elements == 0) continue;  // nothing moves
    int64_t col_end = 0;
    int64_t ld_bytes = 0;
    if (!AddOk(r.col0, r.cols, &col_end) || col_end > r.ld || !MulOk(r.ld, itemsize, &ld_bytes) ||
        ld_bytes > kIntMax) {
      return Describe(what, i, r) + "need col0 + cols <= ld and ld * itemsize < 2^31";
    }
    // Last element touched on the target, exclusive: (row0 + rows - 1) * ld + col0 + cols.
    int64_t last_row = 0;
    int64_t end = 0;
    int64_t end_bytes = 0;
    int64_t region_end = 0;
    if (!AddOk(r.row0, r.rows - 1, &last_row) || !MulOk(last_row, r.ld, &end) ||
        !AddOk(end, col_end, &end) || !MulOk(end, itemsize, &end_bytes) ||
        !AddOk(region_base(r.kind), end_bytes, &region_end) || region_end > window_bytes) {
      return Describe(what, i, r) + "target rect exceeds the " + std::to_string(window_bytes) +
             "-byte window";
    }
  }
  return std::string();
}

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

ffi::Error Fence(MPI_Win win, int assertion, const char* what) {
  GlobalCounters().fences.fetch_add(1, std::memory_order_relaxed);
  int rc = MPI_Win_fence(assertion, win);
  if (rc != MPI_SUCCESS) return MpiError(rc, what);
  return ffi::Error::Success();
}

bool IsDims(const ffi::AnyBuffer& buffer, size_t rank) {
  return buffer.dimensions().size() == rank;
}

bool SameDims(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y) {
  auto dx = x.dimensions();
  auto dy = y.dimensions();
  return dx.size() == dy.size() && std::equal(dx.begin(), dx.end(), dy.begin());
}

// A 64-bit FNV-1a hash of a call's static signature (its attributes and operand shapes), which
// determines the outcome of its local checks completely.
class Signature {
 public:
  Signature& Add(int64_t value) {
    for (int i = 0; i < 8; ++i) {
      hash_ = (hash_ ^ static_cast<uint64_t>((value >> (8 * i)) & 0xff)) * 1099511628211ULL;
    }
    return *this;
  }
  Signature& Add(ffi::Span<const int64_t> values) {
    Add(static_cast<int64_t>(values.size()));
    for (int64_t v : values) Add(v);
    return *this;
  }
  Signature& Add(const ffi::AnyBuffer& buffer) {
    Add(static_cast<int64_t>(buffer.element_type()));
    return Add(buffer.dimensions());
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 14695981039346656037ULL;
};

// Signatures (per communicator) that every rank has already accepted together. A signature
// starts with the call's "call_id" attribute, which the lowering makes identical on every rank
// and unique to the call (plan fingerprint, step, dtype, chunking: what determines every
// rank's attributes). So every rank meets a given id for the first time at the same call and
// records it at the same successful agreement: all ranks skip, or all ranks agree. (Local
// attributes alone would not do: two different calls can look the same on one rank and
// different on another, e.g. where it holds an empty block.) A call with a known signature
// passes the same local checks again, so its agreement is known without a collective.
bool AgreedBefore(uint64_t comm_key, uint64_t signature, bool remember) {
  static std::mutex* mu = new std::mutex();
  static auto* agreed = new std::vector<std::pair<uint64_t, uint64_t>>();
  std::lock_guard<std::mutex> lock(*mu);
  const std::pair<uint64_t, uint64_t> key(comm_key, signature);
  if (std::find(agreed->begin(), agreed->end(), key) != agreed->end()) return true;
  if (remember) agreed->push_back(key);
  return false;
}

// Collective (unless `signature` was agreed before on this communicator): agrees on whether
// every rank accepted its inputs (`problem` empty) and on the values in `same`, which must be
// identical on all ranks. Returns the same verdict everywhere: success, or an InvalidArgument
// naming this rank's problem or the first rank that had one. On success *private_comm is this
// layer's duplicate of `comm`, over which windows are made.
ffi::Error Agree(MPI_Comm comm, const char* op, const std::string& problem,
                 const std::vector<std::pair<const char*, int64_t>>& same, uint64_t signature,
                 MPI_Comm* private_comm_out) {
  MPI_Comm private_comm = MPI_COMM_NULL;
  if (ffi::Error err = PrivateComm(comm, &private_comm); err.failure()) return err;
  *private_comm_out = private_comm;
  if (problem.empty() && AgreedBefore(CommKey(comm), signature, false)) {
    return ffi::Error::Success();
  }
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(private_comm, &rank);
  MPI_Comm_size(private_comm, &size);
  // MIN over: the first failing rank (size if none), then each value and its complement
  // (~x = -x - 1 reverses the order without overflow), giving the minimum and the maximum.
  std::vector<int64_t> v;
  v.reserve(1 + 2 * same.size());
  v.push_back(problem.empty() ? size : rank);
  for (const auto& entry : same) {
    v.push_back(entry.second);
    v.push_back(~entry.second);
  }
  GlobalCounters().agreements.fetch_add(1, std::memory_order_relaxed);
  int rc = MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_INT64_T, MPI_MIN,
                         private_comm);
  if (rc != MPI_SUCCESS) return MpiError(rc, std::string(op) + ": MPI_Allreduce");
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  if (v[0] < size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(v[0]) +
                                       " rejected its inputs (its error says why); nothing moved");
  }
  for (size_t i = 0; i < same.size(); ++i) {
    const int64_t lo = v[1 + 2 * i];
    const int64_t hi = ~v[2 + 2 * i];
    if (lo != hi) {
      return ffi::Error::InvalidArgument(std::string(op) + ": " + same[i].first +
                                         " must be identical on every rank, but ranges from " +
                                         std::to_string(lo) + " to " + std::to_string(hi));
    }
  }
  AgreedBefore(CommKey(comm), signature, true);
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------------------
// osmm_reduce_start / osmm_reduce_issue / osmm_reduce_finish
// ----------------------------------------------------------------------------------------

// One open reduce epoch per private communicator, from its start to its finish. The ordered
// token chain runs a communicator's start, issues and finish strictly in program order, so an
// epoch is never touched by two calls at once; `mu` only guards the table itself.
struct ReduceEpoch {
  MPI_Comm private_comm = MPI_COMM_NULL;
  MPI_Win win = MPI_WIN_NULL;
  std::byte* window_base = nullptr;
  int64_t window_bytes = 0;
  ffi::DataType dtype = ffi::DataType::F32;
  MPI_Datatype mpi_type = MPI_DATATYPE_NULL;
  int64_t itemsize = 0;
  int64_t local_elements = 0;
  bool async = false;
  std::vector<Record> records;       // every chunk's records, chunk by chunk
  std::vector<int64_t> chunk_ends;   // records of chunk i: [chunk_ends[i-1], chunk_ends[i])
  std::vector<int64_t> chunk_sizes;  // elements of each chunk's buffer
  int64_t next_chunk = 0;
  std::string problem;  // a local inconsistency found after the epoch opened
  double start_time = 0.0;
};

struct EpochTable {
  std::mutex mu;
  // Keyed by CommKey(user comm). Epochs are heap-allocated: the issuer thread holds pointers.
  std::vector<std::pair<uint64_t, std::unique_ptr<ReduceEpoch>>> open;
};

EpochTable& Epochs() {
  static EpochTable* table = new EpochTable();  // never destroyed, like the window cache
  return *table;
}

ReduceEpoch* FindEpoch(uint64_t key) {
  EpochTable& t = Epochs();
  std::lock_guard<std::mutex> lock(t.mu);
  for (auto& entry : t.open) {
    if (entry.first == key) return entry.second.get();
  }
  return nullptr;
}

// Issues one chunk's accumulates and puts from `chunk` (its first element). Returns an empty
// string, or which MPI call failed.
std::string IssueChunk(const ReduceEpoch& epoch, int64_t index, const std::byte* chunk) {
  const int64_t first = index == 0 ? 0 : epoch.chunk_ends[index - 1];
  const int64_t last = epoch.chunk_ends[index];
  Counters& counters = GlobalCounters();
  const int64_t itemsize = epoch.itemsize;
  for (int64_t i = first; i < last; ++i) {
    const Record& r = epoch.records[i];
    if (r.rows == 0 || r.cols == 0) continue;
    const bool accumulate = r.kind == 0;
    const std::byte* origin = chunk + r.offset * itemsize;
    const MPI_Aint disp = static_cast<MPI_Aint>((r.row0 * r.ld + r.col0) * itemsize);
    const int rc = IssueRect(
        r.rows, r.cols, r.ld, itemsize, disp, epoch.mpi_type,
        [&](int64_t origin_units, int64_t count, MPI_Aint target_disp, MPI_Datatype target_type,
            int64_t target_count) {
          const void* src = origin + origin_units * itemsize;
          if (accumulate) {
            return MPI_Accumulate(src, static_cast<int>(count), epoch.mpi_type,
                                  static_cast<int>(r.target), target_disp,
                                  static_cast<int>(target_count), target_type, MPI_SUM, epoch.win);
          }
          return MPI_Put(src, static_cast<int>(count), epoch.mpi_type, static_cast<int>(r.target),
                         target_disp, static_cast<int>(target_count), target_type, epoch.win);
        });
    if (rc != MPI_SUCCESS) {
      return MpiError(rc,
                      std::string("osmm_reduce: ") + (accumulate ? "MPI_Accumulate" : "MPI_Put"))
          .message();
    }
    const int64_t bytes = r.rows * r.cols * itemsize;
    counters.rma_ops.fetch_add(1, std::memory_order_relaxed);
    counters.rma_bytes.fetch_add(bytes, std::memory_order_relaxed);
    counters.sent_bytes.fetch_add(bytes, std::memory_order_relaxed);
    (accumulate ? counters.accumulates : counters.puts).fetch_add(1, std::memory_order_relaxed);
  }
  return std::string();
}

// Hands chunk `index` to the issuer thread (async epochs) or issues it now. Returns an empty
// string, or what failed (synchronous issue only; the issuer reports at Drain).
std::string SubmitChunk(ReduceEpoch* epoch, int64_t index, const ffi::AnyBuffer& chunk) {
  const auto* data = static_cast<const std::byte*>(chunk.untyped_data());
  if (!epoch->async) return IssueChunk(*epoch, index, data);
  // The chunk buffer stays alive until osmm_reduce_finish, which takes it as an operand.
  GlobalIssuer().Submit([epoch, index, data] { return IssueChunk(*epoch, index, data); });
  return std::string();
}

// out = local + received, then received = 0. Element-wise, so `out` may alias `local` (an
// input-output alias in the lowering saves XLA a fresh output buffer).
template <typename T>
void AddAndClear(const T* local, T* received, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = local[i] + received[i];
    received[i] = T(0);
  }
}

ffi::Error ReduceStartImpl(ffi::AnyBuffer chunk, ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                           ffi::Result<ffi::Token>, int64_t comm_handle, int64_t call_id,
                           int64_t window_bytes, int64_t local_elements, int64_t overlap,
                           ffi::Span<const int64_t> transfers, ffi::Span<const int64_t> chunk_ends,
                           ffi::Span<const int64_t> chunk_sizes) {
  if (ffi::Error err = RequireMpiReady(); err.failure()) return err;
  const MPI_Comm comm = CommFromHandle(comm_handle);
  int comm_size = 0;
  if (int rc = MPI_Comm_size(comm, &comm_size); rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_reduce_start: MPI_Comm_size");
  }

  // Local checks of every chunk's records, before anything moves.
  const ffi::DataType dtype = chunk.element_type();
  ReduceEpoch epoch;
  std::string problem;
  if (dtype == ffi::DataType::F32) {
    epoch.mpi_type = MPI_FLOAT;
  } else if (dtype == ffi::DataType::F64) {
    epoch.mpi_type = MPI_DOUBLE;
  } else {
    problem = "unsupported dtype (osmm_reduce handles float32 and float64)";
  }
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  if (problem.empty() && (!IsDims(chunk, 1) || ticket->element_count() != 1)) {
    problem = "expected a 1-D chunk and a one-element ticket";
  } else if (problem.empty() && (window_bytes < 0 || local_elements < 0 ||
                                 local_elements > window_bytes / std::max<int64_t>(1, itemsize))) {
    problem = "the local C block (" + std::to_string(local_elements) +
              " elements) does not fit the " + std::to_string(window_bytes) + "-byte window";
  } else if (problem.empty() &&
             (chunk_ends.size() == 0 || chunk_ends.size() != chunk_sizes.size() ||
              chunk_sizes[0] != static_cast<int64_t>(chunk.element_count()))) {
    problem = "chunk_ends and chunk_sizes must describe the chunks, the first being this one";
  }
  int64_t previous_end = 0;
  for (size_t c = 0; c < chunk_ends.size() && problem.empty(); ++c) {
    const int64_t end = chunk_ends[c];
    if (end < previous_end ||
        end * static_cast<int64_t>(kRecordLength) > static_cast<int64_t>(transfers.size()) ||
        chunk_sizes[c] < 0) {
      problem = "chunk " + std::to_string(c) + " has a bad record range or size";
      break;
    }
    ffi::Span<const int64_t> part(transfers.begin() + previous_end * kRecordLength,
                                  static_cast<size_t>((end - previous_end) * kRecordLength));
    problem = ValidateRecords(part, "transfers", 2, comm_size, chunk_sizes[c], itemsize,
                              window_bytes, [](int64_t) { return int64_t{0}; });
    previous_end = end;
  }
  if (problem.empty() && previous_end * static_cast<int64_t>(kRecordLength) !=
                             static_cast<int64_t>(transfers.size())) {
    problem = "records after the last chunk";
  }
  MPI_Comm private_comm = MPI_COMM_NULL;
  const uint64_t signature = Signature()
                                 .Add(call_id)
                                 .Add(chunk)
                                 .Add(window_bytes)
                                 .Add(local_elements)
                                 .Add(transfers)
                                 .Add(chunk_ends)
                                 .Add(chunk_sizes)
                                 .value();
  if (ffi::Error err = Agree(comm, "osmm_reduce_start", problem, {{"window_bytes", window_bytes}},
                             signature, &private_comm);
      err.failure()) {
    return err;
  }

  // Every rank accepted its records: open one fence epoch on the reduce window.
  const uint64_t key = CommKey(comm);
  if (FindEpoch(key) != nullptr) {
    return ffi::Error::Internal("osmm_reduce_start: an epoch is already open on this communicator");
  }
  {
    WindowLease lease;
    if (ffi::Error err = AcquireWindow(private_comm, WindowSlot::kReduce, window_bytes, &lease);
        err.failure()) {
      return err;
    }
    epoch.win = lease.win();
    epoch.window_base = lease.base();
    epoch.window_bytes = lease.bytes();
  }
  epoch.private_comm = private_comm;
  epoch.dtype = dtype;
  epoch.itemsize = itemsize;
  epoch.local_elements = local_elements;
  epoch.async = overlap != 0;
  for (size_t i = 0; i < RecordCount(transfers); ++i)
    epoch.records.push_back(RecordAt(transfers, i));
  epoch.chunk_ends.assign(chunk_ends.begin(), chunk_ends.end());
  epoch.chunk_sizes.assign(chunk_sizes.begin(), chunk_sizes.end());
  // NOPRECEDE: the previous epoch on this window ended with a NOSUCCEED fence, and the
  // agreement above has just synchronised the ranks, so MPI may skip another barrier.
  if (ffi::Error err =
          Fence(epoch.win, MPI_MODE_NOPRECEDE, "osmm_reduce_start: opening MPI_Win_fence");
      err.failure()) {
    return err;
  }
  epoch.start_time = MPI_Wtime();
  epoch.next_chunk = 1;
  ReduceEpoch* open = nullptr;
  {
    EpochTable& t = Epochs();
    std::lock_guard<std::mutex> lock(t.mu);
    t.open.emplace_back(key, std::make_unique<ReduceEpoch>(std::move(epoch)));
    open = t.open.back().second.get();
  }
  // Kept even if issuing fails: the finish must still close the epoch on every rank.
  open->problem = SubmitChunk(open, 0, chunk);
  *static_cast<int32_t*>(ticket->untyped_data()) = 0;
  return ffi::Error::Success();
}

ffi::Error ReduceIssueImpl(ffi::AnyBuffer chunk, ffi::Token, ffi::Result<ffi::AnyBuffer> ticket,
                           ffi::Result<ffi::Token>, int64_t comm_handle, int64_t index) {
  ReduceEpoch* epoch = FindEpoch(CommKey(CommFromHandle(comm_handle)));
  if (epoch == nullptr) {
    return ffi::Error::Internal("osmm_reduce_issue: no reduce epoch is open on this communicator");
  }
  if (ticket->element_count() != 1) {
    return ffi::Error::InvalidArgument("osmm_reduce_issue: expected a one-element ticket");
  }
  *static_cast<int32_t*>(ticket->untyped_data()) = static_cast<int32_t>(index);
  // Inconsistencies are reported by the finish, which every rank reaches: an early return
  // here would leave the other ranks waiting in the closing fence.
  if (!epoch->problem.empty()) return ffi::Error::Success();
  if (index != epoch->next_chunk || index >= static_cast<int64_t>(epoch->chunk_sizes.size()) ||
      chunk.element_type() != epoch->dtype ||
      static_cast<int64_t>(chunk.element_count()) != epoch->chunk_sizes[index]) {
    epoch->problem = "osmm_reduce_issue: chunk " + std::to_string(index) +
                     " does not match the chunks osmm_reduce_start validated; nothing more sent";
    return ffi::Error::Success();
  }
  epoch->next_chunk = index + 1;
  epoch->problem = SubmitChunk(epoch, index, chunk);
  return ffi::Error::Success();
}

ffi::Error ReduceFinishImpl(ffi::AnyBuffer local, ffi::Token, ffi::RemainingArgs,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Token>,
                            int64_t comm_handle) {
  // The remaining operands are the chunk buffers: taking them keeps XLA from reusing their
  // memory while the issuer thread may still be reading them.
  const uint64_t key = CommKey(CommFromHandle(comm_handle));
  ReduceEpoch* epoch = FindEpoch(key);
  if (epoch == nullptr) {
    return ffi::Error::Internal("osmm_reduce_finish: no reduce epoch is open on this communicator");
  }
  std::string problem = epoch->async ? GlobalIssuer().Drain() : std::string();
  if (problem.empty()) problem = epoch->problem;
  if (problem.empty() && epoch->next_chunk != static_cast<int64_t>(epoch->chunk_sizes.size())) {
    problem = "osmm_reduce_finish: " + std::to_string(epoch->next_chunk) + " of " +
              std::to_string(epoch->chunk_sizes.size()) + " chunks were issued";
  }
  const int64_t n = static_cast<int64_t>(local.element_count());
  if (problem.empty() &&
      (local.element_type() != epoch->dtype || out->element_type() != epoch->dtype ||
       n != epoch->local_elements || !SameDims(local, *out))) {
    problem = "osmm_reduce_finish: local and out must match the epoch's dtype and C block";
  }
  ffi::Error closing =
      Fence(epoch->win, MPI_MODE_NOSUCCEED, "osmm_reduce_finish: closing MPI_Win_fence");
  RecordEpochLatency(MPI_Wtime() - epoch->start_time);
  std::byte* received = epoch->window_base;
  const int64_t window_bytes = epoch->window_bytes;
  const ffi::DataType dtype = epoch->dtype;
  {
    EpochTable& t = Epochs();
    std::lock_guard<std::mutex> lock(t.mu);
    t.open.erase(std::find_if(t.open.begin(), t.open.end(),
                              [key](const auto& entry) { return entry.first == key; }));
  }
  if (!problem.empty()) {
    // Restore the all-zero invariant whatever arrived.
    std::memset(received, 0, static_cast<size_t>(window_bytes));
    return ffi::Error::Internal(problem);
  }
  if (closing.failure()) return closing;
  if (dtype == ffi::DataType::F32) {
    AddAndClear(static_cast<const float*>(local.untyped_data()), reinterpret_cast<float*>(received),
                static_cast<float*>(out->untyped_data()), n);
  } else {
    AddAndClear(static_cast<const double*>(local.untyped_data()),
                reinterpret_cast<double*>(received), static_cast<double*>(out->untyped_data()), n);
  }
  return ffi::Error::Success();
}

// ----------------------------------------------------------------------------------------
// osmm_fetch
// ----------------------------------------------------------------------------------------

bool FetchDtypeSupported(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::F64 ||
         dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
}

ffi::Error FetchImpl(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Token,
                     ffi::Result<ffi::AnyBuffer> fetched, ffi::Result<ffi::Token>,
                     int64_t comm_handle, int64_t call_id, int64_t window_bytes, int64_t b_offset,
                     int64_t expose_a, int64_t expose_b, ffi::Span<const int64_t> gets) {
  if (ffi::Error err = RequireMpiReady(); err.failure()) return err;
  const MPI_Comm comm = CommFromHandle(comm_handle);
  int comm_size = 0;
  if (int rc = MPI_Comm_size(comm, &comm_size); rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_fetch: MPI_Comm_size");
  }

  // Local checks.
  const ffi::DataType dtype = a.element_type();
  std::string problem;
  if (!FetchDtypeSupported(dtype)) {
    problem = "unsupported dtype (osmm_fetch handles float32, float64, bfloat16 and float16)";
  } else if (b.element_type() != dtype || fetched->element_type() != dtype) {
    problem = "a, b and fetched must share one dtype";
  } else if (!IsDims(a, 2) || !IsDims(b, 2) || !IsDims(*fetched, 1)) {
    problem = "expected 2-D a and b and a 1-D fetched";
  } else if ((expose_a != 0 && expose_a != 1) || (expose_b != 0 && expose_b != 1)) {
    problem = "expose_a and expose_b must be 0 or 1";
  } else if (window_bytes < 0 || b_offset < 0 || b_offset > window_bytes) {
    problem = "need 0 <= b_offset <= window_bytes, got b_offset " + std::to_string(b_offset) +
              " and window_bytes " + std::to_string(window_bytes);
  }
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  const int64_t a_bytes = static_cast<int64_t>(a.size_bytes());
  const int64_t b_bytes = static_cast<int64_t>(b.size_bytes());
  if (problem.empty() && expose_a && a_bytes > (expose_b ? b_offset : window_bytes)) {
    problem = "the A block (" + std::to_string(a_bytes) + " bytes) does not fit below " +
              (expose_b ? "the B region at byte " + std::to_string(b_offset)
                        : "the end of the " + std::to_string(window_bytes) + "-byte window");
  }
  if (problem.empty() && expose_b && b_bytes > window_bytes - b_offset) {
    problem = "the B block (" + std::to_string(b_bytes) + " bytes) at byte " +
              std::to_string(b_offset) + " does not fit the " + std::to_string(window_bytes) +
              "-byte window";
  }
  if (problem.empty()) {
    problem = ValidateRecords(
        gets, "gets", 2, comm_size, static_cast<int64_t>(fetched->element_count()), itemsize,
        window_bytes, [b_offset](int64_t matrix) { return matrix == 0 ? int64_t{0} : b_offset; });
  }
  MPI_Comm private_comm = MPI_COMM_NULL;
  const uint64_t signature = Signature()
                                 .Add(call_id)
                                 .Add(a)
                                 .Add(b)
                                 .Add(*fetched)
                                 .Add(window_bytes)
                                 .Add(b_offset)
                                 .Add(expose_a)
                                 .Add(expose_b)
                                 .Add(gets)
                                 .value();
  if (ffi::Error err =
          Agree(comm, "osmm_fetch", problem,
                {{"window_bytes", window_bytes}, {"b_offset", b_offset}}, signature, &private_comm);
      err.failure()) {
    return err;
  }

  // Every rank accepted its inputs: expose, then one fence epoch of gets.
  WindowLease lease;
  if (ffi::Error err = AcquireWindow(private_comm, WindowSlot::kExpose, window_bytes, &lease);
      err.failure()) {
    return err;
  }
  if (expose_a && a_bytes > 0) std::memcpy(lease.base(), a.untyped_data(), a_bytes);
  if (expose_b && b_bytes > 0) std::memcpy(lease.base() + b_offset, b.untyped_data(), b_bytes);
  if (ffi::Error err = Fence(lease.win(), 0, "osmm_fetch: opening MPI_Win_fence"); err.failure()) {
    return err;
  }
  const double epoch_start = MPI_Wtime();
  int rma_rc = MPI_SUCCESS;
  auto* dest = static_cast<std::byte*>(fetched->untyped_data());
  Counters& counters = GlobalCounters();
  for (size_t i = 0; i < RecordCount(gets) && rma_rc == MPI_SUCCESS; ++i) {
    const Record r = RecordAt(gets, i);
    if (r.rows == 0 || r.cols == 0) continue;
    const int64_t region = r.kind == 0 ? 0 : b_offset;
    const MPI_Aint disp = static_cast<MPI_Aint>(region + (r.row0 * r.ld + r.col0) * itemsize);
    std::byte* origin = dest + r.offset * itemsize;
    // Byte-based: any element type moves the same way.
    rma_rc = IssueRect(r.rows, r.cols * itemsize, r.ld * itemsize, 1, disp, MPI_BYTE,
                       [&](int64_t origin_bytes, int64_t count, MPI_Aint target_disp,
                           MPI_Datatype target_type, int64_t target_count) {
                         return MPI_Get(origin + origin_bytes, static_cast<int>(count), MPI_BYTE,
                                        static_cast<int>(r.target), target_disp,
                                        static_cast<int>(target_count), target_type, lease.win());
                       });
    if (rma_rc == MPI_SUCCESS) {
      counters.rma_ops.fetch_add(1, std::memory_order_relaxed);
      counters.rma_bytes.fetch_add(r.rows * r.cols * itemsize, std::memory_order_relaxed);
      counters.gets.fetch_add(1, std::memory_order_relaxed);
    }
  }
  ffi::Error closing = Fence(lease.win(), MPI_MODE_NOSUCCEED, "osmm_fetch: closing MPI_Win_fence");
  RecordEpochLatency(MPI_Wtime() - epoch_start);
  if (rma_rc != MPI_SUCCESS) return MpiError(rma_rc, "osmm_fetch: MPI_Get");
  return closing;
}

}  // namespace
}  // namespace osmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceStart, osmm::ReduceStartImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // chunk 0
                                  .Arg<xla::ffi::Token>()      // ordering token in
                                  .Ret<xla::ffi::AnyBuffer>()  // ticket
                                  .Ret<xla::ffi::Token>()      // ordering token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("call_id")
                                  .Attr<int64_t>("window_bytes")
                                  .Attr<int64_t>("local_elements")
                                  .Attr<int64_t>("overlap")
                                  .Attr<xla::ffi::Span<const int64_t>>("transfers")
                                  .Attr<xla::ffi::Span<const int64_t>>("chunk_ends")
                                  .Attr<xla::ffi::Span<const int64_t>>("chunk_sizes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceIssue, osmm::ReduceIssueImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // chunk `index`
                                  .Arg<xla::ffi::Token>()      // ordering token in
                                  .Ret<xla::ffi::AnyBuffer>()  // ticket
                                  .Ret<xla::ffi::Token>()      // ordering token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("index"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmReduceFinish, osmm::ReduceFinishImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // local
                                  .Arg<xla::ffi::Token>()      // ordering token in
                                  .RemainingArgs()             // every chunk, kept alive
                                  .Ret<xla::ffi::AnyBuffer>()  // out
                                  .Ret<xla::ffi::Token>()      // ordering token out
                                  .Attr<int64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsmmFetch, osmm::FetchImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()  // a
                                  .Arg<xla::ffi::AnyBuffer>()  // b
                                  .Arg<xla::ffi::Token>()      // ordering token in
                                  .Ret<xla::ffi::AnyBuffer>()  // fetched
                                  .Ret<xla::ffi::Token>()      // ordering token out
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("call_id")
                                  .Attr<int64_t>("window_bytes")
                                  .Attr<int64_t>("b_offset")
                                  .Attr<int64_t>("expose_a")
                                  .Attr<int64_t>("expose_b")
                                  .Attr<xla::ffi::Span<const int64_t>>("gets"));
