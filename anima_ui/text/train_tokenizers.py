"""Small tokenizers in the release's file formats, trained here on a built-in corpus (for random-weight
model folders: nothing is downloaded).

- Qwen: a byte-level BPE in Qwen2 format (vocab.json + merges.txt + tokenizer_config.json). As in the
  real release, vocab.json holds only the ordinary tokens and the special tokens live in
  tokenizer_config.json right after them; filler entries pad the ordinary vocabulary so that
  `<|endoftext|>` lands on a chosen id (151643 for the full-size model, as in Qwen2/Qwen3).
- T5: a Unigram (SentencePiece-style) `tokenizer.json` with `<pad>` = 0, `</s>` = 1, `<unk>` = 2, then the
  pieces, then 100 `<extra_id_N>` sentinels (N = 99 first), as in T5 v1.1.
"""

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, Unigram
from tokenizers.trainers import BpeTrainer, UnigramTrainer

# Qwen2's pre-tokenization split, as in transformers' Qwen2Tokenizer (a test checks they agree); copied so
# that writing a random model does not import transformers.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS = """\
masterpiece, best quality, 1girl, solo, long hair, looking at viewer, smile, blue eyes, school uniform
a quiet street at dusk, lanterns, cherry blossoms, soft light, wide shot, detailed background
worst quality, low quality, blurry, jpeg artifacts, bad anatomy, extra fingers, watermark, signature
1boy, short hair, black hair, jacket, hands in pockets, city lights, night, rain, reflections
an old lighthouse on a cliff above a stormy sea, dramatic clouds, painterly style
two cats sleeping on a windowsill in the afternoon sun, warm colors, cozy room
portrait of a knight in silver armor, red cape, castle in the background, highly detailed
a bowl of ramen with an egg and green onions, steam, wooden table, close-up
forest path in autumn, fallen leaves, fog, morning, sunbeams through the trees
girl with a red umbrella standing in the snow, white scarf, winter, quiet mood
a small robot watering flowers in a greenhouse, glass roof, plants, cheerful
mountain lake at sunrise, mirror reflection, pine trees, calm water, pastel sky
dragon flying over a medieval town, fire, smoke, people running, epic scene
Ein Mädchen mit Hut liest ein Buch im Park. 雨の日の東京、傘をさした少女。 café, naïve, façade
numbers 0 1 2 3 4 5 6 7 8 9 10 100 1024 2026, symbols: (parentheses) [brackets] {braces} <angles> \\ / | - _ + = * & % $ # @ !
"""


def corpus_lines() -> list[str]:
    return CORPUS.splitlines()


def write_qwen_tokenizer(folder: Path, endoftext_id: int, bpe_vocab_size: int = 1000) -> list[str]:
    """Write vocab.json, merges.txt and tokenizer_config.json; `<|endoftext|>` gets `endoftext_id`.
    Returns the special tokens in id order (they occupy endoftext_id, endoftext_id + 1, ...)."""
    trained = _train_qwen_bpe(min(bpe_vocab_size, endoftext_id))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    # Fillers are never produced: no merge yields them and they are not single byte symbols.
    for filler_id in range(len(vocab), endoftext_id):
        vocab[f"<|filler_{filler_id}|>"] = filler_id
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(endoftext_id + i): _added_token(token) for i, token in enumerate(specials)},
        "additional_special_tokens": specials[1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return specials


def _train_qwen_bpe(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    return tokenizer


T5_SPECIALS = ["<pad>", "</s>", "<unk>"]
T5_EXTRA_IDS = 100


def write_t5_tokenizer(folder: Path, vocab_rows: int, unigram_vocab_size: int = 1000) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json. All ids stay below
    `vocab_rows` (the adapter's T5 embedding rows)."""
    pieces = min(unigram_vocab_size, vocab_rows - T5_EXTRA_IDS)
    tokenizer = Tokenizer(Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)]
    )
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = UnigramTrainer(vocab_size=pieces, special_tokens=T5_SPECIALS, unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    extra = [f"<extra_id_{i}>" for i in reversed(range(T5_EXTRA_IDS))]
    tokenizer.add_special_tokens(extra)
    used = tokenizer.get_vocab_size(with_added_tokens=True)
    if used > vocab_rows:
        raise ValueError(f"the T5 tokenizer needs {used} ids but the adapter embeds only {vocab_rows}")

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): _added_token(t) for t in T5_SPECIALS + extra}
    sentinels = [f"<extra_id_{i}>" for i in range(T5_EXTRA_IDS)]
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": sentinels,
        "clean_up_tokenization_spaces": True,
        "eos_token": "</s>",
        "extra_ids": T5_EXTRA_IDS,
        "legacy": False,
        "model_max_length": 512,
        "pad_token": "<pad>",
        "tokenizer_class": "T5Tokenizer",
        "unk_token": "<unk>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    special_map = {"additional_special_tokens": sentinels, "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2), encoding="utf-8")


def _added_token(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
