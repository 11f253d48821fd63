"""Greedy generation through onnxruntime-genai, the reference runtime the tests compare with."""

from __future__ import annotations

from pathlib import Path


def genai_greedy(
    model_dir: Path, prompt_ids: list[int], new_tokens: int, provider: str | None = None
) -> list[int]:
    """`new_tokens` greedy tokens (fewer if EOS comes first) after `prompt_ids`. provider None
    keeps genai_config.json's providers; "cpu" clears them; "cuda" runs on the CUDA EP."""
    import onnxruntime_genai as og

    if provider is None:
        model = og.Model(str(model_dir))
    else:
        config = og.Config(str(model_dir))
        config.clear_providers()
        if provider != "cpu":
            config.append_provider(provider)
        model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt_ids) :]
