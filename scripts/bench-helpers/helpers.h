/* What the benchmark helpers share: a monotonic clock in seconds and a fatal error. */
#ifndef REXT4_BENCH_HELPERS_H
#define REXT4_BENCH_HELPERS_H
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline double mono_secs(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Print "WHAT WHO: strerror(errno)" and exit 1. */
static inline void fail(const char *what, const char *who) {
    fprintf(stderr, "%s %s: %s\n", what, who, strerror(errno));
    exit(1);
}
#endif
