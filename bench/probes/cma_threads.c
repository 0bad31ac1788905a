// CMA (process_vm_readv) throughput with 1, 2, 4 and 8 reader threads, against memcpy with as
// many threads: what bounds the shm transport, whose receiver copies each large write with one
// process_vm_readv on its worker thread (docs/shm.md). Not part of the build:
//   gcc -O2 -Wall -Wextra -Werror -pthread -o /tmp/cma bench/probes/cma_threads.c && /tmp/cma
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#define SZ (512ul << 20)
#define CH (1ul << 20)
static pid_t peer;
static char *src, *dst;
static int nthreads;
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static void* worker(void* a) {
  long id = (long)a;
  for (size_t off = id * CH; off < SZ; off += nthreads * CH) {
    struct iovec l = {dst + off, CH}, r = {src + off, CH};
    if (process_vm_readv(peer, &l, 1, &r, 1, 0) != (ssize_t)CH) {
      perror("readv");
      exit(1);
    }
  }
  return 0;
}
static void* mc(void* a) {
  long id = (long)a;
  for (size_t off = id * CH; off < SZ; off += nthreads * CH) memcpy(dst + off, src + off, CH);
  return 0;
}
int main(void) {
  src = aligned_alloc(4096, SZ);
  memset(src, 1, SZ);
  int p[2];
  if (pipe(p)) return 1;
  pid_t c = fork();
  if (c == 0) {
    char x;
    return read(p[0], &x, 1) == 1 ? 0 : 1;
  }
  peer = c;  // read the child's copy of src (same addresses after fork)
  dst = aligned_alloc(4096, SZ);
  memset(dst, 0, SZ);
  int ts[] = {1, 2, 4, 8};
  for (int k = 0; k < 4; k++) {
    nthreads = ts[k];
    for (int rep = 0; rep < 2; rep++) {
      pthread_t th[8];
      double t0 = now();
      for (long i = 0; i < nthreads; i++) pthread_create(&th[i], 0, worker, (void*)i);
      for (int i = 0; i < nthreads; i++) pthread_join(th[i], 0);
      double t1 = now();
      double t2 = now();
      for (long i = 0; i < nthreads; i++) pthread_create(&th[i], 0, mc, (void*)i);
      for (int i = 0; i < nthreads; i++) pthread_join(th[i], 0);
      double t3 = now();
      printf("threads %d: process_vm_readv %.2f GB/s, memcpy %.2f GB/s (1 MiB chunks, 512 MiB)\n",
             nthreads, SZ / (t1 - t0) / 1e9, SZ / (t3 - t2) / 1e9);
    }
  }
  if (write(p[1], "x", 1) != 1) return 1;
  wait(0);
  return 0;
}
