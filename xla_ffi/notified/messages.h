// The message transport of the notified mode (NotifySpec::messages, flag 8 of the notify
// attribute), for communicators whose ranks talk over a network on which MPI emulates RMA with
// messages (TCP): there a two-sided message is 1.3-4.7x faster than a notified RMA round
// (benchmarks/results/overlap.md, section 6), which needs a flush, a stamp and a credit.
//
// An origin's partials for a target travel with their stamp as one message, [stamp][image]:
// the image is the bytes of the origin's slot at that target from its base to the end of its
// last record (zeros where no record lands; a record the RMA transport would accumulate is
// added into the zeroed image, as MPI_SUM adds it into a zeroed slot, so the slot ends up with
// the same bits). The image is staged in memory of the transport's own, so a message may stay
// in flight after the product it belongs to was given up. A failed or abandoned origin sends
// the stamp alone. The target posts one receive per origin, straight into that origin's slot,
// round by round in its finish: no credits, since a slot is the target's own until its
// receive completes. It then sums the slots exactly as the RMA transport does (notify.cc), so
// both transports give the same bits.
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

// Finds or makes the lane of `n`'s communicator (MPI_Comm_dup the first time: every rank
// opens its first product with messages at the same call) and readies `n`'s message state.
ffi::Error OpenMessages(NotifiedReduce& n);

// Stages this rank's image for `target` (a rank among n.spec.targets) from `source`.
// Returns "" or what went wrong (a record whose chunk was not issued).
std::string StageImage(NotifiedReduce& n, int64_t target, const ImageSource& source);

// Stages and sends the image for every target at once, each with this product's stamp:
// the partials leave as soon as the last chunk is there. Returns "" or what went wrong.
std::string SendImages(NotifiedReduce& n, const ImageSource& source);

// Sends the message of target number `i` (n.spec.targets): `stamp` and, when its status bits
// are clear, the staged image (none staged: the stamp alone).
ffi::Error SendImage(NotifiedReduce& n, size_t i, int64_t stamp);

// Whether the message to target number `i` has left this rank's memory (*done).
ffi::Error SendDone(NotifiedReduce& n, size_t i, bool* done);

// Posts the receives of origins number [first, end) (n.spec.origins) into their slots.
// `block_bytes`: this rank's C block.
ffi::Error PostReceives(NotifiedReduce& n, size_t first, size_t end, int64_t block_bytes);

// Whether origin number `k`'s message has arrived (*arrived), and its stamp.
ffi::Error ReceivedStamp(NotifiedReduce& n, size_t k, bool* arrived, int64_t* stamp);

// When the ranks start again (notify.cc, Resync; collective, on every rank alike, after every
// rank has stopped sending): receives every message sent to this rank and not yet received,
// into scratch memory, cancels the receives nothing will match, completes every send, and
// starts the counts again. Nothing if no product on `comm` used messages.
ffi::Error RestartMessages(MPI_Comm comm);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_MESSAGES_H_
