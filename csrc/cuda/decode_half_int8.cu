// The decode kernel's quantized instances of __half, a cache of int8 codes, head tiles 64 and
// 128 (decode_kernel.cuh says which).
#include "cuda/decode_kernel.cuh"

KVL_DECODE_QUANT_INSTANCES(__half, 8)
