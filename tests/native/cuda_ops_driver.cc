// Runs the CUDA platform's BufferOps (CudaBufferOps, xla_ffi/cuda/cuda_ops.cc, compiled unchanged
// against the host stand-in for the CUDA runtime in cuda_standin/) and the CPU platform's
// (HostBufferOps, host_handlers.cc) through the native core's fetch and reduce (fetch.h,
// reduce.h), on the same transfer records, and checks byte for byte that the CUDA path gives what
// the CPU path gives, and the CPU path what the records call for. Every rank runs it, under
// mpiexec; built and run by tests/runtime/test_cuda_ops_standin.py. Exit status 0: every check
// passed on every rank.
//
// Each case of cuda_ops_cases.h runs once per platform, with the handlers' operands built as XLA
// hands them over (an FFI buffer descriptor; for CUDA, device memory whose contents are still
// being copied in on XLA's stream, and XLA's scratch allocator in the reduce finish), over the
// windows both platforms share. Two rounds, with every window and staging buffer freed in
// between (as native.free_windows does), then checks that nothing pinned, registered or
// allocated is left. A product abandoned by rank 0 must fail on every rank and clear its window,
// on either platform and in either mode (a device-memory window's header is a host window of its
// own).
// Modes, from the environment: OSMM_CUDA_AWARE=1 runs CudaBufferOps' CUDA-aware mode (windows in
// device memory), where OSMM_STANDIN_MPI_CUDA=1 makes this MPI report CUDA support (see
// MPIX_Query_cuda_support below); without it, every CUDA call must be refused on every rank.
// In host-staged mode (the default) a rank asking for a device that does not exist must fail
// the call on every rank too.
//
// What only a GPU can check: the kernel itself (cuda_kernels.cu), real asynchrony and pinning,
// an MPI that reads and writes device memory, XLA's own buffers, streams and scratch memory
// (tests/mpi/runtime/test_gpu.py, `make gpu-test`).

// HostBufferOps lives in an anonymous namespace: including its file compares against the code
// XLA:CPU runs rather than a copy of it.
#include "handlers/host_handlers.cc"  // NOLINT(build/include)

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "core/records.h"
#include "core/windows.h"
#include "cuda/cuda_ops.h"
#include "cuda_ops_cases.h"
#include "protocols/issuer.h"

// Takes the place of the MPI library's (cuda_ops.cc refers to it weakly): CUDA support as
// OSMM_STANDIN_MPI_CUDA says, so that the CUDA-aware mode can run over the stand-in's "device"
// memory, which is host memory any MPI can use.
extern "C" int MPIX_Query_cuda_support(void) {
  const char* value = std::getenv("OSMM_STANDIN_MPI_CUDA");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

namespace osmm {
namespace {

int checks = 0;
int failures = 0;

int Rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int Size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// MPI_COMM_WORLD as the `comm` attribute the handlers get (mpi4py's handle).
int64_t Comm() {
  int64_t handle = 0;
  MPI_Comm comm = MPI_COMM_WORLD;
  std::memcpy(&handle, &comm, sizeof(comm));
  return handle;
}

void Expect(bool ok, const std::string& what) {
  checks += 1;
  if (!ok) {
    failures += 1;
    std::printf("rank %d: FAILED: %s\n", Rank(), what.c_str());
  }
}

void Must(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::printf("rank %d: %s failed: %s\n", Rank(), what, cudaGetErrorName(rc));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

// --- the two platforms, as their handlers (host_handlers.cc, cuda_module.cc) set them up -------

struct Side {
  bool cuda = false;
  cudaStream_t stream = nullptr;  // XLA's stream
  int32_t device = 0;             // XLA's device ordinal
};

// XLA's scratch allocator over stand-in device memory: the two entries of the FFI API it uses.
XLA_FFI_Error* ScratchAllocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  Must(cudaMalloc(&args->data, args->size), "cudaMalloc (scratch)");
  return nullptr;
}

XLA_FFI_Error* ScratchFree(XLA_FFI_DeviceMemory_Free_Args* args) {
  Must(cudaFree(args->data), "cudaFree (scratch)");
  return nullptr;
}

// Calls `call` with `side`'s BufferOps, made as that platform's handler makes it; `scratch`: with
// XLA's scratch allocator, freed after the call (osmm_reduce_finish).
template <typename Call>
ffi::Error WithOps(const Side& side, bool scratch, const Call& call) {
  if (!side.cuda) {
    HostBufferOps ops;
    return call(ops);
  }
  static XLA_FFI_Api api = [] {
    XLA_FFI_Api fake{};
    fake.XLA_FFI_DeviceMemory_Allocate = &ScratchAllocate;
    fake.XLA_FFI_DeviceMemory_Free = &ScratchFree;
    return fake;
  }();
  ffi::DiagnosticEngine diagnostic;
  std::optional<ffi::ScratchAllocator> allocator =
      scratch ? ffi::CtxDecoding<ffi::ScratchAllocator>::Decode(&api, nullptr, diagnostic)
              : std::nullopt;
  cuda::CudaBufferOps ops(side.stream, side.device, allocator ? &*allocator : nullptr);
  return call(ops);
}

// One XLA buffer of `side`: host memory, or stand-in device memory whose contents are still
// being copied in on the stream when the handler runs (as if XLA's previous kernel wrote them).
class Buffer {
 public:
  Buffer(const Side& side, ffi::DataType dtype, std::vector<int64_t> dims,
         const Bytes& contents = Bytes())
      : side_(side), dims_(std::move(dims)) {
    bytes_ = ffi::ByteWidth(dtype);
    for (int64_t d : dims_) bytes_ *= static_cast<size_t>(d);
    if (!side.cuda) {
      host_.assign(bytes_, std::byte{0x5A});
      if (!contents.empty()) host_ = contents;
      data_ = host_.data();
    } else {
      Must(cudaMalloc(&data_, bytes_), "cudaMalloc");
      if (!contents.empty()) {
        Must(cudaHostAlloc(&source_, bytes_, cudaHostAllocPortable), "cudaHostAlloc");
        std::memcpy(source_, contents.data(), bytes_);
        Must(cudaMemcpyAsync(data_, source_, bytes_, cudaMemcpyHostToDevice, side.stream),
             "cudaMemcpyAsync (operand)");
      }
    }
    descriptor_ = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE,           nullptr,
                                 static_cast<XLA_FFI_DataType>(dtype), data_,
                                 static_cast<int64_t>(dims_.size()),   dims_.data()};
  }
  ~Buffer() {
    if (side_.cuda) {
      Must(cudaFree(data_), "cudaFree");
      Must(cudaFreeHost(source_), "cudaFreeHost");
    }
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  ffi::AnyBuffer any() const { return ffi::AnyBuffer(&descriptor_); }

  Bytes Read() const {
    if (!side_.cuda) return host_;
    Bytes out(bytes_);
    Must(cudaMemcpy(out.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy (result)");
    return out;
  }

 private:
  Side side_;
  std::vector<int64_t> dims_;
  size_t bytes_ = 0;
  Bytes host_;
  void* data_ = nullptr;
  void* source_ = nullptr;
  XLA_FFI_Buffer descriptor_{};
};

Outcome Result(const ffi::Error& err, std::initializer_list<const Buffer*> results) {
  if (err.failure()) return Outcome{err.message(), Bytes()};
  Outcome outcome;
  for (const Buffer* buffer : results) {
    Bytes part = buffer->Read();
    outcome.bytes.insert(outcome.bytes.end(), part.begin(), part.end());
  }
  return outcome;
}

std::string Difference(const Outcome& want, const Outcome& got) {
  if (want.error != got.error) return "error \"" + want.error + "\" vs \"" + got.error + "\"";
  size_t i = 0;
  while (i < want.bytes.size() && i < got.bytes.size() && want.bytes[i] == got.bytes[i]) ++i;
  return std::to_string(want.bytes.size()) + " vs " + std::to_string(got.bytes.size()) +
         " bytes, first difference at byte " + std::to_string(i);
}

// `expected`: what the records call for (an error: a part of its message).
void ExpectOutcome(const std::string& name, const Outcome& expected, const Outcome& got) {
  const bool ok = expected.error.empty() ? got.error.empty() && got.bytes == expected.bytes
                                         : got.error.find(expected.error) != std::string::npos;
  Expect(ok, name + ": " + Difference(expected, got));
}

void Compare(const std::string& name, const Outcome& expected, const Outcome& cpu,
             const Outcome& gpu) {
  ExpectOutcome(name + ", CPU path", expected, cpu);
  Expect(gpu.error == cpu.error && gpu.bytes == cpu.bytes,
         name + ", CUDA path against the CPU path: " + Difference(cpu, gpu));
}

// --- running the cases (cuda_ops_cases.h) --------------------------------------------------------

Outcome RunFetch(const Side& side, const FetchCase& c, int64_t call_id) {
  const int me = Rank();
  const RecordList gets = FetchGets(c, me, Size());
  const int64_t itemsize = static_cast<int64_t>(ffi::ByteWidth(c.dtype));
  const int64_t a_bytes = c.a_rows * kACols * itemsize;
  const int64_t b_bytes = kBRows * c.b_cols * itemsize;
  const int64_t b_offset = (a_bytes + 63) / 64 * 64;
  const int64_t window_bytes = b_offset + (c.expose_b ? b_bytes : 0) + c.slack;
  Buffer a(side, c.dtype, {c.a_rows, kACols}, Block(me, kRegionA, a_bytes));
  Buffer b(side, c.dtype, {kBRows, c.b_cols}, Block(me, kRegionB, b_bytes));
  Buffer fetched(side, c.dtype, {gets.elements});
  ffi::Error err = WithOps(side, false, [&](BufferOps& ops) {
    return Fetch(ops, a.any(), b.any(), fetched.any(), Comm(), call_id, window_bytes, b_offset, 1,
                 c.expose_b ? 1 : 0, gets.flat);
  });
  return Result(err, {&fetched});
}

Outcome RunReduce(const Side& side, const ReduceCase& c, int64_t call_id) {
  const int me = Rank();
  const int64_t local_elements = kCRows * kCCols;
  int64_t window_bytes = local_elements * static_cast<int64_t>(ffi::ByteWidth(c.dtype)) + c.slack;
  // Notified: every other rank is an origin and a target (ReduceChunk), each with a slot.
  std::vector<int64_t> notify;
  if (c.notify) {
    const int64_t slot_bytes = (window_bytes + 63) / 64 * 64;
    notify = {Size() - 1, slot_bytes, /*pull_credits=*/0, Size() - 1};
    for (int pass = 0; pass < 2; ++pass) {
      for (int r = 0; r < Size(); ++r) {
        if (r != me) notify.push_back(r);
      }
      if (pass == 0) notify.push_back(Size() - 1);
    }
    window_bytes = Size() * slot_bytes;
  }
  std::deque<Buffer> chunks;
  std::vector<int64_t> transfers, ends, sizes;
  for (int k = 0; k < kChunks; ++k) {
    const RecordList records = ReduceChunk(me, Size(), k);
    transfers.insert(transfers.end(), records.flat.begin(), records.flat.end());
    ends.push_back(static_cast<int64_t>(transfers.size() / kRecordLength));
    sizes.push_back(records.elements);
    std::vector<double> values(records.elements);
    for (int64_t i = 0; i < records.elements; ++i) values[i] = ChunkValue(me, k, i);
    chunks.emplace_back(side, c.dtype, std::vector<int64_t>{records.elements},
                        Encode(c.dtype, values));
  }
  std::vector<double> local_values(local_elements);
  for (int64_t i = 0; i < local_elements; ++i) local_values[i] = LocalValue(me, i);
  Buffer ticket(side, ffi::DataType::S32, {1});
  Buffer local(side, c.dtype, {kCRows, kCCols}, Encode(c.dtype, local_values));
  Buffer out(side, c.dtype, {kCRows, kCCols});
  const Buffer& result = c.out_is_local ? local : out;
  ffi::Error err = WithOps(side, false, [&](BufferOps& ops) {
    return ReduceStart(ops, chunks[0].any(), ticket.any(), Comm(), call_id, window_bytes,
                       local_elements, c.overlap ? 1 : 0, transfers, ends, sizes, notify);
  });
  for (int k = 1; k < kChunks && err.success(); ++k) {
    err = WithOps(side, false, [&](BufferOps& ops) {
      return ReduceIssue(ops, chunks[k].any(), ticket.any(), Comm(), k);
    });
  }
  if (err.success()) {
    err = WithOps(side, true, [&](BufferOps& ops) {
      return ReduceFinish(ops, local.any(), result.any(), Comm());
    });
  }
  return Result(err, {&result, &ticket});
}

// --- the runs -----------------------------------------------------------------------------------

// What native.free_windows does: the CPU module's free_windows, then the CUDA module's
// free_staging.
void FreeAll() {
  GlobalIssuer().Stop();
  StopProgress();
  Expect(FreeWindows().success(), "FreeWindows");
  cuda::FreeStaging();
  const cuda_standin::Stats s = cuda_standin::GetStats();
  Expect(LiveWindowCount() == 0 && s.live_registered + s.live_pinned + s.live_device == 0,
         "registered, pinned or device memory left after freeing the windows and the staging");
}

// Rank 0's finish fails (as if XLA had failed there), abandoning the epoch: the other ranks'
// finish fails too, never returning a partial sum (the mark reaches them through the window
// header, also beside device windows), rank 0's next call closes the epoch and clears its window
// (BufferOps::ZeroWindow), and the next product is whole.
void RunAbandoned(const Side& side, int64_t call_id) {
  const ReduceCase& c = kReduceCases[0];
  if (Rank() == 0) InjectFailure("osmm_reduce_finish", 1);
  const Outcome abandoned = RunReduce(side, c, call_id);
  const Outcome next = RunReduce(side, c, call_id);
  const std::string name =
      std::string("reduce abandoned by rank 0, ") + (side.cuda ? "CUDA" : "CPU") + " path";
  const char* why = Rank() == 0 ? "injected failure" : "rank 0 abandoned this product";
  ExpectOutcome(name, Outcome{why, Bytes()}, abandoned);
  ExpectOutcome(name + ", the next product", ExpectedReduce(c, Rank(), Size()), next);
}

// `aware`: the CUDA side's windows are device memory, which the notified mode refuses (its
// cases expect that refusal there).
void RunCases(const Side& cpu, const Side& gpu, bool aware) {
  const int me = Rank();
  int64_t call_id = 100;
  for (const FetchCase& c : kFetchCases) {
    const Outcome expected = ExpectedFetch(c, FetchGets(c, me, Size()));
    const Outcome on_cpu = RunFetch(cpu, c, call_id);
    Compare(c.name, expected, on_cpu, RunFetch(gpu, c, call_id));
    call_id += 1;
  }
  for (const ReduceCase& c : kReduceCases) {
    const Outcome expected = ExpectedReduce(c, me, Size());
    const Outcome on_cpu = RunReduce(cpu, c, call_id);
    if (aware && c.notify) {
      ExpectOutcome(std::string(c.name) + ", CPU path", expected, on_cpu);
      ExpectOutcome(std::string(c.name) + ", refused over device windows",
                    Outcome{"the notified mode needs host windows", Bytes()},
                    RunReduce(gpu, c, call_id));
    } else {
      Compare(c.name, expected, on_cpu, RunReduce(gpu, c, call_id));
    }
    call_id += 1;
  }
  RunAbandoned(cpu, call_id);
  RunAbandoned(gpu, call_id);
}

// Two rounds, the second on windows and staging made anew.
void RunRounds(const Side& cpu, const Side& gpu, bool aware) {
  for (int round = 0; round < 2; ++round) {
    RunCases(cpu, gpu, aware);
    const cuda_standin::Stats s = cuda_standin::GetStats();
    // Host-staged: every live window pinned once (grown ones unpinned); CUDA-aware: none.
    const int64_t pinned = aware ? 0 : LiveWindowCount();
    Expect(s.live_registered == pinned, std::to_string(s.live_registered) + " registrations for " +
                                            std::to_string(pinned) + " live windows");
    Expect(s.refused == 0, "the stand-in refused " + std::to_string(s.refused) + " calls");
    FreeAll();
  }
  const cuda_standin::Stats s = cuda_standin::GetStats();
  Expect(s.adds > 0 && s.queued > 0, "no add kernel ran, or no stream work was queued");
  Expect(aware ? s.copies[cudaMemcpyDeviceToDevice] > 0
               : s.copies[cudaMemcpyDeviceToHost] > 0 && s.registrations > 0,
         "the copies of this mode did not run");
}

// Every rank's call fails when `refusing` ranks' CudaBufferOps are unusable: those name
// `because`, the others the first of them.
void ExpectRefused(const Side& gpu, bool refusing, const std::string& because, int first) {
  const std::string why = refusing ? because : "rank " + std::to_string(first) + " rejected";
  Outcome fetched = RunFetch(gpu, kFetchCases[0], 300);
  Expect(fetched.error.find(why) != std::string::npos, "fetch not refused: " + fetched.error);
  Outcome reduced = RunReduce(gpu, kReduceCases[0], 301);
  Expect(reduced.error.find(why) != std::string::npos, "reduce not refused: " + reduced.error);
}

// CUDA-aware mode asked for, but this MPI has no CUDA support: every call is refused; the CPU
// path works on.
void RunRefusedAware(const Side& cpu, const Side& gpu) {
  ExpectRefused(gpu, true,
                "this MPI does not report CUDA support (MPIX_Query_cuda_support() returned 0)", 0);
  ExpectOutcome("reduce on the CPU after the refusals",
                ExpectedReduce(kReduceCases[0], Rank(), Size()),
                RunReduce(cpu, kReduceCases[0], 302));
  FreeAll();
}

std::string Summary(const char* mode) {
  const cuda_standin::Stats s = cuda_standin::GetStats();
  char text[512];
  std::snprintf(text, sizeof(text),
                "%s, %d ranks: %d checks on rank 0; stand-in: %" PRId64 " device-to-host, %" PRId64
                " host-to-device and %" PRId64 " device-to-device copies, %" PRId64
                " queued stream operations, %" PRId64 " add kernels, %" PRId64 " windows pinned",
                mode, Size(), checks, s.copies[cudaMemcpyDeviceToHost],
                s.copies[cudaMemcpyHostToDevice], s.copies[cudaMemcpyDeviceToDevice], s.queued,
                s.adds, s.registrations);
  return text;
}

// Runs this process's part; returns the number of failed checks on every rank.
int Run() {
  Side cpu;
  Side gpu{true, nullptr, 0};
  Must(cudaStreamCreate(&gpu.stream), "cudaStreamCreate");
  const char* mode = "host-staged";
  if (!cuda::CudaAwareRequested()) {
    RunRounds(cpu, gpu, false);
    Side missing = gpu;
    if (Rank() == Size() - 1) missing.device = 1;
    ExpectRefused(missing, Rank() == Size() - 1, "cudaSetDevice(1) failed", Size() - 1);
    FreeAll();
  } else if (cuda::MpiCudaSupport() == 1) {
    mode = "CUDA-aware";
    RunRounds(cpu, gpu, true);
  } else {
    mode = "CUDA-aware without MPI support";
    RunRefusedAware(cpu, gpu);
  }
  Must(cudaStreamDestroy(gpu.stream), "cudaStreamDestroy");
  const std::string summary = Summary(mode);
  int failed = failures;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (Rank() == 0) std::printf("%s: %s\n", failed == 0 ? "passed" : "FAILED", summary.c_str());
  return failed;
}

}  // namespace
}  // namespace osmm

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int failed = osmm::Run();
  MPI_Finalize();
  return failed == 0 ? 0 : 1;
}
