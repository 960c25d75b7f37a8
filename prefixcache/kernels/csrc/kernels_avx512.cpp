#define PC_AVX512
#define PC_NS avx512
#pragma GCC target("avx512f,avx2,fma")
#include "kernels.inc"
