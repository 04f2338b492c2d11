/* punchholes FILE STRIDE HOLE: punch a HOLE-byte hole at the start of every STRIDE bytes
 * of FILE (fragmenting its free space, for SEEDS lesson D's fill); prints the count. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include "helpers.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s FILE STRIDE HOLE\n", argv[0]);
        return 2;
    }
    long long stride = atoll(argv[2]), hole = atoll(argv[3]);
    if (stride <= 0 || hole <= 0 || hole > stride) {
        fprintf(stderr, "need 0 < HOLE <= STRIDE\n");
        return 2;
    }
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) fail("open", argv[1]);
    struct stat st;
    if (fstat(fd, &st) != 0) fail("stat", argv[1]);
    long long n = 0;
    for (long long off = 0; off + hole <= st.st_size; off += stride, n++)
        if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, hole) != 0)
            fail("punch", argv[1]);
    close(fd);
    printf("%lld\n", n);
    return 0;
}
