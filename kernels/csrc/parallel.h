/* run_parallel: the kernels' thread dispatch (radixrt.kernels.native hashes every csrc file
 * into each library's cache key).
 *
 * Runs fn(args + t * stride) for t in [0, nt) and returns when all are done. Built with
 * -fopenmp: on OpenMP threads, i.e. torch's own runtime where torch is loaded (it ships
 * libgomp.so.1, the soname a gcc -fopenmp build asks for), so these are torch's pooled,
 * spinning threads; only omp_get_thread_num and a plain parallel region, the oldest libgomp
 * ABI. Otherwise (or with -DRADIXRT_NO_OPENMP) on threads started and joined here, the
 * caller's thread running the first piece and any a thread could not be started for. */
#ifndef RADIXRT_PARALLEL_H
#define RADIXRT_PARALLEL_H
#include <pthread.h>
#include <stddef.h>
#if defined(_OPENMP) && !defined(RADIXRT_NO_OPENMP)
#include <omp.h>
#endif

#define RADIXRT_MAX_THREADS 64

static inline void run_parallel(void *(*fn)(void *), void *args, size_t stride, int nt) {
    char *base = (char *)args;
    if (nt > RADIXRT_MAX_THREADS) nt = RADIXRT_MAX_THREADS;
    if (nt <= 1) {
        fn(base);
        return;
    }
#if defined(_OPENMP) && !defined(RADIXRT_NO_OPENMP)
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        for (int u = t; u < nt; u += n) fn(base + (size_t)u * stride);
    }
#else
    pthread_t threads[RADIXRT_MAX_THREADS];
    int started = 1; /* threads 1..started-1 run; the caller's thread runs the rest */
    while (started < nt &&
           pthread_create(&threads[started], NULL, fn, base + (size_t)started * stride) == 0)
        started++;
    fn(base);
    for (int t = started; t < nt; t++) fn(base + (size_t)t * stride);
    for (int t = 1; t < started; t++) pthread_join(threads[t], NULL);
#endif
}
#endif
