/* mountwait MNT TIMEOUT_S: poll until MNT is a mount point that answers statfs (its
 * st_dev differs from its parent's), then print the CLOCK_REALTIME time as SEC.USEC;
 * exit 1 after TIMEOUT_S seconds without it. */
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>
#include "helpers.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MNT TIMEOUT_S\n", argv[0]);
        return 2;
    }
    char parent[4096];
    snprintf(parent, sizeof parent, "%s/..", argv[1]);
    double deadline = mono_secs() + atof(argv[2]);
    struct stat a, b;
    struct statfs sf;
    while (mono_secs() < deadline) {
        if (stat(argv[1], &a) == 0 && stat(parent, &b) == 0 && a.st_dev != b.st_dev &&
            statfs(argv[1], &sf) == 0) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            printf("%ld.%06ld\n", (long)t.tv_sec, t.tv_nsec / 1000);
            return 0;
        }
        usleep(200);
    }
    fprintf(stderr, "%s: not mounted after %s s\n", argv[1], argv[2]);
    return 1;
}
