// The target's fixed-order sum of a notified reduce (notify.h): its own partial and its
// origins' slots, in ascending rank order, the same bits on every run and every transport.
#ifndef OSMM_JAX_XLA_FFI_ORDERED_SUM_H_
#define OSMM_JAX_XLA_FFI_ORDERED_SUM_H_

#include <cstddef>
#include <cstdint>

#include "core/buffer_ops.h"
#include "core/common.h"

namespace osmm {

// The fixed-order sum of this rank's block: its own partial and its origins' slots, added in
// ascending rank order as a left fold (IEEE addition is commutative, so each step may put
// either operand first; only the grouping must be the same everywhere).
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
        state_ = kAcc;
        return Accumulate(slot, /*copy=*/true);
      case kAcc:
        return Accumulate(slot, /*copy=*/false);
      case kLocalPending:
        state_ = kOut;
        return ops_.AddWindowInto(dtype_, local_, slot, out_, n_);
      case kOut:
        return ops_.AddWindowInto(dtype_, out_, slot, out_, n_);
    }
    return ffi::Error::Success();
  }

 private:
  enum State { kEmpty, kAcc, kLocalPending, kOut };

  // acc (+)= slot, then slot = 0; both in host window memory.
  ffi::Error Accumulate(std::byte* slot, bool copy) {
    if (dtype_ == ffi::DataType::F32) {
      AddHost(reinterpret_cast<float*>(acc_), reinterpret_cast<float*>(slot), copy);
    } else {
      AddHost(reinterpret_cast<double*>(acc_), reinterpret_cast<double*>(slot), copy);
    }
    return ffi::Error::Success();
  }
  template <typename T>
  void AddHost(T* acc, T* slot, bool copy) {
    for (int64_t i = 0; i < n_; ++i) {
      acc[i] = copy ? slot[i] : acc[i] + slot[i];
      slot[i] = T(0);
    }
  }

  BufferOps& ops_;
  ffi::DataType dtype_;
  const void* local_;
  void* out_;
  std::byte* acc_;
  int64_t n_;
  bool origin_above_;
  State state_ = kEmpty;
};

}  // namespace osmm

#endif  // OSMM_JAX_XLA_FFI_ORDERED_SUM_H_
