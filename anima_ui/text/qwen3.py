"""The Qwen3-0.6B-Base text encoder: a transformers `Qwen3Model` built from the shapes in
`qwen_3_06b_base.safetensors` (the release has no config.json), run in fp32 on the CPU."""

import numpy as np
import torch
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from anima_ui.errors import UserError

# Not recoverable from shapes; fixed for Qwen3 (ComfyUI's Qwen3_06BConfig in comfy/text_encoders/llama.py).
ROPE_THETA = 1_000_000.0
RMS_NORM_EPS = 1e-6
MAX_POSITIONS = 32768


def qwen3_config_from_shapes(shapes: dict[str, tuple]) -> Qwen3Config:
    """Infer the Qwen3 configuration from tensor shapes keyed by HF names without the `model.` prefix."""
    try:
        vocab_size, hidden = shapes["embed_tokens.weight"]
        head_dim = shapes["layers.0.self_attn.q_norm.weight"][0]
        heads = shapes["layers.0.self_attn.q_proj.weight"][0] // head_dim
        kv_heads = shapes["layers.0.self_attn.k_proj.weight"][0] // head_dim
        intermediate = shapes["layers.0.mlp.gate_proj.weight"][0]
        layers = 1 + max(int(key.split(".")[1]) for key in shapes if key.startswith("layers."))
    except (KeyError, ValueError, IndexError) as exc:
        raise UserError(f"text encoder is not a Qwen3 model (bad or missing tensor {exc}); use qwen_3_06b_base.safetensors") from None
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def expected_shapes(config: Qwen3Config) -> dict[str, tuple]:
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "norm.weight": (hidden,)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"layers.{i}.{key}": shape for key, shape in per_layer.items()})
    return shapes


def load_qwen3(path) -> Qwen3Model:
    """Load `text_encoders/qwen_3_06b_base.safetensors` (HF names, `model.` prefix, bf16) as an fp32 Qwen3Model."""
    with safe_open(str(path), framework="pt") as f:
        names = {_strip(key): key for key in f.keys() if _strip(key) is not None}
        shapes = {name: tuple(f.get_slice(key).get_shape()) for name, key in names.items()}
        config = qwen3_config_from_shapes(shapes)
        for name, shape in expected_shapes(config).items():
            if name not in shapes:
                raise UserError(f"text encoder {path} lacks tensor model.{name}; download qwen_3_06b_base.safetensors again")
            if shapes[name] != shape:
                raise UserError(f"text encoder {path}: model.{name} has shape {list(shapes[name])}, expected {list(shape)}")
        state = {name: f.get_tensor(names[name]).to(torch.float32) for name in expected_shapes(config)}
    # Build without random initialisation (meta tensors), then take the loaded tensors as parameters.
    with torch.device("meta"):
        model = Qwen3Model(config)
    model.load_state_dict(state, strict=True, assign=True)
    # The RoPE tables are non-persistent buffers (not in the file): compute them on the CPU.
    model.rotary_emb = Qwen3RotaryEmbedding(config)
    return model.eval()


def _strip(key: str) -> str | None:
    """HF Qwen3ForCausalLM names -> Qwen3Model names; None for tensors the encoder does not use (lm_head)."""
    if key.startswith("model."):
        return key[len("model.") :]
    return None


def final_hidden_states(model: Qwen3Model, ids: list[int]) -> np.ndarray:
    """The last layer's output after the final RMSNorm (what ComfyUI, diffusers and the training code all use):
    float32 [1, len(ids), hidden].
    No attention mask: a single unpadded sequence under the causal mask, as ComfyUI computes it."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.last_hidden_state.float().numpy()
