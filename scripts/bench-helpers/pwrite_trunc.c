/* pwrite_trunc FILE N plain|falloc [WRITE_BYTES TRUNC_BYTES FALLOC_BYTES]
 * SEEDS lesson B: N rounds of a write at offset 0 then a truncate to a size that ends
 * inside a block, so every truncate zeroes a partial block; with "falloc" each round
 * first preallocates FALLOC_BYTES (mode 0), so the zeroed block lies over an unwritten
 * extent. Defaults 4096, 2048, 32768. Prints "mode=M iters=N secs=S iters_per_s=R";
 * exits 3 when fallocate is not supported. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <unistd.h>
#include "helpers.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s FILE N plain|falloc [WRITE TRUNC FALLOC]\n", argv[0]);
        return 2;
    }
    long n = atol(argv[2]);
    int prealloc = strcmp(argv[3], "falloc") == 0;
    if (!prealloc && strcmp(argv[3], "plain") != 0) {
        fprintf(stderr, "mode must be plain or falloc, not %s\n", argv[3]);
        return 2;
    }
    size_t wbytes = argc > 4 ? (size_t)atol(argv[4]) : 4096;
    off_t tbytes = argc > 5 ? (off_t)atol(argv[5]) : 2048;
    off_t fbytes = argc > 6 ? (off_t)atol(argv[6]) : 32768;
    char *buf = malloc(wbytes);
    if (!buf) fail("malloc", "buffer");
    memset(buf, 0xcd, wbytes);
    int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) fail("open", argv[1]);
    double t0 = mono_secs();
    for (long i = 0; i < n; i++) {
        if (prealloc && fallocate(fd, 0, 0, fbytes) != 0) {
            if (errno == EOPNOTSUPP || errno == ENOSYS) {
                fprintf(stderr, "fallocate %s: %s\n", argv[1], strerror(errno));
                return 3;
            }
            fail("fallocate", argv[1]);
        }
        if (pwrite(fd, buf, wbytes, 0) != (ssize_t)wbytes) fail("pwrite", argv[1]);
        if (ftruncate(fd, tbytes) != 0) fail("ftruncate", argv[1]);
    }
    double s = mono_secs() - t0;
    close(fd);
    printf("mode=%s iters=%ld secs=%.3f iters_per_s=%.1f\n", argv[3], n, s, (double)n / s);
    return 0;
}
