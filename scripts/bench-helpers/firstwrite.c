/* firstwrite PATH BYTES: create PATH, write BYTES in 1 MiB requests, fsync, and print
 * "open_us=.. write_us=.. fsync_us=.. total_us=.." (SEEDS lesson D's first write after
 * a cold mount). */
#include <fcntl.h>
#include <unistd.h>
#include "helpers.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PATH BYTES\n", argv[0]);
        return 2;
    }
    long long left = atoll(argv[2]);
    static char buf[1 << 20];
    memset(buf, 0xa5, sizeof buf);
    double t0 = mono_secs();
    int fd = open(argv[1], O_CREAT | O_WRONLY | O_TRUNC, 0644);
    if (fd < 0) fail("open", argv[1]);
    double t1 = mono_secs();
    while (left > 0) {
        size_t n = left < (long long)sizeof buf ? (size_t)left : sizeof buf;
        if (write(fd, buf, n) != (ssize_t)n) fail("write", argv[1]);
        left -= (long long)n;
    }
    double t2 = mono_secs();
    if (fsync(fd) != 0) fail("fsync", argv[1]);
    double t3 = mono_secs();
    close(fd);
    printf("open_us=%.0f write_us=%.0f fsync_us=%.0f total_us=%.0f\n", (t1 - t0) * 1e6,
           (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t3 - t0) * 1e6);
    return 0;
}
