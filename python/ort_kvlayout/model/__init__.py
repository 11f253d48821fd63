"""A model directory's files, read and checked, for the tools and the runtime alike:
genai_config.json and inference_metadata.yaml (config), the decoder graphs' GroupQueryAttention
nodes read without their weights (graph), the tokenizer (tokenizer)."""
