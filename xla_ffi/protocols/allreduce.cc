#include "protocols/allreduce.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <string>

#include "core/windows.h"
#include "watchdog/watchdog.h"

namespace osmm {
namespace {

bool MpiType(ffi::DataType dtype, MPI_Datatype* type, int64_t* bytes) {
  switch (dtype) {
    case ffi::DataType::F32:
      *type = MPI_FLOAT;
      *bytes = 4;
      return true;
    case ffi::DataType::F64:
      *type = MPI_DOUBLE;
      *bytes = 8;
      return true;
    case ffi::DataType::S32:
      *type = MPI_INT32_T;
      *bytes = 4;
      return true;
    case ffi::DataType::S64:
      *type = MPI_INT64_T;
      *bytes = 8;
      return true;
    default:
      return false;
  }
}

}  // namespace

ffi::Error AllreduceSum(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t comm_handle) {
  constexpr const char* kWhat = "osmm_allreduce: MPI_Iallreduce";
  CallComm call;
  if (ffi::Error err = OpenCall("osmm_allreduce", comm_handle, &call); err.failure()) return err;
  if (ffi::Error err = CheckUsable(call.comm); err.failure()) return err;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int64_t item_bytes = 0;
  if (!MpiType(in.element_type(), &type, &item_bytes) || out->element_type() != in.element_type()) {
    return ffi::Error::InvalidArgument(
        "osmm_allreduce: only float32, float64, int32 and int64 buffers of one dtype are summed");
  }
  const int64_t count = static_cast<int64_t>(in.element_count());
  if (static_cast<int64_t>(out->element_count()) != count) {
    return ffi::Error::InvalidArgument("osmm_allreduce: input and output sizes differ");
  }
  MPI_Comm comm = MPI_COMM_NULL;
  if (ffi::Error err = PrivateComm(call.comm, &comm); err.failure()) return err;
  if (ffi::Error err = CheckUsable(comm); err.failure()) return err;
  BeginCall(CallKind::kInGraph, 0);
  CallScope call_scope;
  const bool in_place = in.untyped_data() == out->untyped_data();
  const auto* src = static_cast<const char*>(in.untyped_data());
  auto* dst = static_cast<char*>(out->untyped_data());
  // MPI counts are ints: sum in pieces of at most INT_MAX elements (the same on every rank).
  for (int64_t done = 0; done < count;) {
    const int piece = static_cast<int>(std::min<int64_t>(count - done, INT_MAX));
    const int64_t offset = done * item_bytes;
    MPI_Request request = MPI_REQUEST_NULL;
    int rc = MPI_Iallreduce(in_place ? MPI_IN_PLACE : src + offset, dst + offset, piece, type,
                            MPI_SUM, comm, &request);
    if (rc != MPI_SUCCESS) return MpiError(rc, kWhat);
    if (ffi::Error err = WaitBounded(&request, comm, Step::kAllreduce, kWhat); err.failure()) {
      return err;
    }
    done += piece;
  }
  return ffi::Error::Success();
}

}  // namespace osmm
