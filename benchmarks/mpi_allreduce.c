/* One Open MPI all-reduce sweep, the reference row of benchmarks/allreduce.py.
 *
 * Timed exactly as the Python workers time p2pdist and Gloo: per size, warm-up calls,
 * a barrier, then timed in-place float32 sums whose input every rank refills before
 * each call, outside the timer, then an untimed barrier, with the workers' pattern (base + rank + 1, base[k] =
 * k % PERIOD: every sum is a small integer, exact in float32); then BARRIER_ITERS
 * barriers. Every rank checks the whole result of every timed call against the exact
 * sum, outside the timer; rank 0 writes, as JSON to RESULT, the medians over calls of
 * the time from the last rank's start to the last rank's end ("median": CLOCK_MONOTONIC,
 * one clock for every rank on the host) and of each call's slowest rank ("slowest"), as
 * the Python workers' parent takes them, and the maximum over ranks of the process CPU
 * time per call.
 *
 * Usage: mpirun -np N mpi_allreduce RESULT BYTES:WARMUP:ITERS [BYTES:WARMUP:ITERS ...]
 */
#include <mpi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BARRIER_ITERS 200
#define PERIOD 13 /* odd: a chunk at the wrong offset (a multiple of 2^k) changes the sum */

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* As Python's statistics.median: the mean of the two middle values for an even count. */
static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof(double), by_value);
    return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2.0;
}

static void fail(const char *what) {
    fprintf(stderr, "mpi_allreduce: %s\n", what);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Collective over the ranks: start[i] and end[i] are when this rank started and ended
 * call i (now()). On rank 0, out[0] is the median over calls of (the last end - the last
 * start) and out[1] the median of each call's slowest rank; the arrays are overwritten. */
static void call_medians(double *start, double *end, int n, double out[2]) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    double *last = malloc(3 * (size_t)n * sizeof(double));
    if (last == NULL) fail("out of memory");
    for (int i = 0; i < n; i++) end[i] -= start[i]; /* end[] now holds the durations */
    MPI_Reduce(start, last, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) start[i] += end[i]; /* start[] now holds the ends */
    MPI_Reduce(start, last + n, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(end, last + 2 * n, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        for (int i = 0; i < n; i++) last[i] = last[n + i] - last[i];
        out[0] = median(last, n);
        out[1] = median(last + 2 * n, n);
    }
    free(last);
}

int main(int argc, char **argv) {
    int rank, world;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc < 3) fail("usage: mpi_allreduce RESULT BYTES:WARMUP:ITERS ...");
    FILE *out = NULL;
    if (rank == 0 && (out = fopen(argv[1], "w")) == NULL) fail("cannot open the result file");
    const float offset = (float)(rank + 1), total = (float)(world * (world + 1) / 2);
    if (out) fputs("{\"results\": [", out);
    for (int a = 2; a < argc; a++) {
        long bytes;
        int warmup, iters;
        if (sscanf(argv[a], "%ld:%d:%d", &bytes, &warmup, &iters) != 3 || bytes < 4 ||
            bytes / 4 > INT_MAX || warmup < 0 || iters < 1)
            fail("bad size spec (want BYTES:WARMUP:ITERS)");
        long count = bytes / 4;
        float *x = malloc((size_t)count * sizeof(float));
        float *base = malloc((size_t)count * sizeof(float));
        double *t0 = malloc((size_t)iters * sizeof(double));
        double *t1 = malloc((size_t)iters * sizeof(double));
        if (x == NULL || base == NULL || t0 == NULL || t1 == NULL) fail("out of memory");
        for (long k = 0; k < count; k++) base[k] = (float)(k % PERIOD);
        for (int i = 0; i < warmup; i++) {
            for (long k = 0; k < count; k++) x[k] = base[k] + offset;
            MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        double cpu = 0.0;
        for (int i = 0; i < iters; i++) {
            for (long k = 0; k < count; k++) x[k] = base[k] + offset;
            MPI_Barrier(MPI_COMM_WORLD); /* every rank's refill and last check done, untimed */
            double c0 = cpu_seconds();
            t0[i] = now();
            MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t1[i] = now();
            cpu += cpu_seconds() - c0;
            for (long k = 0; k < count; k++)
                if (x[k] != (float)world * base[k] + total) fail("wrong all-reduce result");
        }
        double per_call[2], mine = cpu / iters, worst;
        call_medians(t0, t1, iters, per_call);
        MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (out)
            fprintf(out,
                    "%s{\"bytes\": %ld, \"iters\": %d, \"median\": %.9g, \"slowest\": %.9g, "
                    "\"cpu\": %.9g}",
                    a > 2 ? ", " : "", bytes, iters, per_call[0], per_call[1], worst);
        free(x);
        free(base);
        free(t0);
        free(t1);
    }
    double b0[BARRIER_ITERS], b1[BARRIER_ITERS], barrier[2];
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < BARRIER_ITERS; i++) {
        b0[i] = now();
        MPI_Barrier(MPI_COMM_WORLD);
        b1[i] = now();
    }
    call_medians(b0, b1, BARRIER_ITERS, barrier);
    if (out) {
        fprintf(out, "], \"barrier\": {\"median\": %.9g, \"slowest\": %.9g}}\n", barrier[0],
                barrier[1]);
        if (fclose(out) != 0) fail("cannot write the result file");
    }
    MPI_Finalize();
    return 0;
}
