// The notified synchronisation of a reduce (OSMM_SYNC=notify): no collective per product.
//
// Every rank's "slots" window (WindowSlot::kSlots) is locked once for its lifetime
// (MPI_Win_lock_all, passive target) and holds an accumulator and `slots` slots, each the size
// of the largest C block: [acc][slot 0]...[slot S-1]. An origin delivers its partials for a
// target into the slot of that target reserved for it (the plan lists every target's origins
// in ascending order; origin number i of a target uses slot i % S in round i / S), then
// completes them (MPI_Win_flush) and notifies the target: an MPI_Accumulate (MPI_REPLACE) of
// a stamp into the target's entry for that origin in a small "sync" window
// (WindowSlot::kSync, also locked for its lifetime). The target waits for exactly the stamps
// of its origins, round by round, and adds its own partial and the slots in ascending rank
// order: the same sum, bit for bit, on every run, and the same on every rank that holds a
// copy of a replicated block.
//
// Two sets of slots (a deferred reduce's products, deferred.h): product p uses set p % 2, so
// when product p - 1 used none of its bytes (the other set, of the same slot size), its first
// round waits only until the target has summed product p - 2, and it may be delivered while
// the target still sums product p - 1.
//
// Slot reuse: a target tells an origin when the slot it will write next is free by pushing
// its progress (products and rounds consumed) into the origin's sync window; an origin whose
// credit has not arrived (it did not deliver to that target last time) reads the target's
// progress itself (MPI_Fetch_and_op). A delivery whose slot is not free yet is deferred to the
// finish, which issues it as soon as its credit arrives while consuming this rank's own
// rounds, so no rank ever blocks another's progress. Under MPIs whose RMA calls wait for the
// target to call MPI (Open MPI's osc/rdma over TCP), a push would hold a target that has
// finished its part until the origin next calls MPI, maybe never (the origin has gone on to
// wait in another library's collective): there targets push nothing, and origins always read
// (spec.pull_credits), so a rank only ever waits for what it needs itself.
//
// Abandoned products: no rank waits for the others at a product, so when one rank's program
// stops between a reduce's start and finish, a rank that does not wait for it there may go on
// into the program's next product, which the others will never run. The abandoning rank's next
// call therefore tells every rank (a notice, before its abandoned stamps); every rank fails
// one product for it (the abandoned one, through the stamp; or the one it waits in when it
// reads the notice; or, if it hears only at its next product's start, that one) and at its
// next notified product all ranks start again together (Resync: complete every RMA call,
// barrier, zero the slots and the stamps and credits, barrier, numbering from 1). Every rank's
// program stopped at the product it failed, so their next products are the same call again.
//
// The message transport (NotifySpec::messages, messages.h) replaces the slots' RMA writes, the
// flush, the stamps' accumulates and the credits by one two-sided message per origin and
// target, received straight into the slot; the numbering, the ordered sum, the abandonment
// notices and Resync are shared.
//
// Sync window layout (int64 entries, P = communicator size): [0, P) the stamp each origin last
// sent this rank; [P, 2P) the progress each target last pushed to this rank; [2P] this rank's
// own progress as a target; [2P + 1] the newest abandonment notice ((generation + 1) << 20 |
// (abandoning rank + 1), MPI_MAX; generation: the number of times the ranks started again);
// [2P + 2, 3P + 2) the stamps of products that use the second of two sets of slots.
// A stamp is (product << 24) | (22 bits of the call id << 2) |
// status: a mismatched call id means the ranks are out of step; the status says that the
// origin could not deliver (an error on that rank) or abandoned the product. Progress is
// (product - 1) * 2^16 + rounds consumed, and product * 2^16 once a product is consumed.
#ifndef OSMM_JAX_XLA_FFI_NOTIFY_H_
#define OSMM_JAX_XLA_FFI_NOTIFY_H_

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer_ops.h"
#include "core/common.h"
#include "core/records.h"

namespace osmm {

// Progress = (product - 1) * this + rounds consumed (see above); also bounds the rounds.
constexpr int64_t kNotifyRoundScale = int64_t{1} << 16;

// A stamp's status bits (see above): the origin could not deliver (an error there), or it
// abandoned the product.
constexpr int64_t kStampFailed = 1;
constexpr int64_t kStampAbandoned = 2;

// This rank's part of a notified reduce, from the "notify" attribute of osmm_reduce_start:
// [slots, slot_bytes, flags, n_origins, origins..., n_targets, targets...], optionally
// followed by [n_origins, bases...] and, with flag 4, [n_origins, extents...]; empty means the
// fence mode. Flags: 1, pull credits; 2, two sets of slots/2 slots, product number p using set
// p % 2, so that a product may deliver while its target still sums the one before (a deferred
// reduce's successor, deferred.h); 4, placement: the origins' records are disjoint parts of
// the target's block (the notified fetch and all-gather move pieces, they sum nothing), so an
// origin's records land at the start of its slot, a slot need only hold the most one origin
// sends, and the target copies each slot's `extent` bytes to byte `base` of its block (the
// rest of the block is its own partial) instead of adding whole slots. Without placement a
// base is where, in bytes from the start of this rank's slot for that origin, the origin's
// records land (0 without them); 8, the message transport: the partials and their stamp
// travel as one two-sided message into a receive the target posts (messages.h), no credits.
// The positions and the bases at each target are learnt from the targets (ResolvePositions).
struct NotifySpec {
  int64_t slots = 0;          // slots per target window (identical on every rank)
  int64_t slot_bytes = 0;     // bytes of a slot (identical on every rank)
  bool pull_credits = false;  // origins read targets' progress; targets push none
  bool two_sets = false;      // the slots are two sets, used by alternate products
  bool place = false;         // disjoint records copied into place, not summed (flag 4)
  bool messages = false;      // the message transport (flag 8, messages.h)
  int64_t per_product() const { return two_sets ? slots / 2 : slots; }  // a product's slots
  std::vector<int64_t> origins;         // ranks that deliver into this rank's block, ascending
  std::vector<int64_t> targets;         // ranks this rank delivers to, ascending
  std::vector<int64_t> origin_bases;    // per origin: where its records land in its slot here
                                        // (placement: in this rank's block)
  std::vector<int64_t> origin_extents;  // placement, per origin: the bytes it sends here
  // The message transport, per origin: its records' shapes here (messages.h, LearnShapes);
  // none: it sends its image.
  std::vector<std::vector<int64_t>> origin_shapes;
  std::vector<int64_t> positions;     // this rank's index among each target's origins
  std::vector<int64_t> bases;         // per target: where this rank's records land in its slot
  std::vector<int64_t> target_bytes;  // per target: bytes of its block (what it sums and
                                      // clears; placement: the bytes it expects from this rank)
  bool enabled() const { return slots > 0; }
};

// Learns this rank's position among each target's origins, its base there and the bytes of
// the target's block (`block_bytes`: this rank's): from the targets themselves, in
// one MPI_Alltoall over `comm` (the private communicator) the first time a call with this
// `signature` runs on it, then from a cache (every rank meets a signature for the first time
// at the same call, as in agreement.h). A target that does not count this rank among its
// origins, or an origin a rank does not deliver to, is a problem (*problem), which the
// finish reports to every rank concerned.
ffi::Error ResolvePositions(MPI_Comm comm, uint64_t signature, int64_t block_bytes,
                            NotifySpec* spec, std::string* problem);

// Whether every record, from the base its target gave (ResolvePositions), ends within that
// target's block (the part of the slot the target sums and clears): "" if so, else why not (a
// target's layout of its slot that does not match this rank's records).
std::string CheckSlotExtents(const NotifySpec& spec, const std::vector<Record>& records,
                             int64_t itemsize);

// Parses and checks the attribute (local checks, before the agreement). Returns the problem,
// or "". `block_bytes`: this rank's C block; `window_bytes` must be (1 + slots) * slot_bytes.
std::string ParseNotifySpec(ffi::Span<const int64_t> flat, int rank, int size, int64_t window_bytes,
                            int64_t block_bytes, NotifySpec* out);

// One notified reduce in flight on this rank.
struct NotifiedReduce {
  NotifySpec spec;
  MPI_Comm comm = MPI_COMM_NULL;  // the private communicator
  int rank = 0;
  int size = 1;
  int64_t product = 0;     // this product's number among the notified ones on `comm` (1, 2, ...)
  int64_t first_slot = 0;  // two sets: where this product's set starts (0 or slots / 2)
  bool other_set_before = false;  // the product before used none of this one's slots
  int64_t stamp = 0;              // the stamp this rank sends (failed bit clear)
  MPI_Win slot_win = MPI_WIN_NULL;
  std::byte* slot_base = nullptr;
  MPI_Win sync_win = MPI_WIN_NULL;
  int64_t* sync_base = nullptr;
  std::vector<int> target_state;  // per spec.targets entry: 0 undecided, 1 issuing, 2 deferred
  std::vector<double> last_read;  // per target: when its progress was last read remotely
  bool background = false;        // finished by a waiter beside the computation (deferred.h)
  int64_t run = 0;                // the program run that opened it (current_run; 0: unknown)
  // The message transport (messages.h): the lane, and per target the id of this product's
  // message there, per origin the id of its posted receive (-1: none) and the stamp it
  // brought (-1: not yet).
  struct MessageLane* lane = nullptr;
  std::vector<int64_t> sends;
  std::vector<int64_t> receives;
  std::vector<int64_t> arrived;
  // The images this product staged, by layout: targets whose records are alike share one.
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<std::vector<std::byte>>>> images;
};

// Placement: the slot of the origin numbered `index` here (its `extent` bytes) into byte
// `base` of `out`, where `local` is zero (out = local + slot: the slot's values, a -0.0
// arriving as 0.0 as in a sum); clears the slot.
ffi::Error PlaceSlot(BufferOps& ops, const NotifiedReduce& n, size_t index, std::byte* slot,
                     ffi::DataType dtype, const void* local, void* out);

// Placement: `out` = `local` wherever no origin's bytes land (this rank's own part; `elements`
// in the block): nothing to do where they are one buffer (XLA aliases them), else through the
// accumulator, which placement never writes and so stays zero.
ffi::Error PlaceLocal(BufferOps& ops, const NotifiedReduce& n, ffi::DataType dtype,
                      const void* local, void* out, int64_t elements);

// Opens a notified reduce on `comm` (a private communicator; collective only when a window
// must be created or grown, identically on every rank): the slots window of `window_bytes`
// and the sync window, and this product's number. `call_id` is the call's id. A local problem
// with the slots window (the platform could not use it) goes to *local: the finish must still
// run, so that the other ranks hear of it.
ffi::Error OpenNotified(BufferOps& ops, MPI_Comm comm, const NotifySpec& spec, int64_t call_id,
                        int64_t window_bytes, NotifiedReduce* out, ffi::Error* local);

// Byte displacement in `target`'s slots window of where this rank's records land: its slot
// there, plus its base (NotifySpec::bases).
MPI_Aint SlotDisplacement(const NotifiedReduce& n, int64_t target);

// Whether this rank may deliver to `target` now (its slot is free), deciding once per product:
// a target found busy stays deferred to FinishNotified. Local (no remote read).
bool MayDeliverNow(NotifiedReduce& n, int64_t target);

// The end of a notified reduce on this rank, whatever happened before: issues the deferred
// deliveries (`deliver(target)` issues every record to `target` that was deferred; returns
// "" or what failed) once their slots are free, completes and notifies every target (with the
// failed status if `problem` is not empty, the abandoned one if `abandoned`), waits for every
// origin's stamp round by round and
// adds them with `local` into `out` in ascending rank order (`out` == nullptr: discards them,
// for an abandoned product), and frees the slots for the next product. Returns an error for
// a failed MPI call, a timeout or ranks out of step; otherwise success, with *failure set to
// why the result is unusable ("" if it is usable).
ffi::Error FinishNotified(BufferOps& ops, NotifiedReduce& n,
                          const std::function<std::string(int64_t)>& deliver,
                          const std::string& problem, bool abandoned, ffi::DataType dtype,
                          const void* local, void* out, int64_t elements, std::string* failure);

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_NOTIFY_H_
