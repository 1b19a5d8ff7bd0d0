"""Tokenization exactly as ComfyUI does it for Anima (anima_model.md §6.3), with tokenizers in the release format."""

import pytest
from transformers import Qwen2Tokenizer, T5TokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from anima_ui.errors import UserError
from anima_ui.fixtures.model import write_random_model
from anima_ui.limits import MAX_PROMPT_NESTING
from anima_ui.modelfiles import ModelPaths
from anima_ui.text.prompt_weights import parse_prompt_weights
from anima_ui.text.tokenize import PromptTokenizer
from anima_ui.fixtures.tokenizers import QWEN2_PRETOKENIZE_REGEX, write_qwen_tokenizer, write_t5_tokenizer


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return ModelPaths.find(write_random_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=5))


@pytest.fixture(scope="module")
def tokenizer(paths):
    return PromptTokenizer.load(paths.qwen_tokenizer_dir, paths.t5_tokenizer_dir)


@pytest.fixture(scope="module")
def full_size_tokenizer(tmp_path_factory):
    """The token-id layout of the real files: <|endoftext|> = 151643, T5 ids below the adapter's 32128 rows."""
    root = tmp_path_factory.mktemp("full_tokenizers")
    write_qwen_tokenizer(root / "qwen", endoftext_id=151643)
    write_t5_tokenizer(root / "t5", vocab_rows=32128)
    return PromptTokenizer.load(root / "qwen", root / "t5")


def test_empty_prompt(tokenizer, full_size_tokenizer):
    tokens = full_size_tokenizer("")
    assert tokens.qwen_ids == [151643]
    assert tokens.t5_ids == [1]
    assert tokens.t5_weights == [1.0]
    assert tokenizer("").qwen_ids == [448]  # the tiny tokenizer's <|endoftext|>


def test_qwen_ids_are_the_plain_bpe_without_bos_or_eos(tokenizer, full_size_tokenizer):
    for prompt in ["1girl, solo, long hair, smile", "a quiet street at dusk", "雨の日の東京"]:
        for tok in (tokenizer, full_size_tokenizer):
            ids = tok(prompt).qwen_ids
            assert tok.qwen.decode(ids) == prompt
            assert all(i < tok.qwen_pad_id for i in ids)  # no special token at either end
    # the plain prompt is one BPE call: a lone word has fewer tokens than its characters (merges applied)
    assert len(full_size_tokenizer("lighthouse").qwen_ids) < len("lighthouse")


def test_t5_ids_end_with_the_end_token_only(tokenizer, full_size_tokenizer):
    for tok in (tokenizer, full_size_tokenizer):
        tokens = tok("masterpiece, best quality, night, rain")
        assert tokens.t5_ids[-1] == 1
        assert 1 not in tokens.t5_ids[:-1] and 0 not in tokens.t5_ids
        assert tok.t5.decode(tokens.t5_ids[:-1]) == "masterpiece, best quality, night, rain"
        assert tokens.t5_weights == [1.0] * len(tokens.t5_ids)


def test_transformers_reads_the_files_as_the_official_classes(paths):
    qwen = Qwen2Tokenizer.from_pretrained(str(paths.qwen_tokenizer_dir))
    t5 = T5TokenizerFast.from_pretrained(str(paths.t5_tokenizer_dir))
    assert qwen("")["input_ids"] == [] and qwen.pad_token == "<|endoftext|>"
    assert t5("")["input_ids"] == [1] and t5.pad_token_id == 0 and t5.unk_token_id == 2


def test_qwen2_split_regex_is_transformers_own():
    assert QWEN2_PRETOKENIZE_REGEX == PRETOKENIZE_REGEX


@pytest.mark.parametrize(
    "prompt, segments",
    [
        ("a girl, smile", [("a girl, smile", 1.0)]),
        ("a (smile:1.3) b", [("a ", 1.0), ("smile", 1.3), (" b", 1.0)]),
        ("(smile)", [("smile", 1.1)]),
        ("((smile))", [("smile", 1.1 * 1.1)]),
        ("((smile:0.5))", [("smile", 0.5)]),  # an explicit weight replaces the enclosing 1.1
        ("(a (b:2) c:0.5)", [("a ", 0.5), ("b", 2.0), (" c", 0.5)]),
        ("(time: noon)", [("time: noon", 1.1)]),  # not a number: the colon is text
        ("artist \\(style\\)", [("artist (style)", 1.0)]),
        ("a) (b", [("a) (b", 1.0)]),  # unbalanced: stays text
        ("(a", [("(a", 1.0)]),
        ("", []),
    ],
)
def test_comfyui_weight_syntax(prompt, segments):
    parsed = parse_prompt_weights(prompt)
    assert [text for text, _ in parsed] == [text for text, _ in segments]
    assert [weight for _, weight in parsed] == pytest.approx([weight for _, weight in segments])


def test_weights_and_nesting_are_bounded_and_the_parse_is_linear():
    # 10 levels deep (the limit) with a long text inside: each level copies its group once, so the work is about
    # 10 times the prompt, never its square.
    deep = "(" * MAX_PROMPT_NESTING + "x " * 2000 + ")" * MAX_PROMPT_NESTING
    [(text, weight)] = parse_prompt_weights(deep)
    assert text == "x " * 2000 and weight == pytest.approx(1.1 ** MAX_PROMPT_NESTING)
    assert parse_prompt_weights("(a:-2.5) (b:1e1)") == [("a", -2.5), (" ", 1.0), ("b", 10.0)]
    with pytest.raises(UserError, match="nests parentheses 5000 deep"):
        parse_prompt_weights("(" * 5000 + "cat" + ")" * 5000)
    for weight in ("1e309", "inf", "nan", "-11"):
        with pytest.raises(UserError, match=f"the weight in '\\(cat:{weight}\\)' is out of range"):
            parse_prompt_weights(f"a (cat:{weight}) b")


def test_weighted_segments_are_tokenized_separately_and_weight_only_t5(tokenizer):
    tokens = tokenizer("night, (rain:1.5), city")
    pieces = ["night, ", "rain", ", city"]
    assert tokens.qwen_ids == sum((tokenizer.qwen(p, add_special_tokens=False)["input_ids"] for p in pieces), [])
    t5_pieces = [tokenizer.t5(p, add_special_tokens=False)["input_ids"] for p in pieces]
    assert tokens.t5_ids == sum(t5_pieces, []) + [1]
    assert tokens.t5_weights == [1.0] * len(t5_pieces[0]) + [1.5] * len(t5_pieces[1]) + [1.0] * (len(t5_pieces[2]) + 1)


def test_only_parentheses_is_an_empty_prompt(tokenizer):
    assert tokenizer("()") == tokenizer("")
