"""Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B): ``mlp.gate`` router, ``mlp.experts.N.gate_proj/up_proj/
down_proj``, a shared expert (``mlp.shared_expert.*``) with a sigmoid gate
(``mlp.shared_expert_gate``), biases on q/k/v."""

from transformers import Qwen2MoeConfig

from .family import Family, Preset


def _rope(theta):
    return {"rope_type": "default", "rope_theta": theta}


FAMILY = Family(
    name="qwen2_moe",
    config_class=Qwen2MoeConfig,
    model_class="Qwen2MoeForCausalLM",
    presets={
        p.name: p
        for p in [
            Preset("tiny", dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                max_position_embeddings=512, rope_parameters=_rope(1e6)),
                   "tests"),
            Preset("small", dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, moe_intermediate_size=352,
                                 shared_expert_intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=8, num_experts=30, num_experts_per_tok=4,
                                 max_position_embeddings=4096, rope_parameters=_rope(1e6)),
                   "benchmarks on a laptop"),
            Preset("qwen1.5-moe-a2.7b", dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                                             moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                             num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                             num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                                             max_position_embeddings=8192, rope_parameters=_rope(1e6)),
                   "Qwen/Qwen1.5-MoE-A2.7B"),
            Preset("qwen2-57b-a14b", dict(vocab_size=151936, hidden_size=3584, intermediate_size=18944,
                                          moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                                          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                          num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                          max_position_embeddings=32768, rope_parameters=_rope(1e6)),
                   "Qwen/Qwen2-57B-A14B"),
        ]
    },
)
