/* mdtest DIR N: create N empty files in DIR, stat each, unlink each.
 * One line per phase: "phase=create|stat|unlink ops=N secs=S ops_per_s=R", the form
 * `rext4 bench mdtest` prints, so scripts/bench-write.sh compares them line for line. */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include "helpers.h"

static void name(char *p, size_t cap, const char *dir, long i) {
    snprintf(p, cap, "%s/f%07ld", dir, i);
}

static void report(const char *phase, long n, double t0) {
    double s = mono_secs() - t0;
    printf("phase=%s ops=%ld secs=%.3f ops_per_s=%.1f\n", phase, n, s, (double)n / s);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s DIR N\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    long n = atol(argv[2]);
    char p[4096];
    struct stat st;
    double t0 = mono_secs();
    for (long i = 0; i < n; i++) {
        name(p, sizeof p, dir, i);
        int fd = open(p, O_CREAT | O_EXCL | O_WRONLY, 0644);
        if (fd < 0) fail("create", p);
        close(fd);
    }
    report("create", n, t0);
    t0 = mono_secs();
    for (long i = 0; i < n; i++) {
        name(p, sizeof p, dir, i);
        if (stat(p, &st) != 0) fail("stat", p);
    }
    report("stat", n, t0);
    t0 = mono_secs();
    for (long i = 0; i < n; i++) {
        name(p, sizeof p, dir, i);
        if (unlink(p) != 0) fail("unlink", p);
    }
    report("unlink", n, t0);
    return 0;
}
