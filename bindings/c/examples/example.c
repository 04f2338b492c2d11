/* A small program on the rext4 C API: make an image, write and read a file, list a
 * directory, rename and remove, then reopen read-only and check what is there.
 * Build: cc -I bindings/c/include example.c -L target/debug -lrext4
 * Run:   ./example IMAGE   (prints what it does; exit 0 when every check held) */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>

#include "rext4.h"

#define CHECK(call)                                                              \
    do {                                                                         \
        long long rc_ = (call);                                                  \
        if (rc_ < 0) {                                                           \
            fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,   \
                    strerror((int)-rc_), rext4_last_error());                    \
            return 1;                                                            \
        }                                                                        \
    } while (0)

#define EXPECT(cond)                                                             \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);  \
            return 1;                                                            \
        }                                                                        \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s IMAGE\n", argv[0]);
        return 2;
    }
    const char *img = argv[1];
    static char block[65536];
    for (size_t i = 0; i < sizeof block; i++)
        block[i] = (char)(i * 7 % 251);

    CHECK(rext4_mkfs(img, 32u << 20, 4096));

    struct rext4_fs *fs;
    CHECK(rext4_open(img, 1, &fs));
    CHECK(rext4_mkdir(fs, "/etc", 0755));
    struct rext4_file *f;
    CHECK(rext4_file_open(fs, "/etc/data", O_WRONLY | O_CREAT | O_TRUNC, 0640, &f));
    for (int i = 0; i < 16; i++) /* 1 MiB */
        EXPECT(rext4_file_write(f, block, sizeof block, (uint64_t)i * sizeof block) == sizeof block);
    CHECK(rext4_file_write(f, "tail", 4, 16 * sizeof block));
    CHECK(rext4_file_fsync(f));
    CHECK(rext4_file_truncate(f, 16 * sizeof block + 2));
    CHECK(rext4_file_close(f));

    CHECK(rext4_file_open(fs, "/etc/hostname", O_RDWR | O_CREAT | O_EXCL, 0644, &f));
    CHECK(rext4_file_write(f, "rext4\n", 6, 0));
    CHECK(rext4_file_close(f));
    EXPECT(rext4_file_open(fs, "/etc/hostname", O_RDWR | O_CREAT | O_EXCL, 0644, &f) == -EEXIST);
    EXPECT(f == NULL);

    CHECK(rext4_mkdir(fs, "/tmp", 01777));
    CHECK(rext4_rename(fs, "/etc/hostname", "/tmp/name"));
    CHECK(rext4_file_open(fs, "/tmp/gone", O_WRONLY | O_CREAT, 0600, &f));
    CHECK(rext4_file_close(f));
    CHECK(rext4_unlink(fs, "/tmp/gone"));
    CHECK(rext4_mkdir(fs, "/empty", 0700));
    CHECK(rext4_rmdir(fs, "/empty"));
    EXPECT(rext4_rmdir(fs, "/tmp") == -ENOTEMPTY);
    EXPECT(rext4_unlink(fs, "/etc") == -EISDIR);
    EXPECT(rext4_mkdir(fs, "/no/such/dir", 0755) == -ENOENT);
    EXPECT(strlen(rext4_last_error()) > 0);              /* what failed, in words */
    EXPECT(rext4_mkdir(fs, NULL, 0755) == -EINVAL);       /* NULL is refused, not read */
    EXPECT(rext4_open("/nonexistent/image", 0, NULL) == -EINVAL);
    CHECK(rext4_sync(fs));
    CHECK(rext4_close(fs));

    /* Read-only: the files are there, with their bytes, modes and sizes. */
    CHECK(rext4_open(img, 0, &fs));
    EXPECT(rext4_mkdir(fs, "/x", 0755) == -EROFS);
    struct rext4_stat st;
    CHECK(rext4_stat(fs, "/etc/data", 1, &st));
    printf("/etc/data: mode %o size %llu\n", st.mode, (unsigned long long)st.size);
    EXPECT(st.mode == (0100000 | 0640) && st.size == 16 * sizeof block + 2);
    EXPECT(rext4_stat(fs, "/etc/missing", 1, &st) == -ENOENT);
    CHECK(rext4_file_open(fs, "/etc/data", O_RDONLY, 0, &f));
    static char back[65536];
    for (int i = 0; i < 16; i++) {
        EXPECT(rext4_file_read(f, back, sizeof back, (uint64_t)i * sizeof back) == sizeof back);
        EXPECT(memcmp(back, block, sizeof block) == 0);
    }
    EXPECT(rext4_file_read(f, back, sizeof back, 16 * sizeof block) == 2);
    EXPECT(memcmp(back, "ta", 2) == 0);
    EXPECT(rext4_file_read(f, back, sizeof back, 16 * sizeof block + 2) == 0);
    CHECK(rext4_file_stat(f, &st));
    EXPECT(st.uid == 0 && st.nlink == 1);
    CHECK(rext4_file_close(f));

    struct rext4_dir *d;
    CHECK(rext4_opendir(fs, "/", &d));
    struct rext4_dirent e;
    int n, count = 0;
    while ((n = rext4_readdir(d, &e)) == 1) {
        printf("/%s (type %u, inode %llu)\n", e.d_name, e.d_type, (unsigned long long)e.d_ino);
        count++;
    }
    rext4_closedir(d);
    CHECK(n);
    EXPECT(count == 3); /* lost+found, etc, tmp */
    CHECK(rext4_stat(fs, "/tmp/name", 0, &st));
    EXPECT(st.size == 6);
    EXPECT(rext4_opendir(fs, "/tmp/name", &d) == -ENOTDIR && d == NULL);
    CHECK(rext4_close(fs));
    printf("ok\n");
    return 0;
}
