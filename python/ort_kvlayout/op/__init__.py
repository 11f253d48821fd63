"""The op as Python sees it: the custom-op library (finding, registering, reading the loaded
copy), the KV layouts and their strides, and the length errors the CUDA op records."""
