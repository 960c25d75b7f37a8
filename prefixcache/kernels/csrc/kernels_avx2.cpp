#define PC_AVX2
#define PC_NS avx2
#pragma GCC target("avx2,fma,f16c")
#include "kernels.inc"
