"""Prompt -> DiT cross-attention context: tokenize (ComfyUI rules), Qwen3 final hidden states on the CPU,
the LLM adapter over the T5 ids, per-token weights, zero padding to 512 (as ComfyUI's `comfy/text_encoders/anima.py`
and `comfy/ldm/anima/model.py`)."""

from collections import OrderedDict

import numpy as np
import torch

from anima_ui.errors import UserError
from anima_ui.model.adapter import llm_adapter_forward, pad_context
from anima_ui.model.checkpoint import ADAPTER_PREFIX, split_adapter
from anima_ui.model.config import CONTEXT_LEN
from anima_ui.text.qwen3 import final_hidden_states, load_qwen3
from anima_ui.text.tokenize import PromptTokenizer

CACHE_PROMPTS = 4  # positive + negative of the current job and of the previous one


class TextEncoder:
    def __init__(self, tokenizer: PromptTokenizer, qwen3: torch.nn.Module, adapter_weights: dict[str, np.ndarray]):
        self.tokenizer = tokenizer
        self.qwen3 = qwen3
        self.adapter_weights = adapter_weights
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()

    @classmethod
    def load(cls, paths, dit_state_or_adapter_weights: dict[str, np.ndarray]) -> "TextEncoder":
        """paths: a ModelPaths; the second argument is either the whole DiT state (`load_dit`) or
        `split_adapter` of it."""
        weights = dit_state_or_adapter_weights
        if any(key.startswith(ADAPTER_PREFIX) for key in weights):
            weights = split_adapter(weights)
        if "embed.weight" not in weights:
            raise UserError("the diffusion model has no llm_adapter tensors; use an Anima checkpoint (anima-*.safetensors)")
        tokenizer = PromptTokenizer.load(paths.qwen_tokenizer_dir, paths.t5_tokenizer_dir)
        qwen3 = load_qwen3(paths.text_encoder)
        source_dim = weights["blocks.0.cross_attn.k_proj.weight"].shape[1]
        if qwen3.config.hidden_size != source_dim:
            raise UserError(
                f"text encoder width {qwen3.config.hidden_size} does not match the adapter's {source_dim}: "
                "use qwen_3_06b_base.safetensors with this diffusion model"
            )
        return cls(tokenizer, qwen3, weights)

    def encode(self, prompt: str) -> np.ndarray:
        """Context float32 [1, 512, C]; zero beyond the T5 length. Read-only (shared by the cache)."""
        if prompt in self._cache:
            self._cache.move_to_end(prompt)
            return self._cache[prompt]
        context = self._encode(prompt)
        context.flags.writeable = False
        self._cache[prompt] = context
        if len(self._cache) > CACHE_PROMPTS:
            self._cache.popitem(last=False)
        return context

    def _encode(self, prompt: str) -> np.ndarray:
        tokens = self.tokenizer(prompt)
        vocab = self.qwen3.config.vocab_size
        if max(tokens.qwen_ids) >= vocab:
            raise UserError(f"Qwen token id {max(tokens.qwen_ids)} is outside the text encoder's {vocab} rows: the tokenizer does not match the model")
        source = final_hidden_states(self.qwen3, tokens.qwen_ids)
        out = llm_adapter_forward(self.adapter_weights, source, np.array([tokens.t5_ids], dtype=np.int64))
        out = out * np.asarray(tokens.t5_weights, dtype=np.float32)[None, :, None]
        return pad_context(out, CONTEXT_LEN).astype(np.float32, copy=False)
