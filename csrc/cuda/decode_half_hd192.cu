// The decode kernel's instances of __half at head tile 192 (decode_kernel.cuh says which).
#include "cuda/decode_kernel.cuh"

KVL_DECODE_INSTANCES(__half, 192)
