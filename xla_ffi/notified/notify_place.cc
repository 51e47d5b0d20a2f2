// Placement (notify.h, NotifySpec::place): the notified fetch's and all-gather's slots copied
// into place in the target's block instead of summed over it; and where an origin's slot at a
// target begins (SlotDisplacement).
#include <algorithm>
#include <utility>
#include <vector>

#include "notified/notify.h"

namespace osmm {

// The slot of the origin numbered `index` here into its place
// in `out` (its `extent` bytes at byte `base`; `local` there is zero, so out = local + slot is
// the slot's values, a -0.0 arriving as 0.0 as in a sum), clearing the slot.
ffi::Error PlaceSlot(BufferOps& ops, const NotifiedReduce& n, size_t index, std::byte* slot,
                     ffi::DataType dtype, const void* local, void* out) {
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  const int64_t base = n.spec.origin_bases[index];
  const int64_t extent = n.spec.origin_extents[index];
  if (extent == 0) return ffi::Error::Success();
  return ops.AddWindowInto(dtype, static_cast<const std::byte*>(local) + base, slot,
                           static_cast<std::byte*>(out) + base, extent / itemsize);
}

// `out` = `local` wherever no origin's bytes land (this rank's own part), through
// the accumulator, which placement never writes and so stays zero, a slot's bytes at a time.
// Where `local` is `out` (XLA aliases the finish's result to its operand) the own part is in
// place already: reading the accumulator would only make its pages resident (within a node
// its memory is a shared file, whose unwritten pages a read allocates).
ffi::Error PlaceLocal(BufferOps& ops, const NotifiedReduce& n, ffi::DataType dtype,
                      const void* local, void* out, int64_t elements) {
  if (local == out) return ffi::Error::Success();
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(dtype));
  std::vector<std::pair<int64_t, int64_t>> taken;  // [begin, end) bytes the origins fill
  for (size_t i = 0; i < n.spec.origin_extents.size(); ++i) {
    const int64_t begin = n.spec.origin_bases[i];
    taken.emplace_back(begin, begin + n.spec.origin_extents[i]);
  }
  taken.emplace_back(elements * itemsize, elements * itemsize);
  std::sort(taken.begin(), taken.end());
  int64_t at = 0;
  for (const auto& [begin, end] : taken) {
    while (at < begin) {
      const int64_t bytes = std::min(begin - at, n.spec.slot_bytes);
      if (ffi::Error err =
              ops.AddWindowInto(dtype, static_cast<const std::byte*>(local) + at, n.slot_base,
                                static_cast<std::byte*>(out) + at, bytes / itemsize);
          err.failure()) {
        return err;
      }
      at += bytes;
    }
    at = std::max(at, end);
  }
  return ffi::Error::Success();
}

MPI_Aint SlotDisplacement(const NotifiedReduce& n, int64_t target) {
  const auto it = std::lower_bound(n.spec.targets.begin(), n.spec.targets.end(), target);
  const size_t i = static_cast<size_t>(it - n.spec.targets.begin());
  const int64_t position = n.spec.positions[i];
  const int64_t slot = n.first_slot + position % n.spec.per_product();
  return static_cast<MPI_Aint>((1 + slot) * n.spec.slot_bytes + n.spec.bases[i]);
}

}  // namespace osmm
