/* The freestanding runtime the harness needs under qemu-hexagon (Debian has no Hexagon libc):
 * Linux syscalls through trap0(#1), anonymous mmap for buffers, exact reads and writes. */
#ifndef NPUMOE_HVX_RT_H
#define NPUMOE_HVX_RT_H

#include <stddef.h>
#include <stdint.h>

void *rt_alloc(size_t bytes);                   /* 128-byte aligned, zeroed; exits on failure */
void rt_read(void *buf, size_t bytes);          /* exactly `bytes` from stdin, or exit */
void rt_write(const void *buf, size_t bytes);   /* all of `bytes` to stdout, or exit */
_Noreturn void rt_fail(const char *message);    /* message to stderr, exit status 1 */

#endif
