"""The tools that write model directories: patch (patch_kv_layout), metadata
(gen_inference_metadata), verify (--verify, over reference_loop, a plain greedy ORT loop) and
their command lines (cli)."""
