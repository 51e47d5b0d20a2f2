// The message transport's record shapes (messages.h): what an origin sends a target, learnt
// once per call signature, so that the target receives the origin's packed records straight
// into their places in its slot.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "notified/messages.h"
#include "notified/notify.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

// Whether two rectangles of `shapes` overlap, or their row strides differ (then a packed
// receive could not place them: the origin sends its image instead).
bool NeedsImage(const std::vector<int64_t>& shapes) {
  const size_t count = shapes.size() / kShapeLength;
  if (count * count > (size_t{1} << 16)) return true;
  for (size_t i = 0; i < count; ++i) {
    const int64_t* a = shapes.data() + i * kShapeLength;
    for (size_t j = i + 1; j < count; ++j) {
      const int64_t* b = shapes.data() + j * kShapeLength;
      if (a[4] != b[4]) return true;
      const bool rows = a[0] < b[0] + b[2] && b[0] < a[0] + a[2];
      const bool cols = a[1] < b[1] + b[3] && b[1] < a[1] + a[3];
      if (rows && cols) return true;
    }
  }
  return false;
}

ffi::Error Wait(MPI_Request* request, MPI_Comm comm, int rc) {
  if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified, messages): record shapes");
  return WaitBounded(request, comm, Step::kAgreement,
                     "osmm_reduce (notified, messages): the record shapes (MPI_Ialltoallv)");
}

}  // namespace

std::vector<int64_t> PackedShapes(const std::vector<Record>& records, int64_t target) {
  std::vector<int64_t> shapes;
  for (const Record& r : records) {
    if (r.target != target || r.rows == 0 || r.cols == 0) continue;
    shapes.insert(shapes.end(), {r.row0, r.col0, r.rows, r.cols, r.ld});
  }
  if (NeedsImage(shapes)) shapes.clear();
  return shapes;
}

ffi::Error LearnShapes(MPI_Comm comm, uint64_t signature, const std::vector<Record>& records,
                       NotifySpec* spec) {
  static std::mutex* mu = new std::mutex();
  static auto* known =
      new std::map<std::pair<uint64_t, uint64_t>, std::vector<std::vector<int64_t>>>();
  const std::pair<uint64_t, uint64_t> key(CommKey(comm), signature);
  {
    std::lock_guard<std::mutex> lock(*mu);
    if (auto it = known->find(key); it != known->end()) {
      spec->origin_shapes = it->second;
      return ffi::Error::Success();
    }
  }
  int size = 0;
  MPI_Comm_size(comm, &size);
  std::vector<int> send_counts(static_cast<size_t>(size), 0);
  std::vector<int> counts(static_cast<size_t>(size), 0);
  std::vector<int64_t> sent;
  for (int64_t target : spec->targets) {
    std::vector<int64_t> shapes = PackedShapes(records, target);
    send_counts[static_cast<size_t>(target)] = static_cast<int>(shapes.size());
    sent.insert(sent.end(), shapes.begin(), shapes.end());
  }
  MPI_Request request = MPI_REQUEST_NULL;
  if (ffi::Error err = Wait(
          &request, comm,
          MPI_Ialltoall(send_counts.data(), 1, MPI_INT, counts.data(), 1, MPI_INT, comm, &request));
      err.failure()) {
    return err;
  }
  std::vector<int> send_at(static_cast<size_t>(size), 0);
  std::vector<int> at(static_cast<size_t>(size), 0);
  for (size_t r = 1; r < send_at.size(); ++r) {
    send_at[r] = send_at[r - 1] + send_counts[r - 1];
    at[r] = at[r - 1] + counts[r - 1];
  }
  std::vector<int64_t> received(static_cast<size_t>(at.back() + counts.back()) + 1);
  if (ffi::Error err = Wait(
          &request, comm,
          MPI_Ialltoallv(sent.data(), send_counts.data(), send_at.data(), MPI_INT64_T,
                         received.data(), counts.data(), at.data(), MPI_INT64_T, comm, &request));
      err.failure()) {
    return err;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t origin : spec->origins) {
    const int64_t* from = received.data() + at[static_cast<size_t>(origin)];
    shapes.emplace_back(from, from + counts[static_cast<size_t>(origin)]);
  }
  spec->origin_shapes = shapes;
  std::lock_guard<std::mutex> lock(*mu);
  known->emplace(key, std::move(shapes));
  return ffi::Error::Success();
}

int ShapesType(std::byte* stamp, std::byte* at, const std::vector<int64_t>& shapes,
               int64_t itemsize, MPI_Datatype* out) {
  const size_t count = shapes.size() / kShapeLength;
  std::vector<int> lengths(count + 1, 1);
  std::vector<MPI_Aint> addresses(count + 1, 0);
  std::vector<MPI_Datatype> types(count + 1, MPI_BYTE);
  lengths[0] = 8;
  int rc = MPI_Get_address(stamp, &addresses[0]);
  size_t made = 0;  // hvector types made
  for (size_t i = 0; i < count && rc == MPI_SUCCESS; ++i) {
    const int64_t* s = shapes.data() + i * kShapeLength;
    rc = MPI_Type_create_hvector(static_cast<int>(s[2]), static_cast<int>(s[3] * itemsize),
                                 static_cast<MPI_Aint>(s[4] * itemsize), MPI_BYTE, &types[i + 1]);
    if (rc != MPI_SUCCESS) break;
    ++made;
    rc = MPI_Get_address(at + (s[0] * s[4] + s[1]) * itemsize, &addresses[i + 1]);
  }
  if (rc == MPI_SUCCESS) {
    rc = MPI_Type_create_struct(static_cast<int>(count + 1), lengths.data(), addresses.data(),
                                types.data(), out);
  }
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(out);
  for (size_t i = 1; i <= made; ++i) MPI_Type_free(&types[i]);
  return rc;
}

}  // namespace osmm
