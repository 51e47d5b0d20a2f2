// The target's fixed-order sum of a notified reduce (notify.h): its own partial and its
// origins' slots, in ascending rank order, the same bits on every run and every transport.
#ifndef OSMM_JAX_XLA_FFI_ORDERED_SUM_H_
#define OSMM_JAX_XLA_FFI_ORDERED_SUM_H_

#include <cstddef>
#include <cstdint>

#include "core/buffer_ops.h"
#include "core/common.h"
#include "core/counters.h"

namespace osmm {

// The fixed-order sum of this rank's block: its own partial and its origins' slots, added in
// ascending rank order as a left fold (IEEE addition is commutative, so each step may put
// either operand first; only the grouping must be the same everywhere).
//
// The sum of the origins below this rank, formed before its own partial joins (`out` is
// that partial's buffer), is held in the slot of the last origin added while the round
// lasts; only when a round ends with it (EndRound: the slots are about to be reused) does it
// move to the window's accumulator. So the accumulator is touched, and made resident, only
// where a round of origins all below this rank is followed by another.
class OrderedSum {
 public:
  OrderedSum(BufferOps& ops, ffi::DataType dtype, const void* local, void* out, std::byte* acc,
             int64_t elements, bool origin_above)
      : ops_(ops),
        dtype_(dtype),
        local_(local),
        out_(out),
        acc_(acc),
        n_(elements),
        origin_above_(origin_above) {}

  ffi::Error AddLocal() {
    if (state_ == kHeld) {
      state_ = kOut;  // local + the sum so far, held in a slot
      return ops_.AddWindowInto(dtype_, local_, held_, out_, n_);
    }
    if (state_ == kEmpty && !origin_above_ && local_ == out_) {
      state_ = kOut;  // no origin: the sum is the partial, in place (the acc stays untouched)
      return ffi::Error::Success();
    }
    if (state_ == kAcc || (state_ == kEmpty && !origin_above_)) {
      state_ = kOut;  // local + the sum so far (an all-zero acc when nothing came)
      return ops_.AddWindowInto(dtype_, local_, acc_, out_, n_);
    }
    state_ = kLocalPending;
    return ffi::Error::Success();
  }

  ffi::Error AddSlot(std::byte* slot) {
    switch (state_) {
      case kEmpty:
        state_ = kHeld;
        held_ = slot;
        return ffi::Error::Success();
      case kHeld:  // slot (+)= the sum held so far, which moves there
        Fold(held_, slot, /*copy=*/false);
        held_ = slot;
        return ffi::Error::Success();
      case kAcc:
        Fold(slot, acc_, /*copy=*/false);
        return ffi::Error::Success();
      case kLocalPending:
        state_ = kOut;
        return ops_.AddWindowInto(dtype_, local_, slot, out_, n_);
      case kOut:
        return ops_.AddWindowInto(dtype_, out_, slot, out_, n_);
    }
    return ffi::Error::Success();
  }

  // The end of a round of slots: a sum still held in one of them takes this rank's partial
  // (`last`: no origin comes after) or moves to the accumulator.
  ffi::Error EndRound(bool last) {
    if (state_ != kHeld) return ffi::Error::Success();
    if (last) return AddLocal();
    GlobalCounters().accumulator_folds.fetch_add(1, std::memory_order_relaxed);
    Fold(held_, acc_, /*copy=*/true);
    state_ = kAcc;
    return ffi::Error::Success();
  }

  // Whether this rank's own partial has been added (or is waiting for the next slot).
  bool has_local() const { return state_ == kLocalPending || state_ == kOut; }

 private:
  enum State { kEmpty, kHeld, kAcc, kLocalPending, kOut };

  // into (+)= from (copy: into = from), then from = 0; both in host window memory.
  void Fold(std::byte* from, std::byte* into, bool copy) {
    if (dtype_ == ffi::DataType::F32) {
      AddHost(reinterpret_cast<float*>(into), reinterpret_cast<float*>(from), copy);
    } else {
      AddHost(reinterpret_cast<double*>(into), reinterpret_cast<double*>(from), copy);
    }
  }
  template <typename T>
  void AddHost(T* into, T* from, bool copy) {
    for (int64_t i = 0; i < n_; ++i) {
      into[i] = copy ? from[i] : into[i] + from[i];
      from[i] = T(0);
    }
  }

  BufferOps& ops_;
  ffi::DataType dtype_;
  const void* local_;
  void* out_;
  std::byte* acc_;
  std::byte* held_ = nullptr;  // kHeld: the slot that holds the sum so far
  int64_t n_;
  bool origin_above_;
  State state_ = kEmpty;
};

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_ORDERED_SUM_H_
