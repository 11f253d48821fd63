// The decode kernel's instances of __nv_bfloat16 at head tile 256 (decode_kernel.cuh says which).
#include "cuda/decode_kernel.cuh"

KVL_DECODE_INSTANCES(__nv_bfloat16, 256)
