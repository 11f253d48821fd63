"""Serving: the engine (continuous batching over one growable KV cache of request slots) and the
OpenAI-compatible server on it (`ort-kvlayout serve MODEL_DIR`). Built on ort_kvlayout.runtime;
nothing below imports it."""
