// The transfer-record format shared by the handlers and the Python lowering (which reads the
// constants below through the nanobind module, see native.py), and the records' validation.
//
// Handlers receive their transfers as a flat int64 array attribute of kRecordLength-int64
// records, one field per RecordField:
//
//   osmm_reduce_start "transfers": [kind, target, offset, rows, cols, row0, col0, ld]
//       kind = kOpAccumulate (MPI_SUM) or kOpPut. Sends the contiguous row-major rows x cols
//       block at element `offset` of its chunk into `target`'s reduce window, whose memory
//       holds the target's local C block row-major with `ld` elements per row, at element
//       (row0, col0). Records are grouped by chunk: "chunk_ends" gives each chunk's end
//       (exclusive, in records) and "chunk_sizes" its buffer's length in elements.
//   osmm_fetch "gets":         [kind, target, offset, rows, cols, row0, col0, ld]
//       kind = kRegionA or kRegionB: which region of `target`'s expose window the get reads.
//       Copies the rows x cols rect at (row0, col0) of that region (row stride `ld` elements)
//       into fetched[offset : offset + rows*cols] row-major.
#ifndef OSMM_JAX_XLA_FFI_RECORDS_H_
#define OSMM_JAX_XLA_FFI_RECORDS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "core/common.h"

namespace osmm {

// Field positions inside a record; their count is the record length.
enum RecordField : int {
  kFieldKind = 0,  // reduce: the operation (RecordOp); fetch: the window region (RecordRegion)
  kFieldTarget,    // rank on the communicator
  kFieldOffset,    // element offset in the origin buffer (the chunk, or `fetched`)
  kFieldRows,
  kFieldCols,
  kFieldRow0,  // position of the rect in the target's block
  kFieldCol0,
  kFieldLd,  // the target block's row stride, in elements
  kRecordLength
};

// The kind of a reduce record.
enum RecordOp : int64_t {
  kOpAccumulate = 0,  // MPI_Accumulate with MPI_SUM
  kOpPut = 1,         // MPI_Put
  kOpCount = 2,
};

// The kind of a fetch record: which region of the expose window it reads.
enum RecordRegion : int64_t {
  kRegionA = 0,  // the A block, at byte 0
  kRegionB = 1,  // the B block, at byte b_offset
  kRegionCount = 2,
};

inline constexpr const char* kRecordFieldNames[kRecordLength] = {"kind", "target", "offset", "rows",
                                                                 "cols", "row0",   "col0",   "ld"};

struct Record {
  int64_t kind;
  int64_t target;
  int64_t offset;
  int64_t rows;
  int64_t cols;
  int64_t row0;
  int64_t col0;
  int64_t ld;
};

inline Record RecordAt(ffi::Span<const int64_t> flat, size_t i) {
  const int64_t* r = flat.begin() + i * kRecordLength;
  return Record{r[kFieldKind], r[kFieldTarget], r[kFieldOffset], r[kFieldRows],
                r[kFieldCols], r[kFieldRow0],   r[kFieldCol0],   r[kFieldLd]};
}

inline size_t RecordCount(ffi::Span<const int64_t> flat) { return flat.size() / kRecordLength; }

// Checks every record of `flat`; returns an empty string if all are valid, else a description
// of the first bad one. Kinds must lie in [0, num_kinds) and targets in [0, comm_size); the
// origin range must lie within `origin_elements`; `region_base(kind)` is the byte offset of
// the target region of that kind inside the window, and the target rect must end within
// `window_bytes`.
std::string ValidateRecords(ffi::Span<const int64_t> flat, const char* what, int64_t num_kinds,
                            int comm_size, int64_t origin_elements, int64_t itemsize,
                            int64_t window_bytes,
                            const std::function<int64_t(int64_t)>& region_base);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_RECORDS_H_
