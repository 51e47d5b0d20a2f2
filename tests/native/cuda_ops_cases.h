// The cases that tests/native/cuda_ops_driver.cc runs on both platforms: the transfer records
// of each rank, the contents of its blocks and chunks, and the bytes each call must give, all
// functions of the ranks so that every rank knows what every other rank sends it.
//   fetch:  float32, bfloat16, float16, float64 (growing the window), A only, empty blocks; gets
//           of strided rects, single rows, whole rows and empty rects from every other rank.
//   reduce: float32, float64 overlapped (the issuer thread; growing the window), float32 with
//           `out` aliasing `local`; chunks of accumulates (strided, whole rows, one element,
//           empty) and puts at their offsets, an empty chunk, then the add of the received sum;
//           bfloat16, which both platforms must refuse alike; and the same notified (a slot
//           per origin, the sum in rank order).
#ifndef OSMM_JAX_TESTS_NATIVE_CUDA_OPS_CASES_H_
#define OSMM_JAX_TESTS_NATIVE_CUDA_OPS_CASES_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/common.h"
#include "core/records.h"

namespace osmm {

using Bytes = std::vector<std::byte>;

// A call's result: its error message, or the bytes of its results.
struct Outcome {
  std::string error;
  Bytes bytes;
};

// --- records ------------------------------------------------------------------------------------

// Transfer records (records.h), each placed after the previous one in the origin buffer.
struct RecordList {
  std::vector<int64_t> flat;
  int64_t elements = 0;

  void Add(int64_t kind, int64_t target, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
           int64_t ld) {
    flat.insert(flat.end(), {kind, target, elements, rows, cols, row0, col0, ld});
    elements += rows * cols;
  }
};

// --- fetch --------------------------------------------------------------------------------------

constexpr int64_t kACols = 5;  // every A block is a_rows x 5
constexpr int64_t kBRows = 5;  // every B block is 5 x b_cols

struct FetchCase {
  const char* name;
  ffi::DataType dtype;
  int64_t a_rows;  // 6, or 0: an empty A block
  int64_t b_cols;  // 7, or 0: an empty B block
  bool expose_b;
  int64_t slack;  // window bytes beyond the blocks
};

inline const FetchCase kFetchCases[] = {
    {"fetch float32", ffi::DataType::F32, 6, 7, true, 0},
    {"fetch bfloat16", ffi::DataType::BF16, 6, 7, true, 0},
    {"fetch float16", ffi::DataType::F16, 6, 7, true, 8},
    {"fetch float64, a larger window", ffi::DataType::F64, 6, 7, true, 256},
    {"fetch float32, A only", ffi::DataType::F32, 6, 7, false, 0},
    {"fetch float32, empty blocks", ffi::DataType::F32, 0, 0, true, 64},
};

// Byte `index` of `rank`'s block in window region `region`: a formula, so that every rank knows
// every rank's blocks.
inline std::byte BlockByte(int rank, int64_t region, int64_t index) {
  return static_cast<std::byte>((rank * 61 + region * 29 + index * 7 + 3) & 0xff);
}

inline Bytes Block(int rank, int64_t region, int64_t bytes) {
  Bytes block(static_cast<size_t>(bytes));
  for (int64_t i = 0; i < bytes; ++i) block[i] = BlockByte(rank, region, i);
  return block;
}

// What rank `me` gets from every other rank: strided rects, a single row, whole rows, an empty
// rect.
inline RecordList FetchGets(const FetchCase& c, int me, int size) {
  RecordList gets;
  for (int t = 0; t < size; ++t) {
    if (t == me) continue;
    if (c.a_rows > 0) {
      gets.Add(kRegionA, t, 3, 3, 2, 1, kACols);
      gets.Add(kRegionA, t, 1, 4, c.a_rows - 1, 0, kACols);
    }
    gets.Add(kRegionA, t, 0, 3, 0, 0, kACols);
    if (c.expose_b && c.b_cols > 0) {
      gets.Add(kRegionB, t, 2, c.b_cols, 1, 0, c.b_cols);
      gets.Add(kRegionB, t, 4, 2, 0, c.b_cols - 2, c.b_cols);
    }
  }
  return gets;
}

inline Outcome ExpectedFetch(const FetchCase& c, const RecordList& gets) {
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(c.dtype));
  Outcome expected;
  expected.bytes.resize(static_cast<size_t>(gets.elements * itemsize));
  for (size_t n = 0; n < RecordCount(gets.flat); ++n) {
    const Record r = RecordAt(gets.flat, n);
    for (int64_t i = 0; i < r.rows * r.cols * itemsize; ++i) {
      const int64_t row = i / (r.cols * itemsize);
      const int64_t in_row = i % (r.cols * itemsize);
      const int64_t source = ((r.row0 + row) * r.ld + r.col0) * itemsize + in_row;
      expected.bytes[r.offset * itemsize + i] =
          BlockByte(static_cast<int>(r.target), r.kind, source);
    }
  }
  return expected;
}

// --- reduce -------------------------------------------------------------------------------------

constexpr int64_t kCRows = 5;  // every rank's local C block is 5 x 6
constexpr int64_t kCCols = 6;
constexpr int kChunks = 3;

struct ReduceCase {
  const char* name;
  ffi::DataType dtype;
  bool overlap;
  bool out_is_local;    // `out` aliases `local`
  int64_t slack;        // window bytes beyond the C block
  bool notify = false;  // the notified reduce (notify.h): a slot per origin, no fences
};

inline const ReduceCase kReduceCases[] = {
    {"reduce float32", ffi::DataType::F32, false, false, 0},
    {"reduce float64 overlapped, a larger window", ffi::DataType::F64, true, false, 0},
    {"reduce float32 overlapped, out aliasing local", ffi::DataType::F32, true, true, 64},
    {"reduce bfloat16, refused", ffi::DataType::BF16, false, false, 0},
    {"reduce float32 notified", ffi::DataType::F32, false, false, 0, true},
    {"reduce float64 notified, overlapped, out aliasing local", ffi::DataType::F64, true, true, 0,
     true},
};

// Chunk `chunk` of rank `origin`, to every other rank: accumulates into rows 0..3 of the target's
// block (a strided rect, whole rows, an empty rect, one element) and a put into row 4, at
// columns no other rank writes; chunk 1 is empty, chunk 0 has an element no record sends.
inline RecordList ReduceChunk(int origin, int size, int chunk) {
  RecordList records;
  for (int t = 0; t < size; ++t) {
    if (t == origin) continue;
    if (chunk == 0) {
      records.Add(kOpAccumulate, t, 2, 3, 1, 2, kCCols);
      records.Add(kOpPut, t, 1, 2, 4, 2 * origin, kCCols);
    } else if (chunk == 2) {
      records.Add(kOpAccumulate, t, 2, kCCols, 2, 0, kCCols);
      records.Add(kOpAccumulate, t, 0, kCCols, 0, 0, kCCols);
      records.Add(kOpAccumulate, t, 1, 1, 0, 5, kCCols);
    }
  }
  if (chunk == 0) records.elements += 1;
  return records;
}

// Small integers: every sum is exact in every dtype, whatever order the partials arrive in.
inline double ChunkValue(int origin, int chunk, int64_t i) {
  return (origin + 1) * 10 + chunk * 3 + i % 7;
}
inline double LocalValue(int rank, int64_t i) { return rank * 100 + i; }

inline Bytes Encode(ffi::DataType dtype, const std::vector<double>& values) {
  Bytes bytes(values.size() * ffi::ByteWidth(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const float single = static_cast<float>(values[i]);
    uint32_t bits = 0;
    std::memcpy(&bits, &single, sizeof(bits));
    const uint16_t bfloat = static_cast<uint16_t>(bits >> 16);  // exact for these values
    if (dtype == ffi::DataType::F64) std::memcpy(&bytes[8 * i], &values[i], 8);
    if (dtype == ffi::DataType::F32) std::memcpy(&bytes[4 * i], &single, 4);
    if (dtype == ffi::DataType::BF16) std::memcpy(&bytes[2 * i], &bfloat, 2);
  }
  return bytes;
}

// Rank `me`'s out block, then the ticket: what the reduce's records call for.
inline Outcome ExpectedReduce(const ReduceCase& c, int me, int size) {
  if (c.dtype == ffi::DataType::BF16) return Outcome{"unsupported dtype", Bytes()};
  std::vector<double> out(kCRows * kCCols);
  for (int64_t i = 0; i < kCRows * kCCols; ++i) out[i] = LocalValue(me, i);
  for (int origin = 0; origin < size; ++origin) {
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      const RecordList records = ReduceChunk(origin, size, chunk);
      for (size_t n = 0; n < RecordCount(records.flat); ++n) {
        const Record r = RecordAt(records.flat, n);
        for (int64_t i = 0; r.target == me && i < r.rows * r.cols; ++i) {
          const double value = ChunkValue(origin, chunk, r.offset + i);
          double& target = out[(r.row0 + i / r.cols) * r.ld + r.col0 + i % r.cols];
          // A put replaces the window's zero, and the local block is added later.
          target = r.kind == kOpPut ? LocalValue(me, &target - out.data()) + value : target + value;
        }
      }
    }
  }
  Outcome expected{std::string(), Encode(c.dtype, out)};
  const int32_t ticket = kChunks - 1;
  const auto* ticket_bytes = reinterpret_cast<const std::byte*>(&ticket);
  expected.bytes.insert(expected.bytes.end(), ticket_bytes, ticket_bytes + sizeof(ticket));
  return expected;
}

}  // namespace osmm

#endif  // OSMM_JAX_TESTS_NATIVE_CUDA_OPS_CASES_H_
