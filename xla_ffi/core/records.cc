#include "core/records.h"

#include <limits>

namespace osmm {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

std::string Describe(const char* what, size_t index, const Record& r) {
  return std::string(what) + " record " + std::to_string(index) + " [" + std::to_string(r.kind) +
         ", " + std::to_string(r.target) + ", " + std::to_string(r.offset) + ", " +
         std::to_string(r.rows) + ", " + std::to_string(r.cols) + ", " + std::to_string(r.row0) +
         ", " + std::to_string(r.col0) + ", " + std::to_string(r.ld) + "]: ";
}

}  // namespace

std::string ValidateRecords(ffi::Span<const int64_t> flat, const char* what, int64_t num_kinds,
                            int comm_size, int64_t origin_elements, int64_t itemsize,
                            int64_t window_bytes,
                            const std::function<int64_t(int64_t)>& region_base) {
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

}  // namespace osmm
