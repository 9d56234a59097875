/* blake3_avx512.c compiled for avx512f,avx512vl whatever the build's flags (one build serves every x86-64 CPU;
 * blake3_dispatch.c picks the widest the CPU has at run time). Empty elsewhere. */
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512vl")
#include "blake3_avx512.c"
#endif
