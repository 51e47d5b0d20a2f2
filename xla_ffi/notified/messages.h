// The message transport of the notified mode (NotifySpec::messages, flag 8 of the notify
// attribute), for communicators whose ranks talk over a network on which MPI emulates RMA with
// messages (TCP): there a two-sided message is 1.3-4.7x faster than a notified RMA round
// (benchmarks/results/overlap.md, section 6), which needs a flush, a stamp and a credit.
//
// An origin's partials for a target travel with their stamp as one message: [stamp][its
// records, packed in order], which the target receives straight into their places in the
// origin's slot through a datatype of their shapes (learnt once per call signature,
// LearnShapes); or, where it cannot place them so (two records overlap, as accumulates onto
// the same elements may; their row strides differ; over 256 records), [stamp][image], the image
// being the bytes of the slot from the origin's base to the end of its last record, zeros where no
// record lands. A record the RMA transport would accumulate is added onto zeros, as MPI_SUM adds it
// into a zeroed slot, so the slot ends up with the same bits either way. What is sent is staged in
// memory of the transport's own, so a message may stay in flight after the product it belongs to
// was given up; targets whose records are alike (a replicated C summed directly, an all-gather's
// block) share one staged message.
//
// An origin whose product failed or was abandoned before its messages left sends the stamp
// alone. After they left, its targets hear of an abandonment from the notice, as with RMA, and
// not at all of a failure found only at its finish (its partials were right). An origin
// completes its sends in its finish (its part of the product is over once they have left), as
// the RMA transport flushes its puts.
//
// The target posts one receive per origin, straight into that origin's slot, round by round
// in its finish: no credits, since a slot is the target's own until its receive completes. It
// sums the slots exactly as the RMA transport does (notify.cc), so both transports give the
// same bits. A finish that gives its product up cancels its receives that have not completed.
//
// The messages go over a duplicate of the private communicator (the "lane"), all with one
// tag, so a pair's messages match in the order they were sent: every rank runs the same
// products in the same order, and each product has one message per origin and target. The
// notices of abandoned products stay in the sync window (notify.h); when the ranks start again
// (Resync), RestartMessages settles every message in flight by counting what each rank sent
// to each other rank since the last start.
#ifndef OSMM_JAX_XLA_FFI_MESSAGES_H_
#define OSMM_JAX_XLA_FFI_MESSAGES_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/common.h"
#include "core/records.h"

namespace osmm {

struct NotifiedReduce;
struct NotifySpec;

// A record's shape at its target: row0, col0, rows, cols, ld.
constexpr size_t kShapeLength = 5;

// The shapes of this rank's records to `target`, in order (empty records left out), or none
// if they overlap, differ in row stride or number over 256 (then it sends its image).
std::vector<int64_t> PackedShapes(const std::vector<Record>& records, int64_t target);

// Learns each origin's PackedShapes here (NotifySpec::origin_shapes) from the origins, the
// first time a call with this `signature` runs on `comm` (collective: MPI_Ialltoallv), then
// from a cache, as ResolvePositions does.
ffi::Error LearnShapes(MPI_Comm comm, uint64_t signature, const std::vector<Record>& records,
                       NotifySpec* spec);

// A datatype (for MPI_BOTTOM) of the 8-byte `stamp`, then the rectangles `shapes` of
// `itemsize`-byte elements from `at`.
int ShapesType(std::byte* stamp, std::byte* at, const std::vector<int64_t>& shapes,
               int64_t itemsize, MPI_Datatype* out);

// Where an origin's records and their contents are: chunk c holds records
// [chunk_ends[c - 1], chunk_ends[c]) at chunks[c] (null: not issued yet), each record packed
// (rows x cols, row-major) from element `offset` of its chunk.
struct ImageSource {
  const std::vector<Record>& records;
  const std::vector<int64_t>& chunk_ends;
  const std::vector<const std::byte*>& chunks;
  ffi::DataType dtype;
  bool copy_accumulates;  // the RMA transport would put them (ReduceEpoch::slot_puts)
};

// Finds or makes the lane of `n`'s communicator (MPI_Comm_dup the first time, and again for
// a sync window of a new `generation`, after the windows were freed: every rank opens its
// first product with messages at the same call) and readies `n`'s message state.
ffi::Error OpenMessages(NotifiedReduce& n, uint64_t generation);

// Stages this rank's image for `target` (a rank among n.spec.targets) from `source`.
// Returns "" or what went wrong (a record whose chunk was not issued).
std::string StageImage(NotifiedReduce& n, int64_t target, const ImageSource& source);

// Stages and sends the image for every target at once, each with this product's stamp:
// the partials leave as soon as the last chunk is there. Returns "" or what went wrong (the
// targets from the first that could not be staged on get the stamp alone, failed).
std::string SendImages(NotifiedReduce& n, const ImageSource& source);

// Sends `stamp` alone to every target that has had no message of this product yet (a
// product that failed or was abandoned before its partials left).
ffi::Error SendStamps(NotifiedReduce& n, int64_t stamp);

// Sends the message of target number `i` (n.spec.targets): `stamp` and, when its status bits
// are clear, the staged image (none staged: the stamp alone).
ffi::Error SendImage(NotifiedReduce& n, size_t i, int64_t stamp);

// Whether the message to target number `i` has left this rank's memory (*done).
ffi::Error SendDone(NotifiedReduce& n, size_t i, bool* done);

// Posts the receives of origins number [first, end) (n.spec.origins) into their slots.
// `block_bytes`: this rank's C block, of `itemsize`-byte elements.
ffi::Error PostReceives(NotifiedReduce& n, size_t first, size_t end, int64_t block_bytes,
                        int64_t itemsize);

// Whether origin number `k`'s message has arrived (*arrived), and its stamp.
ffi::Error ReceivedStamp(NotifiedReduce& n, size_t k, bool* arrived, int64_t* stamp);

// Cancels this product's receives that have not completed (a product given up): none stays
// posted into the slots, which may be cleared or replaced before the ranks start again.
ffi::Error CancelReceives(NotifiedReduce& n);

// When the ranks start again (notify.cc, Resync; collective, on every rank alike, after every
// rank has stopped sending): receives every message sent to this rank and not yet received,
// into scratch memory, cancels the receives nothing will match, completes every send, and
// starts the counts again. Nothing if no product on `comm` has used messages since its sync
// window of this `generation` was made.
ffi::Error RestartMessages(MPI_Comm comm, uint64_t generation);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_MESSAGES_H_
