/* daxcopy PATH [GIB] [REGION_MIB]: SEEDS lesson E's persistence strategies measured on
 * a mapped file (tmpfs stands in for pmem): 16 KiB chunks copied round-robin into a
 * REGION_MIB (default 4) MAP_SHARED region, GIB (default 4) in all, four ways —
 *   cached             memcpy, nothing flushed (the lower bound: not persistent)
 *   cached+clwb        memcpy, then clwb of each 64-byte line, sfence
 *   cached+clflushopt  memcpy, then clflushopt of each line, sfence
 *   nt                 non-temporal 16-byte stores, sfence
 * One "RESULT|dax|seedE|MODE|GB/s|GB/s" line each. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>
#include "helpers.h"

enum { CHUNK = 16 << 10, LINE = 64 };

__attribute__((target("clwb"))) static void write_back(char *p, size_t n) {
    for (size_t i = 0; i < n; i += LINE) _mm_clwb(p + i);
    _mm_sfence();
}

__attribute__((target("clflushopt"))) static void flush_out(char *p, size_t n) {
    for (size_t i = 0; i < n; i += LINE) _mm_clflushopt(p + i);
    _mm_sfence();
}

static void stream_copy(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(dst + i), _mm_load_si128((const __m128i *)(src + i)));
    _mm_sfence();
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH [GIB] [REGION_MIB]\n", argv[0]);
        return 2;
    }
    double gib = argc > 2 ? atof(argv[2]) : 4;
    size_t region = (size_t)(argc > 3 ? atol(argv[3]) : 4) << 20;
    if (region < CHUNK) region = CHUNK;
    region -= region % CHUNK;
    long rounds = (long)(gib * (double)(1L << 30) / CHUNK);
    int fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)region) != 0) fail("open", argv[1]);
    char *map = mmap(NULL, region, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (map == MAP_FAILED) fail("mmap", argv[1]);
    char *src = aligned_alloc(LINE, CHUNK);
    if (!src) fail("malloc", "chunk");
    for (int i = 0; i < CHUNK; i++) src[i] = (char)(i * 13 + 1);
    static const char *const modes[] = {"cached", "cached+clwb", "cached+clflushopt", "nt"};
    for (int m = 0; m < 4; m++) {
        double t0 = mono_secs();
        size_t at = 0;
        for (long r = 0; r < rounds; r++) {
            char *d = map + at;
            if (m == 3) {
                stream_copy(d, src, CHUNK);
            } else {
                memcpy(d, src, CHUNK);
                if (m == 1) write_back(d, CHUNK);
                if (m == 2) flush_out(d, CHUNK);
            }
            at = (at + CHUNK) % region;
        }
        double s = mono_secs() - t0;
        printf("RESULT|dax|seedE|%s|%.2f|GB/s\n", modes[m], (double)rounds * CHUNK / s / 1e9);
    }
    munmap(map, region);
    close(fd);
    unlink(argv[1]);
    return 0;
}
