/* Syscalls (number in r6, arguments in r0-r5, result in r0), _start and the two memory
 * routines the compiler may call even in freestanding code. */
#include "rt.h"

enum { SYS_READ = 63, SYS_WRITE = 64, SYS_EXIT_GROUP = 94, SYS_MMAP = 222 };

static long syscall6(long nr, long a, long b, long c, long d, long e, long f) {
    register long r0 __asm__("r0") = a, r1 __asm__("r1") = b, r2 __asm__("r2") = c;
    register long r3 __asm__("r3") = d, r4 __asm__("r4") = e, r5 __asm__("r5") = f, r6 __asm__("r6") = nr;
    __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5), "r"(r6) : "memory");
    return r0;
}

static _Noreturn void rt_exit(int status) {
    syscall6(SYS_EXIT_GROUP, status, 0, 0, 0, 0, 0);
    __builtin_unreachable();
}

void *memset(void *dst, int value, size_t n) {
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)value;
    return dst;
}

void *memcpy(void *restrict dst, const void *restrict src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

static size_t length(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

_Noreturn void rt_fail(const char *message) {
    syscall6(SYS_WRITE, 2, (long)message, (long)length(message), 0, 0, 0);
    syscall6(SYS_WRITE, 2, (long)"\n", 1, 0, 0, 0);
    rt_exit(1);
}

void *rt_alloc(size_t bytes) {
    long p = syscall6(SYS_MMAP, 0, (long)((bytes + 4095) & ~(size_t)4095), 3 /* read|write */,
                      0x22 /* private|anonymous */, -1, 0);
    if (p < 0 && p > -4096) rt_fail("out of memory");
    return (void *)p; /* page aligned, so vector aligned */
}

void rt_read(void *buf, size_t bytes) {
    for (char *p = buf; bytes;) {
        long got = syscall6(SYS_READ, 0, (long)p, (long)bytes, 0, 0, 0);
        if (got <= 0) rt_fail("request ended early");
        p += got, bytes -= (size_t)got;
    }
}

void rt_write(const void *buf, size_t bytes) {
    for (const char *p = buf; bytes;) {
        long put = syscall6(SYS_WRITE, 1, (long)p, (long)bytes, 0, 0, 0);
        if (put <= 0) rt_fail("writing the response failed");
        p += put, bytes -= (size_t)put;
    }
}

int main(void);

/* Entry: HVX spills need a 128-byte aligned stack; main's status goes to exit_group. */
__attribute__((naked, noreturn)) void _start(void) {
    __asm__ volatile("r29 = and(r29, #-128)\n"
                     "call main\n"
                     "r6 = #94\n"
                     "trap0(#1)\n");
}
