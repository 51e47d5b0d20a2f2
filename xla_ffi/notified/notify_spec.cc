// The notify attribute of a reduce and what the origins and targets learn from each other
// about their slots (notify.h); the protocol itself is in notify.cc.
#include <algorithm>
#include <mutex>
#include <utility>

#include "notified/notify.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

std::string CheckRanks(const std::vector<int64_t>& ranks, int rank, int size, const char* what) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size || ranks[i] == rank ||
        (i > 0 && ranks[i] <= ranks[i - 1])) {
      return std::string("notify: the ") + what + " must be other ranks, ascending";
    }
  }
  return std::string();
}

}  // namespace

std::string ParseNotifySpec(ffi::Span<const int64_t> flat, int rank, int size, int64_t window_bytes,
                            int64_t block_bytes, NotifySpec* out) {
  *out = NotifySpec();
  if (flat.size() == 0) return std::string();
  const int64_t* v = flat.begin();
  const int64_t count = static_cast<int64_t>(flat.size());
  int64_t at = 4;
  if (count < 5 || v[2] < 0 || v[2] > 15 || v[3] < 0 || v[3] > count - 5) {
    return "notify: malformed attribute";
  }
  out->slots = v[0];
  out->slot_bytes = v[1];
  out->pull_credits = (v[2] & 1) != 0;
  out->two_sets = (v[2] & 2) != 0;
  out->place = (v[2] & 4) != 0;
  out->messages = (v[2] & 8) != 0;
  out->origins.assign(v + at, v + at + v[3]);
  at += v[3];
  const int64_t ntargets = v[at++];
  if (ntargets < 0 || at + ntargets > count) return "notify: malformed attribute";
  out->targets.assign(v + at, v + at + ntargets);
  at += ntargets;
  out->origin_bases.assign(out->origins.size(), 0);
  if (at < count) {  // the bases
    if (v[at] != v[3] || at + 1 + v[3] > count) return "notify: malformed attribute";
    out->origin_bases.assign(v + at + 1, v + at + 1 + v[3]);
    at += 1 + v[3];
  }
  if (out->place) {  // the extents
    if (at >= count || v[at] != v[3] || at + 1 + v[3] != count) {
      return "notify: malformed attribute";
    }
    out->origin_extents.assign(v + at + 1, v + count);
  } else if (at != count) {
    return "notify: malformed attribute";
  }
  int64_t expected = 0;
  if (out->two_sets && (out->slots < 2 || out->slots % 2 != 0)) {
    return "notify: two sets of slots need an even number of slots, got " +
           std::to_string(out->slots);
  }
  if (out->slots < 1 || (!out->place && out->slot_bytes < block_bytes) ||
      out->slot_bytes % 64 != 0 || !MulOk(out->slots + 1, out->slot_bytes, &expected) ||
      expected != window_bytes) {
    return "notify: slots (" + std::to_string(out->slots) + ") x slot_bytes (" +
           std::to_string(out->slot_bytes) + ") do not match the window (" +
           std::to_string(window_bytes) + " bytes) or this rank's C block (" +
           std::to_string(block_bytes) + " bytes)";
  }
  for (size_t i = 0; i < out->origin_bases.size() && !out->place; ++i) {
    const int64_t base = out->origin_bases[i];
    if (base < 0 || base >= out->slot_bytes) {
      return "notify: a base (" + std::to_string(base) + ") outside the " +
             std::to_string(out->slot_bytes) + "-byte slot";
    }
  }
  for (size_t i = 0; i < out->origin_extents.size(); ++i) {
    const int64_t base = out->origin_bases[i];
    const int64_t extent = out->origin_extents[i];
    if (base < 0 || extent < 0 || extent > out->slot_bytes || base > block_bytes - extent) {
      return "notify: origin " + std::to_string(out->origins[i]) + "'s " + std::to_string(extent) +
             " bytes at byte " + std::to_string(base) + " do not fit this rank's " +
             std::to_string(block_bytes) + "-byte block or the " + std::to_string(out->slot_bytes) +
             "-byte slot";
    }
  }
  std::string problem = CheckRanks(out->origins, rank, size, "origins");
  if (problem.empty()) problem = CheckRanks(out->targets, rank, size, "targets");
  if (problem.empty() &&
      static_cast<int64_t>(out->origins.size()) / out->per_product() >= kNotifyRoundScale) {
    problem = "notify: too many rounds of origins for the slots";
  }
  return problem;
}

ffi::Error ResolvePositions(MPI_Comm comm, uint64_t signature, int64_t block_bytes,
                            NotifySpec* spec, std::string* problem) {
  static std::mutex* mu = new std::mutex();
  struct Learnt {
    std::vector<int64_t> positions, bases, target_bytes;
    std::string problem;  // kept too: every rank runs the exchange once per signature
  };
  static auto* known = new std::vector<std::pair<std::pair<uint64_t, uint64_t>, Learnt>>();
  const std::pair<uint64_t, uint64_t> key(CommKey(comm), signature);
  {
    std::lock_guard<std::mutex> lock(*mu);
    for (const auto& entry : *known) {
      if (entry.first == key) {
        spec->positions = entry.second.positions;
        spec->bases = entry.second.bases;
        spec->target_bytes = entry.second.target_bytes;
        *problem = entry.second.problem;
        return ffi::Error::Success();
      }
    }
  }
  int size = 0;
  int rank = 0;
  MPI_Comm_size(comm, &size);
  MPI_Comm_rank(comm, &rank);
  // To each rank: its number among this rank's origins (-1: not an origin), where its records
  // land in its slot here and the bytes of this rank's block; back from each: the same of
  // this rank there.
  constexpr size_t kEntries = 3;
  std::vector<int64_t> send(kEntries * static_cast<size_t>(size), -1);
  std::vector<int64_t> received(kEntries * static_cast<size_t>(size), -1);
  // Placement: an origin's records land at the start of its slot, within what this rank expects.
  for (size_t i = 0; i < spec->origins.size(); ++i) {
    int64_t* entry = send.data() + kEntries * static_cast<size_t>(spec->origins[i]);
    entry[0] = static_cast<int64_t>(i);
    entry[1] = spec->place ? 0 : spec->origin_bases[i];
    entry[2] = spec->place ? spec->origin_extents[i] : block_bytes;
  }
  MPI_Request request = MPI_REQUEST_NULL;
  if (int rc = MPI_Ialltoall(send.data(), kEntries, MPI_INT64_T, received.data(), kEntries,
                             MPI_INT64_T, comm, &request);
      rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_reduce_start: MPI_Ialltoall (slot positions)");
  }
  if (ffi::Error err = WaitBounded(&request, comm, Step::kAgreement,
                                   "osmm_reduce_start: the slot positions (MPI_Ialltoall)");
      err.failure()) {
    return err;
  }
  Learnt learnt;
  for (int r = 0; r < size && problem->empty(); ++r) {
    const int64_t* entry = received.data() + kEntries * static_cast<size_t>(r);
    const bool target = std::binary_search(spec->targets.begin(), spec->targets.end(), r);
    if (target != (entry[0] >= 0)) {
      *problem = "notify: rank " + std::to_string(rank) +
                 (target ? " delivers to" : " does not deliver to") + " rank " + std::to_string(r) +
                 ", but that rank's plan says otherwise";
    } else if (target) {
      learnt.positions.push_back(entry[0]);
      learnt.bases.push_back(entry[1]);
      learnt.target_bytes.push_back(entry[2]);
    }
  }
  std::lock_guard<std::mutex> lock(*mu);
  if (!problem->empty()) {
    known->emplace_back(key, Learnt{{}, {}, {}, *problem});
    return ffi::Error::Success();
  }
  spec->positions = learnt.positions;
  spec->bases = learnt.bases;
  spec->target_bytes = learnt.target_bytes;
  known->emplace_back(key, std::move(learnt));
  return ffi::Error::Success();
}

std::string CheckSlotExtents(const NotifySpec& spec, const std::vector<Record>& records,
                             int64_t itemsize) {
  for (const Record& r : records) {
    if (r.rows == 0 || r.cols == 0) continue;
    const auto it = std::lower_bound(spec.targets.begin(), spec.targets.end(), r.target);
    const size_t i = static_cast<size_t>(it - spec.targets.begin());
    // The record's last byte at the target, exclusive (ValidateRecords bounded it already).
    const int64_t end = ((r.row0 + r.rows - 1) * r.ld + r.col0 + r.cols) * itemsize;
    if (spec.bases[i] + end > spec.target_bytes[i]) {
      return "notify: rank " + std::to_string(r.target) + " places this rank's records " +
             std::to_string(spec.bases[i]) + " bytes into its " +
             std::to_string(spec.target_bytes[i]) + "-byte block, where a record ending at " +
             "byte " + std::to_string(end) + " does not fit: nothing was delivered";
    }
  }
  return std::string();
}

}  // namespace osmm
