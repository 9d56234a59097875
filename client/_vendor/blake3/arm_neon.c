/* blake3_neon.c where NEON is the baseline (AArch64: blake3_impl.h then selects it). */
#if defined(__aarch64__)
#include "blake3_neon.c"
#endif
