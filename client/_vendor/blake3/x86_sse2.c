/* blake3_sse2.c compiled for sse2 whatever the build's flags (one build serves every x86-64 CPU;
 * blake3_dispatch.c picks the widest the CPU has at run time). Empty elsewhere. */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("sse2")
#include "blake3_sse2.c"
#endif
