"""`anima-ui random-model`: a complete model folder in the official release layout (models/README.md) with
random weights and locally trained tokenizers, for tests and for trying the app without the real files.

The folder is written under a temporary name next to --out and renamed at the end, so an interrupted
run never leaves a half-written model folder at --out."""

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anima_ui import modelfiles
from anima_ui.errors import UserError


@dataclass(frozen=True)
class TextEncoderShape:
    """Qwen3 dimensions; `endoftext_id` is where the Qwen tokenizer's special tokens start."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    endoftext_id: int


# The real Qwen3-0.6B-Base (anima_model.md §6.1).
FULL_TEXT_ENCODER = TextEncoderShape(
    vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, endoftext_id=151643
)
TINY_VAE_BASE_DIM = 16
FULL_VAE_BASE_DIM = 96


def add_arguments(parser):
    parser.add_argument("--config", choices=("tiny", "full"), default="tiny", help="tiny: test-sized (seconds); full: the real shapes (~5.6 GB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--out", required=True, help="the model folder to create (must not exist)")


def run(args) -> int:
    started = time.perf_counter()
    out = write_random_model(Path(args.out), args.config, args.seed)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({args.config}, seed {args.seed}): {size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s")
    return 0


def text_encoder_shape(config: str, adapter_source_dim: int) -> TextEncoderShape:
    """Tiny: as wide as the tiny adapter's source, 2 layers, GQA kept (2 query heads per KV head)."""
    if config == "full":
        return FULL_TEXT_ENCODER
    return TextEncoderShape(
        vocab=512, hidden=adapter_source_dim, layers=2, heads=4, kv_heads=2, head_dim=adapter_source_dim // 4,
        intermediate=2 * adapter_source_dim, endoftext_id=448,
    )


def write_random_model(out: Path, config: str, seed: int) -> Path:
    from anima_ui.model.config import AnimaConfig

    if out.exists():
        raise UserError(f"{out} already exists; choose a new --out folder or delete that one")
    if not out.parent.is_dir():
        raise UserError(f"the parent folder of --out ({out.parent}) does not exist; create it first")
    cfg = AnimaConfig.full() if config == "full" else AnimaConfig.tiny()
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        partial.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
        _write_dit(partial / modelfiles.DIT_DIR / "anima-base-v1.0.safetensors", cfg, seed)
        te = text_encoder_shape(config, cfg.adapter_source_dim)
        _write_text_encoder(partial / modelfiles.TEXT_ENCODER, te, seed + 1)
        _write_vae(partial / modelfiles.VAE, FULL_VAE_BASE_DIM if config == "full" else TINY_VAE_BASE_DIM, seed + 2)
        _write_tokenizers(partial, te, cfg.adapter_vocab)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


# -- weights ---------------------------------------------------------------------------------------------------------
def _write_dit(path: Path, cfg, seed: int) -> None:
    from anima_ui.model.checkpoint import dit_param_shapes, random_dit_state

    state = random_dit_state(cfg, seed)
    shapes = {"net." + key: shape for key, shape in dit_param_shapes(cfg).items()}
    # pop: each float32 tensor is released once it is written
    write_bf16_safetensors(path, shapes, lambda name: state.pop(name[len("net.") :]))


def qwen3_param_shapes(te: TextEncoderShape) -> dict[str, tuple]:
    """HF Qwen3ForCausalLM names, as in qwen_3_06b_base.safetensors (tied embeddings: no lm_head)."""
    q_out, kv_out = te.heads * te.head_dim, te.kv_heads * te.head_dim
    shapes = {"model.embed_tokens.weight": (te.vocab, te.hidden)}
    for i in range(te.layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_out, te.hidden),
                p + "self_attn.k_proj.weight": (kv_out, te.hidden),
                p + "self_attn.v_proj.weight": (kv_out, te.hidden),
                p + "self_attn.o_proj.weight": (te.hidden, q_out),
                p + "self_attn.q_norm.weight": (te.head_dim,),
                p + "self_attn.k_norm.weight": (te.head_dim,),
                p + "mlp.gate_proj.weight": (te.intermediate, te.hidden),
                p + "mlp.up_proj.weight": (te.intermediate, te.hidden),
                p + "mlp.down_proj.weight": (te.hidden, te.intermediate),
                p + "input_layernorm.weight": (te.hidden,),
                p + "post_attention_layernorm.weight": (te.hidden,),
            }
        )
    shapes["model.norm.weight"] = (te.hidden,)
    return shapes


def _write_text_encoder(path: Path, te: TextEncoderShape, seed: int) -> None:
    rng = np.random.default_rng(seed)

    def make(name: str) -> np.ndarray:
        shape = shapes[name]
        # Norm weights near (not at) 1, so a skipped or swapped norm changes the output.
        if name.endswith("norm.weight"):
            return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)

    shapes = qwen3_param_shapes(te)
    write_bf16_safetensors(path, shapes, make)


def _write_vae(path: Path, base_dim: int, seed: int) -> None:
    from anima_ui.vae.wan_decoder import random_vae_state, vae_param_shapes

    state = random_vae_state(base_dim, seed)
    write_bf16_safetensors(path, vae_param_shapes(base_dim), state.pop)


def write_bf16_safetensors(path: Path, shapes: dict[str, tuple], make) -> None:
    """Stream a bf16 safetensors file: the header comes from `shapes`, then `make(name)` (float32) is
    called once per tensor in order, so at most one converted tensor is held at a time."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for name, shape in shapes.items():
            values = np.asarray(make(name), dtype=np.float32)
            if values.shape != tuple(shape):
                raise ValueError(f"{name}: generated shape {values.shape}, header says {tuple(shape)}")
            f.write(float32_to_bf16_bits(values).tobytes())


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch's .to(bfloat16) does for finite values."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


# -- tokenizers ------------------------------------------------------------------------------------------------------
def _write_tokenizers(root: Path, te: TextEncoderShape, t5_rows: int) -> None:
    from anima_ui.text.train_tokenizers import write_qwen_tokenizer, write_t5_tokenizer

    specials = write_qwen_tokenizer(root / modelfiles.QWEN_TOKENIZER_DIR, te.endoftext_id)
    if te.endoftext_id + len(specials) > te.vocab:
        raise ValueError(f"Qwen special tokens end at {te.endoftext_id + len(specials)}, beyond the {te.vocab} embedding rows")
    write_t5_tokenizer(root / modelfiles.T5_TOKENIZER_DIR, t5_rows)
