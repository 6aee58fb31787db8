/* Replays fuzz inputs without libFuzzer: `replay DIR...` feeds every file in
 * the directories to the harness once. Built with gcc and ASan/UBSan by
 * `make -C tests/fuzz replay`, which `make test` runs, so the committed
 * corpus (including each bug the fuzzers found) is checked on every run even
 * where clang is not installed. A failing input aborts with the sanitizer's or
 * the harness's report. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) return 0;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(n > 0 ? (size_t)n : 1);
    size_t got = buf ? fread(buf, 1, (size_t)(n > 0 ? n : 0), f) : 0;
    fclose(f);
    if (buf == NULL) return 0;
    LLVMFuzzerTestOneInput(buf, got);
    free(buf);
    return 1;
}

int main(int argc, char **argv)
{
    int count = 0;
    for (int a = 1; a < argc; a++) {
        DIR *d = opendir(argv[a]);
        if (d == NULL) {
            count += replay_file(argv[a]);
            continue;
        }
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[a], e->d_name);
            count += replay_file(path);
        }
        closedir(d);
    }
    printf("%d inputs replayed, 0 failed\n", count);
    return 0;
}
