"""Qwen3-MoE (Qwen/Qwen3-30B-A3B): ``mlp.gate`` router, ``mlp.experts.N.gate_proj/up_proj/
down_proj``, no shared expert, q/k RMS norms, top-k weights renormalised."""

from transformers import Qwen3MoeConfig

from .family import Family, Preset


def _rope(theta):
    return {"rope_type": "default", "rope_theta": theta}


FAMILY = Family(
    name="qwen3_moe",
    config_class=Qwen3MoeConfig,
    model_class="Qwen3MoeForCausalLM",
    presets={
        p.name: p
        for p in [
            Preset("tiny", dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                max_position_embeddings=512, rope_parameters=_rope(1e6)),
                   "tests"),
            Preset("small", dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                 num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                                 max_position_embeddings=4096, rope_parameters=_rope(1e6)),
                   "benchmarks on a laptop"),
            Preset("qwen3-30b-a3b", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                         num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                         norm_topk_prob=True, max_position_embeddings=40960,
                                         rope_parameters=_rope(1e6)),
                   "Qwen/Qwen3-30B-A3B"),
            Preset("qwen3-235b-a22b", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                           moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                                           num_key_value_heads=4, head_dim=128, num_experts=128,
                                           num_experts_per_tok=8, norm_topk_prob=True,
                                           max_position_embeddings=40960, rope_parameters=_rope(1e6)),
                   "Qwen/Qwen3-235B-A22B"),
        ]
    },
)
