#include "notified/messages.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "core/counters.h"
#include "notified/notify.h"
#include "watchdog/watchdog.h"

namespace osmm {

// One message of the lane: a send's [stamp][image] (shared by the targets whose images are
// alike, see StageImage), or a receive's stamp (its image goes straight into a slot).
struct Message {
  MPI_Request request = MPI_REQUEST_NULL;
  int peer = 0;
  std::shared_ptr<std::vector<std::byte>> data;
};

// The transport's state on one private communicator. Its mutex guards everything: a
// deferred product's waiter and the next product's start may use the lane at once.
struct MessageLane {
  uint64_t key = 0;         // CommKey of the private communicator (0: an old lane, unused)
  uint64_t generation = 0;  // of the sync window it was made with (windows.h)
  MPI_Comm comm = MPI_COMM_NULL;
  std::mutex mu;
  std::map<int64_t, Message> sends;     // by id, in the order they were made
  std::map<int64_t, Message> receives;  // by id, in the order they were posted
  int64_t next_id = 0;
  std::vector<int64_t> sent;      // per rank: messages sent to it since the last start
  std::vector<int64_t> received;  // per rank: messages received from it since then
  // Where messages nobody had posted a receive for were taken when the ranks last started
  // again (kept until the next start, in case that one did not complete).
  std::vector<std::vector<std::byte>> scratch;
};

namespace {

constexpr int kTag = 0;
constexpr int64_t kStampBytes = 8;
constexpr int64_t kUnitBytes = int64_t{1} << 20;  // large blocks move in units of this

std::vector<std::unique_ptr<MessageLane>>& Lanes(std::mutex** mu) {
  static std::mutex* lanes_mu = new std::mutex();
  static auto* lanes = new std::vector<std::unique_ptr<MessageLane>>();
  *mu = lanes_mu;
  return *lanes;
}

MessageLane* FindLane(uint64_t key) {
  std::mutex* mu = nullptr;
  auto& lanes = Lanes(&mu);
  std::lock_guard<std::mutex> lock(*mu);
  for (auto& lane : lanes) {
    if (lane->key == key) return lane.get();
  }
  return nullptr;
}

// A datatype of the bytes of `blocks` (address, bytes) at their absolute addresses (use with
// MPI_BOTTOM), in units so that no count overflows an int.
int BytesType(const std::vector<std::pair<const void*, int64_t>>& blocks, MPI_Datatype* out) {
  MPI_Datatype unit = MPI_DATATYPE_NULL;
  int rc = MPI_Type_contiguous(static_cast<int>(kUnitBytes), MPI_BYTE, &unit);
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  std::vector<MPI_Datatype> types;
  for (const auto& [address, bytes] : blocks) {
    MPI_Aint at = 0;
    if (rc == MPI_SUCCESS) rc = MPI_Get_address(address, &at);
    if (bytes >= kUnitBytes) {
      lengths.push_back(static_cast<int>(bytes / kUnitBytes));
      addresses.push_back(at);
      types.push_back(unit);
    }
    if (bytes % kUnitBytes != 0) {
      lengths.push_back(static_cast<int>(bytes % kUnitBytes));
      addresses.push_back(at + static_cast<MPI_Aint>(bytes - bytes % kUnitBytes));
      types.push_back(MPI_BYTE);
    }
  }
  if (rc == MPI_SUCCESS) {
    rc = MPI_Type_create_struct(static_cast<int>(lengths.size()), lengths.data(), addresses.data(),
                                types.data(), out);
  }
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(out);
  if (unit != MPI_DATATYPE_NULL) MPI_Type_free(&unit);
  return rc;
}

size_t TargetIndex(const NotifiedReduce& n, int64_t target) {
  const auto it = std::lower_bound(n.spec.targets.begin(), n.spec.targets.end(), target);
  return static_cast<size_t>(it - n.spec.targets.begin());
}

template <typename T>
void AddInto(std::byte* to, const std::byte* from, int64_t count) {
  T* t = reinterpret_cast<T*>(to);
  const T* f = reinterpret_cast<const T*>(from);
  for (int64_t i = 0; i < count; ++i) t[i] = t[i] + f[i];
}

// Waits, polling, until `done()` says so (the watchdog bounds it in raise mode).
template <typename Done>
ffi::Error PollUntil(MPI_Comm comm, const char* what, const Done& done) {
  PollWait wait(Step::kBarrier, comm, what);
  for (;;) {
    bool finished = false;
    if (ffi::Error err = done(&finished); err.failure()) return err;
    if (finished) return ffi::Error::Success();
    if (ffi::Error err = wait.Idle(); err.failure()) return err;
  }
}

}  // namespace

ffi::Error OpenMessages(NotifiedReduce& n, uint64_t generation) {
  const uint64_t key = CommKey(n.comm);
  n.lane = FindLane(key);
  if (n.lane != nullptr && n.lane->generation != generation) {
    // Made before the windows were freed (its communicator's handle reused since, maybe):
    // left as it is, since MPI may still own its buffers, and never found again.
    std::lock_guard<std::mutex> lock(n.lane->mu);
    n.lane->key = 0;
    n.lane = nullptr;
  }
  if (n.lane == nullptr) {
    auto lane = std::make_unique<MessageLane>();
    {
      BlockingStep blocking(Step::kCommDup, n.comm);
      if (int rc = MPI_Comm_dup(n.comm, &lane->comm); rc != MPI_SUCCESS) {
        return MpiError(rc, "osmm_reduce (notified, messages): MPI_Comm_dup");
      }
    }
    lane->key = key;
    lane->generation = generation;
    lane->sent.assign(static_cast<size_t>(n.size), 0);
    lane->received.assign(static_cast<size_t>(n.size), 0);
    std::mutex* mu = nullptr;
    auto& lanes = Lanes(&mu);
    std::lock_guard<std::mutex> lock(*mu);
    lanes.push_back(std::move(lane));
    n.lane = lanes.back().get();
  }
  n.sends.assign(n.spec.targets.size(), -1);
  n.receives.assign(n.spec.origins.size(), -1);
  n.arrived.assign(n.spec.origins.size(), -1);
  return ffi::Error::Success();
}

std::string StageImage(NotifiedReduce& n, int64_t target, const ImageSource& source) {
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(source.dtype));
  // The image's layout: targets whose records are alike (a replicated C summed directly, an
  // all-gather's block) share one staged image.
  std::vector<int64_t> layout;
  std::vector<std::pair<size_t, size_t>> mine;  // (record, chunk)
  int64_t image_bytes = 0;
  int64_t payload = 0;
  size_t chunk = 0;
  for (size_t i = 0; i < source.records.size(); ++i) {
    while (static_cast<int64_t>(i) >= source.chunk_ends[chunk]) ++chunk;
    const Record& r = source.records[i];
    if (r.target != target || r.rows == 0 || r.cols == 0) continue;
    if (source.chunks[chunk] == nullptr) {
      return "osmm_reduce (notified, messages): chunk " + std::to_string(chunk) +
             " was not issued before its records were sent";
    }
    mine.emplace_back(i, chunk);
    const int64_t end = ((r.row0 + r.rows - 1) * r.ld + r.col0 + r.cols) * itemsize;
    image_bytes = std::max(image_bytes, end);
    payload += r.rows * r.cols * itemsize;
    layout.insert(layout.end(), {static_cast<int64_t>(chunk), r.kind, r.offset, r.rows, r.cols,
                                 r.row0, r.col0, r.ld});
  }
  std::shared_ptr<std::vector<std::byte>> buffer;
  for (const auto& [alike, staged] : n.images) {
    if (alike == layout) buffer = staged;
  }
  if (buffer == nullptr) {
    // Packed (records one after another, as the target's datatype places them), or the image.
    const bool packed = !PackedShapes(source.records, target).empty();
    const int64_t bytes = packed ? payload : image_bytes;
    buffer = std::make_shared<std::vector<std::byte>>(kStampBytes + bytes, std::byte{0});
    std::memcpy(buffer->data(), &n.stamp, kStampBytes);
    std::byte* image = buffer->data() + kStampBytes;
    int64_t packed_at = 0;
    for (const auto& [i, c] : mine) {
      const Record& r = source.records[i];
      const bool add = r.kind == kOpAccumulate && !source.copy_accumulates;
      const std::byte* from = source.chunks[c] + r.offset * itemsize;
      for (int64_t row = 0; row < r.rows; ++row, packed_at += r.cols * itemsize) {
        std::byte* to = image + (packed ? packed_at : ((r.row0 + row) * r.ld + r.col0) * itemsize);
        const std::byte* src = from + row * r.cols * itemsize;
        if (!add) {
          std::memcpy(to, src, static_cast<size_t>(r.cols * itemsize));
        } else if (source.dtype == ffi::DataType::F64) {
          AddInto<double>(to, src, r.cols);
        } else {
          AddInto<float>(to, src, r.cols);
        }
      }
    }
    n.images.emplace_back(std::move(layout), buffer);
  }
  Counters& counters = GlobalCounters();
  counters.rma_bytes.fetch_add(payload, std::memory_order_relaxed);
  counters.sent_bytes.fetch_add(payload, std::memory_order_relaxed);
  Message message;
  message.peer = static_cast<int>(target);
  message.data = std::move(buffer);
  std::lock_guard<std::mutex> lock(n.lane->mu);
  const int64_t id = n.lane->next_id++;
  n.lane->sends.emplace(id, std::move(message));
  n.sends[TargetIndex(n, target)] = id;
  return std::string();
}

std::string SendImages(NotifiedReduce& n, const ImageSource& source) {
  std::string problem;
  for (size_t i = 0; i < n.spec.targets.size(); ++i) {
    if (problem.empty()) problem = StageImage(n, n.spec.targets[i], source);
    // A target after a problem still gets its message now, the stamp alone: a product's
    // messages leave in product order, before any of the next product's.
    const int64_t stamp = n.stamp | (problem.empty() ? 0 : kStampFailed);
    if (ffi::Error err = SendImage(n, i, stamp); err.failure()) return err.message();
    n.target_state[i] = 1;
  }
  return problem;
}

ffi::Error SendStamps(NotifiedReduce& n, int64_t stamp) {
  for (size_t i = 0; i < n.spec.targets.size(); ++i) {
    if (n.target_state[i] == 1) continue;
    if (ffi::Error err = SendImage(n, i, stamp); err.failure()) return err;
    n.target_state[i] = 1;
  }
  return ffi::Error::Success();
}

ffi::Error SendImage(NotifiedReduce& n, size_t i, int64_t stamp) {
  MessageLane& lane = *n.lane;
  std::lock_guard<std::mutex> lock(lane.mu);
  auto it = lane.sends.find(n.sends[i]);
  if (it == lane.sends.end()) {
    Message message;
    message.peer = static_cast<int>(n.spec.targets[i]);
    n.sends[i] = lane.next_id++;
    it = lane.sends.emplace(n.sends[i], std::move(message)).first;
  }
  Message& m = it->second;
  if (m.data == nullptr || stamp != n.stamp) {
    // Nothing staged, or a failed or abandoned product: the stamp alone.
    m.data = std::make_shared<std::vector<std::byte>>(kStampBytes);
    std::memcpy(m.data->data(), &stamp, kStampBytes);
  }
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int rc = BytesType({{m.data->data(), static_cast<int64_t>(m.data->size())}}, &type);
  if (rc == MPI_SUCCESS) rc = MPI_Isend(MPI_BOTTOM, 1, type, m.peer, kTag, lane.comm, &m.request);
  if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified, messages): MPI_Isend");
  lane.sent[static_cast<size_t>(m.peer)] += 1;
  Counters& counters = GlobalCounters();
  counters.notifications.fetch_add(1, std::memory_order_relaxed);
  counters.messages.fetch_add(1, std::memory_order_relaxed);
  counters.message_bytes.fetch_add(static_cast<int64_t>(m.data->size()), std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error SendDone(NotifiedReduce& n, size_t i, bool* done) {
  MessageLane& lane = *n.lane;
  std::lock_guard<std::mutex> lock(lane.mu);
  auto it = lane.sends.find(n.sends[i]);
  *done = it == lane.sends.end();
  if (*done) return ffi::Error::Success();
  int flag = 0;
  if (int rc = MPI_Test(&it->second.request, &flag, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_reduce (notified, messages): MPI_Test (a send)");
  }
  if (flag != 0) {
    lane.sends.erase(it);
    *done = true;
  }
  return ffi::Error::Success();
}

ffi::Error PostReceives(NotifiedReduce& n, size_t first, size_t end, int64_t block_bytes,
                        int64_t itemsize) {
  MessageLane& lane = *n.lane;
  std::lock_guard<std::mutex> lock(lane.mu);
  const size_t slots = static_cast<size_t>(n.spec.per_product());
  for (size_t k = first; k < end; ++k) {
    const size_t index = static_cast<size_t>(n.first_slot) + k % slots;
    std::byte* slot = n.slot_base + (1 + index) * n.spec.slot_bytes;
    // Placement: the origin's part at the start of its slot; a sum: from its base to the end
    // of this rank's block.
    const int64_t base = n.spec.place ? 0 : n.spec.origin_bases[k];
    const int64_t bytes = n.spec.place ? n.spec.origin_extents[k] : block_bytes - base;
    Message m;
    m.peer = static_cast<int>(n.spec.origins[k]);
    m.data = std::make_shared<std::vector<std::byte>>(kStampBytes);
    MPI_Datatype type = MPI_DATATYPE_NULL;
    int rc = MPI_SUCCESS;
    if (k < n.spec.origin_shapes.size() && !n.spec.origin_shapes[k].empty()) {
      rc = ShapesType(m.data->data(), slot + base, n.spec.origin_shapes[k], itemsize, &type);
    } else {
      std::vector<std::pair<const void*, int64_t>> blocks = {{m.data->data(), kStampBytes}};
      if (bytes > 0) blocks.emplace_back(slot + base, bytes);
      rc = BytesType(blocks, &type);
    }
    if (rc == MPI_SUCCESS) {
      rc = MPI_Irecv(MPI_BOTTOM, 1, type, m.peer, kTag, lane.comm, &m.request);
    }
    if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
    if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified, messages): MPI_Irecv");
    n.receives[k] = lane.next_id++;
    lane.receives.emplace(n.receives[k], std::move(m));
  }
  return ffi::Error::Success();
}

ffi::Error ReceivedStamp(NotifiedReduce& n, size_t k, bool* arrived, int64_t* stamp) {
  *arrived = n.arrived[k] >= 0;
  *stamp = n.arrived[k];
  if (*arrived) return ffi::Error::Success();
  MessageLane& lane = *n.lane;
  std::lock_guard<std::mutex> lock(lane.mu);
  auto it = lane.receives.find(n.receives[k]);
  if (it == lane.receives.end()) {
    return ffi::Error::Internal("osmm_reduce (notified, messages): no receive posted for rank " +
                                std::to_string(n.spec.origins[k]));
  }
  int flag = 0;
  MPI_Status status;
  if (int rc = MPI_Test(&it->second.request, &flag, &status); rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_reduce (notified, messages): MPI_Test (a receive from rank " +
                            std::to_string(n.spec.origins[k]) + ")");
  }
  if (flag == 0) return ffi::Error::Success();
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  std::memcpy(stamp, it->second.data->data(), kStampBytes);
  lane.received[static_cast<size_t>(it->second.peer)] += 1;
  lane.receives.erase(it);
  if (count != MPI_UNDEFINED && count < kStampBytes) {
    return ffi::Error::Internal("osmm_reduce (notified, messages): a message of " +
                                std::to_string(count) + " bytes from rank " +
                                std::to_string(n.spec.origins[k]) + " has no stamp");
  }
  n.arrived[k] = *stamp;
  *arrived = true;
  return ffi::Error::Success();
}

ffi::Error CancelReceives(NotifiedReduce& n) {
  MessageLane& lane = *n.lane;
  std::lock_guard<std::mutex> lock(lane.mu);
  std::vector<std::map<int64_t, Message>::iterator> pending;
  for (int64_t id : n.receives) {
    auto it = lane.receives.find(id);
    if (it == lane.receives.end()) continue;
    MPI_Cancel(&it->second.request);
    pending.push_back(it);
  }
  // A receive already matched completes with its message (on its way: the origin is sending).
  for (auto it : pending) {
    ffi::Error err =
        PollUntil(n.comm, "osmm_reduce (notified, messages): a cancelled receive", [&](bool* done) {
          int flag = 0;
          MPI_Status status;
          int rc = MPI_Test(&it->second.request, &flag, &status);
          int cancelled = 0;
          if (flag != 0) MPI_Test_cancelled(&status, &cancelled);
          if (flag != 0 && cancelled == 0) {
            lane.received[static_cast<size_t>(it->second.peer)] += 1;
          }
          *done = flag != 0;
          return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Test");
        });
    if (err.failure()) return err;  // the receive stays in the lane, its stamp alive
    lane.receives.erase(it);
  }
  return ffi::Error::Success();
}

namespace {

// Takes the next message from `origin` on the lane, which nobody posted a receive for, into
// scratch memory; its request goes to `settle`.
ffi::Error TakeStray(MPI_Comm comm, MessageLane& lane, int origin,
                     std::vector<MPI_Request>* settle) {
  MPI_Message matched = MPI_MESSAGE_NULL;
  MPI_Status status;
  ffi::Error err =
      PollUntil(comm,
                "osmm_reduce (notified, messages): starting again: a message "
                "still in flight (MPI_Improbe)",
                [&](bool* done) {
                  int flag = 0;
                  int rc = MPI_Improbe(origin, kTag, lane.comm, &flag, &matched, &status);
                  *done = flag != 0;
                  return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Improbe");
                });
  if (err.failure()) return err;
  MPI_Count bytes = 0;
  MPI_Get_elements_x(&status, MPI_BYTE, &bytes);
  lane.scratch.emplace_back(static_cast<size_t>(std::max<MPI_Count>(bytes, 1)));
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int rc = BytesType({{lane.scratch.back().data(), static_cast<int64_t>(bytes)}}, &type);
  settle->push_back(MPI_REQUEST_NULL);
  if (rc == MPI_SUCCESS) rc = MPI_Imrecv(MPI_BOTTOM, 1, type, &matched, &settle->back());
  if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  if (rc != MPI_SUCCESS) return MpiError(rc, "osmm_reduce (notified, messages): MPI_Imrecv");
  return ffi::Error::Success();
}

}  // namespace

ffi::Error RestartMessages(MPI_Comm comm, uint64_t generation) {
  MessageLane* found = FindLane(CommKey(comm));
  // A lane of windows since freed (its handle reused) is not this communicator's.
  if (found == nullptr || found->generation != generation) return ffi::Error::Success();
  MessageLane& lane = *found;
  std::lock_guard<std::mutex> lock(lane.mu);
  const size_t size = lane.sent.size();
  std::vector<int64_t> owed(size, 0);  // per origin: what it sent here, not received yet
  MPI_Request request = MPI_REQUEST_NULL;
  if (int rc = MPI_Ialltoall(lane.sent.data(), 1, MPI_INT64_T, owed.data(), 1, MPI_INT64_T,
                             lane.comm, &request);
      rc != MPI_SUCCESS) {
    return MpiError(rc, "osmm_reduce (notified, messages): starting again: MPI_Ialltoall");
  }
  if (ffi::Error err = WaitBounded(&request, comm, Step::kBarrier,
                                   "osmm_reduce (notified, messages): starting again: the "
                                   "counts of messages in flight (MPI_Ialltoall)");
      err.failure()) {
    return err;
  }
  for (size_t r = 0; r < size; ++r) owed[r] -= lane.received[r];
  lane.scratch.clear();  // the last start completed: nothing of MPI's is in it
  // Per origin, the first receives posted match what it still has in flight (one tag, in
  // order); the others will match nothing and are cancelled; the rest of what it sent is
  // taken into scratch memory.
  std::vector<MPI_Request> settle;
  for (auto& [id, m] : lane.receives) {
    int64_t& left = owed[static_cast<size_t>(m.peer)];
    if (left > 0) {
      --left;
    } else {
      MPI_Cancel(&m.request);
    }
    settle.push_back(m.request);
  }
  for (size_t r = 0; r < size; ++r) {
    for (; owed[r] > 0; --owed[r]) {
      if (ffi::Error err = TakeStray(comm, lane, static_cast<int>(r), &settle); err.failure()) {
        return err;
      }
    }
  }
  for (auto& [id, m] : lane.sends) settle.push_back(m.request);
  ffi::Error err =
      PollUntil(comm,
                "osmm_reduce (notified, messages): starting again: the messages "
                "in flight (MPI_Testall)",
                [&](bool* done) {
                  int flag = 0;
                  int rc = MPI_Testall(static_cast<int>(settle.size()), settle.data(), &flag,
                                       MPI_STATUSES_IGNORE);
                  *done = flag != 0;
                  return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Testall");
                });
  if (err.failure()) return err;  // the buffers stay: MPI may still own them
  lane.receives.clear();
  lane.sends.clear();
  std::fill(lane.sent.begin(), lane.sent.end(), 0);
  std::fill(lane.received.begin(), lane.received.end(), 0);
  return ffi::Error::Success();
}

}  // namespace osmm
