"""`OpenAIIngress`: the HTTP side of the cluster, the single server's own app (server.py).

Serve builds its ASGI app once the replica is constructed (`__serve_build_asgi_app__`): the
model's tokenizer and chat template loaded here, requests parsed and validated by
openai_api.py as in `ort-kvlayout serve`, then sent to the engine replicas through a
ClusterEngine (client.py). The constructor waits for one engine replica to answer, for the
context length that validation needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from ray import serve

from ..server import build_app, load_chat_template
from .client import ClusterEngine

__all__ = ["OpenAIIngress"]


@serve.ingress()
class OpenAIIngress:
    """See the module docstring. `engine`: the EngineReplica deployment's handle."""

    async def __init__(
        self,
        engine,
        model_dir: str,
        model_id: str,
        api_key_digest: bytes | None = None,
        metrics_key: bool = False,
    ):
        from ...model.tokenizer import load_tokenizer

        model_dir = Path(model_dir)
        self.tokenizer = None
        if (model_dir / "tokenizer.json").is_file():
            self.tokenizer = load_tokenizer(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.template = load_chat_template(model_dir, tokenizer_config)
        self.client = ClusterEngine(engine, await engine.info.remote())
        self.model_id = model_id
        self.api_key_digest = api_key_digest
        self.metrics_key = metrics_key

    def __serve_build_asgi_app__(self):
        return build_app(
            self.client, self.model_id, self.tokenizer, self.template,
            api_key_digest=self.api_key_digest, metrics_key=self.metrics_key,
        )  # fmt: skip
