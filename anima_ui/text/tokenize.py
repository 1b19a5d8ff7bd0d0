"""Prompt -> Qwen ids and T5 ids, with ComfyUI's exact rules (`comfy/text_encoders/anima.py`, `comfy/sd1_clip.py`):

- Qwen: plain byte-level BPE of the text, no BOS/EOS, no template; an empty prompt becomes
  `[<|endoftext|>]` (151643 in the release tokenizer). Qwen weights are always 1.
- T5: SentencePiece ids of the text followed by `</s>` (1); an empty prompt is `[1]`.
- Weighted segments (`(text:1.2)`, see prompt_weights.py) are tokenized one by one and concatenated;
  each T5 token carries its segment's weight (the end token 1.0).
"""

import os
from dataclasses import dataclass
from pathlib import Path

# Without torch (the board) transformers announces at import that its models are unavailable; only its
# tokenizers are used here, so that notice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
from transformers import Qwen2TokenizerFast, T5TokenizerFast  # noqa: E402

from anima_ui.errors import UserError
from anima_ui.text.prompt_weights import parse_prompt_weights

QWEN_PAD = "<|endoftext|>"


@dataclass(frozen=True)
class PromptTokens:
    qwen_ids: list[int]
    t5_ids: list[int]
    t5_weights: list[float]


class PromptTokenizer:
    def __init__(self, qwen, t5):
        self.qwen = qwen
        self.t5 = t5
        self.qwen_pad_id = qwen.convert_tokens_to_ids(QWEN_PAD)
        self.t5_end_id = t5.eos_token_id
        if self.qwen_pad_id is None or self.qwen_pad_id == qwen.unk_token_id:
            raise UserError(f"the Qwen tokenizer has no {QWEN_PAD} token: use ComfyUI's qwen25_tokenizer files")
        if self.t5_end_id is None:
            raise UserError("the T5 tokenizer has no </s> token: use ComfyUI's t5_tokenizer files")

    @classmethod
    def load(cls, qwen_dir: Path, t5_dir: Path) -> "PromptTokenizer":
        try:
            qwen = Qwen2TokenizerFast.from_pretrained(str(qwen_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load the Qwen tokenizer from {qwen_dir} ({_first_line(exc)}); replace the files per models/README.md") from None
        try:
            t5 = T5TokenizerFast.from_pretrained(str(t5_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load the T5 tokenizer from {t5_dir} ({_first_line(exc)}); replace the files per models/README.md") from None
        return cls(qwen, t5)

    def __call__(self, prompt: str) -> PromptTokens:
        qwen_ids, t5_ids, t5_weights = [], [], []
        for text, weight in parse_prompt_weights(prompt):
            if not text:
                continue
            qwen_ids += self.qwen(text, add_special_tokens=False)["input_ids"]
            segment = self.t5(text, add_special_tokens=False)["input_ids"]
            t5_ids += segment
            t5_weights += [weight] * len(segment)
        return PromptTokens(
            qwen_ids=qwen_ids or [self.qwen_pad_id],
            t5_ids=t5_ids + [self.t5_end_id],
            t5_weights=t5_weights + [1.0],
        )


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
