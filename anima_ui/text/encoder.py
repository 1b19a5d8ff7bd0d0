"""Prompt -> DiT cross-attention context: tokenize (ComfyUI rules), Qwen3 final hidden states, the LLM
adapter over the T5 ids, per-token weights, zero padding to 512. No torch: Qwen3 and the adapter on
onnxruntime, the tokenizers from transformers.

Both networks are read from their files while they run (Qwen3 one layer at a time, the adapter one block
at a time), so an encoder holds only its tokenizers, the files' headers and Qwen3's layer graph: opening one
is quick, and dropping it frees everything."""

import numpy as np

from anima_ui.errors import UserError
from anima_ui.limits import check_prompt_tokens
from anima_ui.model.adapter import adapt_sequences, open_adapter, pad_context
from anima_ui.model.config import CONTEXT_LEN
from anima_ui.model.tensor_file import FileTensors
from anima_ui.text.qwen3 import Qwen3
from anima_ui.text.tokenize import PromptTokenizer


def open_networks(paths) -> tuple[Qwen3, FileTensors]:
    """Qwen3 and the adapter, their files' names and shapes checked (nothing else is read)."""
    qwen3 = Qwen3(paths.text_encoder)
    adapter = open_adapter(paths.dit)
    source_dim = adapter.shape("blocks.0.cross_attn.k_proj.weight")[1]
    if qwen3.shape.hidden != source_dim:
        raise UserError(
            f"text encoder width {qwen3.shape.hidden} does not match the adapter's {source_dim}: "
            "use qwen_3_06b_base.safetensors with this diffusion model"
        )
    return qwen3, adapter


class TextEncoder:
    def __init__(self, tokenizer: PromptTokenizer, qwen3: Qwen3, adapter_weights: FileTensors):
        self.tokenizer = tokenizer
        self.qwen3 = qwen3
        self.adapter_weights = adapter_weights

    @classmethod
    def load(cls, paths) -> "TextEncoder":
        """paths: a ModelPaths (the adapter lives in the diffusion model's file)."""
        qwen3, adapter = open_networks(paths)
        return cls(PromptTokenizer.load(paths.qwen_tokenizer_dir, paths.t5_tokenizer_dir), qwen3, adapter)

    def encode(self, prompts: list[str], cancel=None) -> list[np.ndarray]:
        """One context float32 [1, 512, C] per prompt, zero beyond its T5 length. Qwen3 and the adapter read
        each layer once for all the prompts. Every prompt's token counts are checked (UserError) before Qwen3 runs:
        the tokenizers take milliseconds on a prompt within the character limit. `cancel` (a threading.Event) stops
        Qwen3 between layers."""
        tokens = [self.tokenizer(prompt) for prompt in prompts]
        for prompt, t in zip(prompts, tokens):
            check_prompt_tokens(prompt, len(t.qwen_ids), len(t.t5_ids))
        sources = self.qwen3.final_hidden_states([t.qwen_ids for t in tokens], cancel)
        outs = adapt_sequences(self.adapter_weights, [(source[0], np.array(t.t5_ids, dtype=np.int64)) for t, source in zip(tokens, sources)])
        contexts = []
        for t, out in zip(tokens, outs):
            out = out[None] * np.asarray(t.t5_weights, dtype=np.float32)[None, :, None]
            contexts.append(pad_context(out, CONTEXT_LEN).astype(np.float32, copy=False))
        return contexts
