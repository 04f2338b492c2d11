/* churn DIR SECONDS [LOOKUP_THREADS]: SEEDS lesson C on a mounted filesystem, the
 * workload of `rext4 bench churn` run through the host's system calls.
 * Creates DIR/seedC/tree/d00/.../d15/leaf, a symlink DIR/seedC/link to it and
 * DIR/seedC/churn; then three phases take turns in quarter-second windows (a virtual
 * machine's speed drifts more over seconds than the differences measured):
 * create+unlink of one name alone, the lookups alone (stat of the leaf and of the link,
 * alternately), and both together. SECONDS is each phase's total. Prints one line per
 * phase, "phase=NAME ops=N secs=S ops_per_s=R", with rext4's phase names, and removes
 * what it made. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <unistd.h>
#include "helpers.h"

static char leaf[4096], link_path[4096], churn_name[4096];
static atomic_int stop;

static void *creator(void *arg) {
    long *n = arg;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        int fd = open(churn_name, O_CREAT | O_EXCL | O_WRONLY, 0644);
        if (fd < 0) fail("create", churn_name);
        close(fd);
        if (unlink(churn_name) != 0) fail("unlink", churn_name);
        (*n)++;
    }
    return NULL;
}

static void *looker(void *arg) {
    long *n = arg;
    struct stat st;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        const char *p = (*n & 1) ? link_path : leaf;
        if (stat(p, &st) != 0) fail("stat", p);
        (*n)++;
    }
    return NULL;
}

/* Runs `creators` (0 or 1) and `looks` lookup threads for `window` seconds and adds
 * their counts to *created and *looked. */
static void run(int creators, int looks, double window, long *created, long *looked) {
    pthread_t t[65];
    long counts[65] = {0};
    int nt = 0;
    atomic_store(&stop, 0);
    for (int i = 0; i < creators; i++, nt++) pthread_create(&t[nt], NULL, creator, &counts[nt]);
    for (int i = 0; i < looks; i++, nt++) pthread_create(&t[nt], NULL, looker, &counts[nt]);
    struct timespec w = {(time_t)window, (long)((window - (double)(time_t)window) * 1e9)};
    nanosleep(&w, NULL);
    atomic_store(&stop, 1);
    for (int i = 0; i < nt; i++) {
        pthread_join(t[i], NULL);
        if (i < creators)
            *created += counts[i];
        else
            *looked += counts[i];
    }
}

static void phase(const char *name, long ops, double secs) {
    printf("phase=%s ops=%ld secs=%.3f ops_per_s=%.1f\n", name, ops, secs, (double)ops / secs);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s DIR SECONDS [LOOKUP_THREADS]\n", argv[0]);
        return 2;
    }
    double secs = atof(argv[2]);
    int looks = argc > 3 ? atoi(argv[3]) : 1;
    if (secs < 1) secs = 1;
    if (looks < 1 || looks > 64) {
        fprintf(stderr, "LOOKUP_THREADS must be 1 to 64\n");
        return 2;
    }
    char p[4096], base[2048];
    if (strlen(argv[1]) > 1500) {
        fprintf(stderr, "DIR path too long\n");
        return 2;
    }
    snprintf(base, sizeof base, "%s/seedC", argv[1]);
    if (mkdir(base, 0755) != 0) fail("mkdir", base);
    snprintf(p, sizeof p, "%s/tree", base);
    if (mkdir(p, 0755) != 0) fail("mkdir", p);
    for (int i = 0; i < 16; i++) {
        size_t l = strlen(p);
        snprintf(p + l, sizeof p - l, "/d%02d", i);
        if (mkdir(p, 0755) != 0) fail("mkdir", p);
    }
    snprintf(leaf, sizeof leaf, "%s/leaf", p);
    int fd = open(leaf, O_CREAT | O_WRONLY, 0644);
    if (fd < 0) fail("create", leaf);
    close(fd);
    snprintf(link_path, sizeof link_path, "%s/link", base);
    if (symlink(leaf + strlen(base) + 1, link_path) != 0) fail("symlink", link_path);
    snprintf(p, sizeof p, "%s/churn", base);
    if (mkdir(p, 0755) != 0) fail("mkdir", p);
    snprintf(churn_name, sizeof churn_name, "%s/x", p);

    int windows = (int)(secs * 4);
    double window = secs / windows;
    long alone = 0, look_alone = 0, with = 0, look_with = 0, none = 0;
    for (int i = 0; i < windows; i++) {
        run(1, 0, window, &alone, &none);
        run(0, looks, window, &none, &look_alone);
        run(1, looks, window, &with, &look_with);
    }
    phase("create_unlink_alone", alone, secs);
    phase("lookups_alone", look_alone, secs);
    phase("create_unlink_with_lookups", with, secs);
    phase("lookups_with_create_unlink", look_with, secs);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    return system(cmd) == 0 ? 0 : 1;
}
