/* One Open MPI all-reduce sweep, the reference row of benchmarks/allreduce.py.
 *
 * Timed exactly as the Python workers time p2pdist and Gloo: per size, warm-up calls,
 * a barrier, then timed in-place float32 sums whose input every rank refills before
 * each call, outside the timer, then an untimed barrier, with the workers' pattern (base + rank + 1, base[k] =
 * k % PERIOD: every sum is a small integer, exact in float32); then BARRIER_ITERS
 * barriers. Every rank checks the whole result of every timed call against the exact
 * sum, outside the timer; rank 0 writes, as JSON to RESULT, the median over calls of each
 * call's slowest rank (the maximum over ranks of the process CPU time per call).
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

/* Collective over the ranks: t[i] is this rank's time of call i. Returns, on rank 0, the
 * median over calls of each call's slowest rank (as the Python workers' parent takes it);
 * 0 elsewhere. */
static double slowest_median(double *t, int n) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    double *slowest = malloc((size_t)n * sizeof(double));
    if (slowest == NULL) fail("out of memory");
    MPI_Reduce(t, slowest, n, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    double result = rank == 0 ? median(slowest, n) : 0.0;
    free(slowest);
    return result;
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
        double *t = malloc((size_t)iters * sizeof(double));
        if (x == NULL || base == NULL || t == NULL) fail("out of memory");
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
            double c0 = cpu_seconds(), t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            t[i] = MPI_Wtime() - t0;
            cpu += cpu_seconds() - c0;
            for (long k = 0; k < count; k++)
                if (x[k] != (float)world * base[k] + total) fail("wrong all-reduce result");
        }
        double per_call = slowest_median(t, iters), mine = cpu / iters, worst;
        MPI_Reduce(&mine, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (out)
            fprintf(out, "%s{\"bytes\": %ld, \"iters\": %d, \"median\": %.9g, \"cpu\": %.9g}",
                    a > 2 ? ", " : "", bytes, iters, per_call, worst);
        free(x);
        free(base);
        free(t);
    }
    double b[BARRIER_ITERS];
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < BARRIER_ITERS; i++) {
        double t0 = MPI_Wtime();
        MPI_Barrier(MPI_COMM_WORLD);
        b[i] = MPI_Wtime() - t0;
    }
    double barrier = slowest_median(b, BARRIER_ITERS);
    if (out) {
        fprintf(out, "], \"barrier\": {\"median\": %.9g}}\n", barrier);
        if (fclose(out) != 0) fail("cannot write the result file");
    }
    MPI_Finalize();
    return 0;
}
