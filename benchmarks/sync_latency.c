/* sync_latency: what one synchronisation costs in raw MPI, for osmm_jax's two ways of
 * completing a product's transfers: collective MPI_Win_fence epochs, and notified transfers
 * under one MPI_Win_lock_all (an origin writes its partial into a slot of the target's window,
 * flushes, then writes a sequence number into the target's flag array in a second window; the
 * target polls its flags).
 *
 * Cases (each float32, 64 B .. 1 MiB unless said):
 *   fence_empty         two MPI_Win_fence, no operations (bytes 0)
 *   fence_put/acc/get   one fence epoch: MPI_Put / MPI_Accumulate(SUM) / MPI_Get to/from every
 *                       other rank
 *   lock_put/acc/get    under MPI_Win_lock_all: the same operations to/from every other rank,
 *                       then MPI_Win_flush of each target; time until every flush returned
 *   notify_put          round trip between pairs i -> i+1 mod P, all pairs at once: the origin
 *                       puts the bytes into its slot at the target, flushes, and writes the
 *                       sequence number into the target's flag (MPI_Accumulate REPLACE, flush);
 *                       the target polls until it sees it, then notifies the origin back with a
 *                       flag only; the origin polls for that reply
 *   notify_acc          the same with MPI_Accumulate(SUM) as the slot write
 *   notify_put_putflag  the same as notify_put with the flags written by MPI_Put (64 B only)
 *   twosided            the same exchange by messages: the data to next by MPI_Isend into a
 *                       receive the target posted, the reply an empty message back; the data's
 *                       arrival is its own notification (no flush, no flag)
 *   persistent          twosided with persistent requests (MPI_Send_init / MPI_Recv_init), the
 *                       target's receives started before the step (pre-posted), as a transport
 *                       would post the next product's receives when it finishes one
 *   notify_late/twosided_late  notify_acc / twosided when the target is busy computing: the
 *                       odd ranks spin 2 ms without calling MPI before their part; time minus
 *                       those 2 ms, so what is left is what the delivery added
 *   iallreduce          MPI_Iallreduce(SUM) + MPI_Wait of 4 B and 256 KiB
 *   allreduce           MPI_Allreduce(SUM) of 4 B and 256 KiB
 * Polling a flag: MPI_Win_sync on the flag window, an atomic load, then MPI_Iprobe(ANY_SOURCE,
 * ANY_TAG) to drive MPI's progress and sched_yield; after 1000 polls a 50 us nanosleep each.
 *
 * Each rank times every iteration (MPI_Barrier, then the step) after 5 warm-ups; one JSON line
 * per case and size on rank 0's stdout: the slowest rank's median, in ms:
 *   {"case": "fence_put", "bytes": 4096, "ms": 0.123, "ranks": 3, "reps": 30}
 * Notify lines add "stale": how many times, summed over ranks, a notified put slot did not yet
 * hold the data when its flag arrived (0 unless flush-then-notify is broken).
 *
 * Build and run (benchmarks/sync_latency.py does both, also across emulated hosts):
 *   .venv/bin/mpicc -O2 benchmarks/sync_latency.c -o /tmp/sync_latency
 *   .venv/bin/mpiexec -n 3 /tmp/sync_latency [reps, default 30]
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WARMUP 5
#define MAX_FLOATS 262144 /* 1 MiB */
#define NSIZES 5
static const int SIZES[NSIZES] = {16, 1024, 16384, 65536, 262144}; /* floats: 64 B .. 1 MiB */

enum kind { FENCE_EMPTY, FENCE_OPS, LOCK_OPS, NOTIFY, TWOSIDED, PERSISTENT, IALLREDUCE, ALLREDUCE };
enum op { OP_NONE, OP_PUT, OP_ACC, OP_GET };

struct bench {
  const char *name;
  enum kind kind;
  enum op op;    /* the data operation (for NOTIFY: the slot write) */
  int flag_put;  /* NOTIFY: flags by MPI_Put instead of MPI_Accumulate(REPLACE) */
  int only_size; /* > 0: this size in floats only; -1: no data (bytes 0) */
  int late;      /* odd ranks compute LATE_SECONDS without MPI before their part */
};

#define LATE_SECONDS 0.002
#define TAG_DATA 7
#define TAG_REPLY 8

static int rank, nranks, reps;
static float *src, *dst;          /* local buffers of MAX_FLOATS * nranks floats */
static float *fence_base, *data_base;
static int64_t *flags;            /* 2 per rank: [2s] data from s, [2s+1] reply from s */
static MPI_Win fence_win, data_win, flag_win;
static int64_t seq, flag_value;   /* same on every rank: every rank runs every step */
static int stale;
static MPI_Request persistent[4]; /* recv data, send data, recv reply, send reply */
static char reply_byte;

/* One RMA operation of n floats with target: origin rank r uses slot r of the target's window
 * (displacement r * n floats), so concurrent origins never overlap. */
static void issue(enum op op, MPI_Win win, int target, int n) {
  MPI_Aint disp = (MPI_Aint)rank * n * (MPI_Aint)sizeof(float);
  if (op == OP_PUT)
    MPI_Put(src, n, MPI_FLOAT, target, disp, n, MPI_FLOAT, win);
  else if (op == OP_ACC)
    MPI_Accumulate(src, n, MPI_FLOAT, target, disp, n, MPI_FLOAT, MPI_SUM, win);
  else
    MPI_Get(dst + (size_t)target * n, n, MPI_FLOAT, target, disp, n, MPI_FLOAT, win);
}

/* Write the current sequence number into flags[index] of target, and flush it there. */
static void notify(int target, int index, int flag_put) {
  MPI_Aint disp = (MPI_Aint)index * (MPI_Aint)sizeof(int64_t);
  flag_value = seq;
  if (flag_put)
    MPI_Put(&flag_value, 1, MPI_INT64_T, target, disp, 1, MPI_INT64_T, flag_win);
  else
    MPI_Accumulate(&flag_value, 1, MPI_INT64_T, target, disp, 1, MPI_INT64_T, MPI_REPLACE,
                   flag_win);
  MPI_Win_flush(target, flag_win);
}

/* Poll this rank's own flags[index] until it reaches want. */
static void wait_flag(int index, int64_t want) {
  struct timespec nap = {0, 50000};
  for (long polls = 0;; polls++) {
    MPI_Win_sync(flag_win);
    if (__atomic_load_n(&flags[index], __ATOMIC_ACQUIRE) >= want) return;
    int got;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &got, MPI_STATUS_IGNORE);
    if (polls < 1000)
      sched_yield();
    else
      nanosleep(&nap, NULL);
  }
}

/* One notified round trip: data + flag to next, flag-only reply from next (and the same
 * with the roles swapped toward prev, at the same time). */
static void notify_round_trip(enum op slot_op, int flag_put, int n) {
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  seq++;
  src[0] = (float)seq; /* lets the target check that the put landed before its flag */
  issue(slot_op, data_win, next, n);
  MPI_Win_flush(next, data_win);
  notify(next, 2 * rank, flag_put);
  wait_flag(2 * prev, seq);
  if (slot_op == OP_PUT) {
    MPI_Win_sync(data_win);
    if (data_base[(size_t)prev * n] != (float)seq) stale++;
  }
  notify(prev, 2 * rank + 1, flag_put);
  wait_flag(2 * next + 1, seq);
}

/* Spin for `seconds` without calling MPI: a rank busy computing. */
static void compute(double seconds) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do clock_gettime(CLOCK_MONOTONIC, &t);
  while ((t.tv_sec - t0.tv_sec) + 1e-9 * (t.tv_nsec - t0.tv_nsec) < seconds);
}

/* The notified round trip's exchange by messages: data to next, an empty reply back. */
static void twosided_round_trip(int n) {
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  MPI_Request req[2];
  MPI_Irecv(dst, n, MPI_FLOAT, prev, TAG_DATA, MPI_COMM_WORLD, &req[0]);
  MPI_Isend(src, n, MPI_FLOAT, next, TAG_DATA, MPI_COMM_WORLD, &req[1]);
  MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
  MPI_Irecv(&reply_byte, 0, MPI_BYTE, next, TAG_REPLY, MPI_COMM_WORLD, &req[0]);
  MPI_Isend(&reply_byte, 0, MPI_BYTE, prev, TAG_REPLY, MPI_COMM_WORLD, &req[1]);
  MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
}

/* Persistent requests of n floats for the next steps; the receives are started (pre-posted). */
static void persistent_init(int n) {
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  MPI_Recv_init(dst, n, MPI_FLOAT, prev, TAG_DATA, MPI_COMM_WORLD, &persistent[0]);
  MPI_Send_init(src, n, MPI_FLOAT, next, TAG_DATA, MPI_COMM_WORLD, &persistent[1]);
  MPI_Recv_init(&reply_byte, 0, MPI_BYTE, next, TAG_REPLY, MPI_COMM_WORLD, &persistent[2]);
  MPI_Send_init(&reply_byte, 0, MPI_BYTE, prev, TAG_REPLY, MPI_COMM_WORLD, &persistent[3]);
  MPI_Start(&persistent[0]);
  MPI_Start(&persistent[2]);
}

static void persistent_round_trip(void) {
  MPI_Start(&persistent[1]);
  MPI_Waitall(2, persistent, MPI_STATUSES_IGNORE);
  MPI_Start(&persistent[3]);
  MPI_Waitall(2, persistent + 2, MPI_STATUSES_IGNORE);
  MPI_Start(&persistent[0]); /* the next step's receives, posted before it begins */
  MPI_Start(&persistent[2]);
}

static void persistent_free(void) {
  MPI_Cancel(&persistent[0]);
  MPI_Cancel(&persistent[2]);
  MPI_Waitall(2, (MPI_Request[]){persistent[0], persistent[2]}, MPI_STATUSES_IGNORE);
  for (int i = 0; i < 4; i++) MPI_Request_free(&persistent[i]);
}

/* One timed iteration of b with n floats. */
static void step(const struct bench *b, int n) {
  MPI_Request req;
  if (b->late && rank % 2) compute(LATE_SECONDS);
  switch (b->kind) {
    case FENCE_EMPTY:
      MPI_Win_fence(0, fence_win);
      MPI_Win_fence(0, fence_win);
      break;
    case FENCE_OPS:
      MPI_Win_fence(0, fence_win);
      for (int k = 1; k < nranks; k++) issue(b->op, fence_win, (rank + k) % nranks, n);
      MPI_Win_fence(0, fence_win);
      break;
    case LOCK_OPS:
      for (int k = 1; k < nranks; k++) issue(b->op, data_win, (rank + k) % nranks, n);
      for (int k = 1; k < nranks; k++) MPI_Win_flush((rank + k) % nranks, data_win);
      break;
    case NOTIFY:
      notify_round_trip(b->op, b->flag_put, n);
      break;
    case TWOSIDED:
      twosided_round_trip(n);
      break;
    case PERSISTENT:
      persistent_round_trip();
      break;
    case IALLREDUCE:
      MPI_Iallreduce(src, dst, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
      MPI_Wait(&req, MPI_STATUS_IGNORE);
      break;
    case ALLREDUCE:
      MPI_Allreduce(src, dst, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
  }
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Time b at n floats on every rank; rank 0 prints the slowest rank's median. */
static void run(const struct bench *b, int n, double *samples) {
  stale = 0;
  if (b->kind == PERSISTENT) persistent_init(n);
  for (int i = 0; i < WARMUP + reps; i++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    step(b, n);
    double took = MPI_Wtime() - t0 - (b->late ? LATE_SECONDS : 0.0);
    if (i >= WARMUP) samples[i - WARMUP] = took;
  }
  if (b->kind == PERSISTENT) persistent_free();
  qsort(samples, reps, sizeof(double), by_value);
  double median = reps % 2 ? samples[reps / 2] : (samples[reps / 2 - 1] + samples[reps / 2]) / 2;
  double slowest;
  int stale_sum;
  MPI_Reduce(&median, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  MPI_Reduce(&stale, &stale_sum, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
  if (rank != 0) return;
  long bytes = (long)n * (long)sizeof(float);
  printf("{\"case\": \"%s\", \"bytes\": %ld, \"ms\": %.4f, \"ranks\": %d, \"reps\": %d", b->name,
         bytes, slowest * 1e3, nranks, reps);
  if (b->kind == NOTIFY) printf(", \"stale\": %d", stale_sum);
  printf("}\n");
  fflush(stdout);
}

static const struct bench BENCHES[] = {
    {"fence_empty", FENCE_EMPTY, OP_NONE, 0, -1},
    {"fence_put", FENCE_OPS, OP_PUT, 0, 0},
    {"fence_acc", FENCE_OPS, OP_ACC, 0, 0},
    {"fence_get", FENCE_OPS, OP_GET, 0, 0},
    {"lock_put", LOCK_OPS, OP_PUT, 0, 0},
    {"lock_acc", LOCK_OPS, OP_ACC, 0, 0},
    {"lock_get", LOCK_OPS, OP_GET, 0, 0},
    {"notify_put", NOTIFY, OP_PUT, 0, 0},
    {"notify_acc", NOTIFY, OP_ACC, 0, 0},
    {"notify_put_putflag", NOTIFY, OP_PUT, 1, 16},
    {"twosided", TWOSIDED, OP_NONE, 0, 0},
    {"persistent", PERSISTENT, OP_NONE, 0, 0},
    {"notify_late", NOTIFY, OP_ACC, 0, 0, 1},
    {"twosided_late", TWOSIDED, OP_NONE, 0, 0, 1},
    {"iallreduce", IALLREDUCE, OP_NONE, 0, 1},
    {"iallreduce", IALLREDUCE, OP_NONE, 0, 65536},
    {"allreduce", ALLREDUCE, OP_NONE, 0, 1},
    {"allreduce", ALLREDUCE, OP_NONE, 0, 65536},
};

int main(int argc, char **argv) {
  int provided;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);
  reps = argc > 1 ? atoi(argv[1]) : 30;
  if (reps < 1) reps = 1;
  if (provided < MPI_THREAD_MULTIPLE && rank == 0)
    fprintf(stderr, "sync_latency: MPI_THREAD_MULTIPLE not provided (%d)\n", provided);

  size_t floats = (size_t)MAX_FLOATS * nranks;
  MPI_Aint window = (MPI_Aint)(floats * sizeof(float));
  src = malloc(floats * sizeof(float));
  dst = malloc(floats * sizeof(float));
  double *samples = malloc(reps * sizeof(double));
  for (size_t i = 0; i < floats; i++) src[i] = 0.5f;
  MPI_Win_allocate(window, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &fence_base, &fence_win);
  MPI_Win_allocate(window, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &data_base, &data_win);
  MPI_Win_allocate((MPI_Aint)(2 * nranks * sizeof(int64_t)), 1, MPI_INFO_NULL, MPI_COMM_WORLD,
                   &flags, &flag_win);
  memset(fence_base, 0, window);
  memset(data_base, 0, window);
  memset(flags, 0, 2 * nranks * sizeof(int64_t));
  MPI_Win_lock_all(MPI_MODE_NOCHECK, data_win);
  MPI_Win_lock_all(MPI_MODE_NOCHECK, flag_win);
  MPI_Barrier(MPI_COMM_WORLD);

  for (size_t c = 0; c < sizeof(BENCHES) / sizeof(BENCHES[0]); c++) {
    const struct bench *b = &BENCHES[c];
    if (b->only_size == -1)
      run(b, 0, samples);
    else if (b->only_size > 0)
      run(b, b->only_size, samples);
    else
      for (int s = 0; s < NSIZES; s++) run(b, SIZES[s], samples);
  }

  MPI_Win_unlock_all(flag_win);
  MPI_Win_unlock_all(data_win);
  MPI_Win_free(&flag_win);
  MPI_Win_free(&data_win);
  MPI_Win_free(&fence_win);
  free(samples);
  free(dst);
  free(src);
  MPI_Finalize();
  return 0;
}
