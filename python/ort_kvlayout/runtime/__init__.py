"""The generation runtime: model_spec (what it needs of a model directory), kv_memory and
kv_cache (the KV buffers and their memory), sampling, generation (Runtime) and its command line,
``python -m ort_kvlayout.runtime MODEL_DIR --prompt TEXT`` (cli)."""
