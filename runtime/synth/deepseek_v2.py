"""DeepSeek-V2 (deepseek-ai/DeepSeek-V2-Lite): multi-head latent attention (``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``), the first ``first_k_dense_replace`` layers dense, then
``mlp.gate`` router, ``mlp.experts.N.gate_proj/up_proj/down_proj`` and ``mlp.shared_experts.*``.
The published models use YaRN rope scaling; the synthetic configs keep plain rope."""

from transformers import DeepseekV2Config

from .family import Family, Preset


def _rope(theta):
    return {"rope_type": "default", "rope_theta": theta}


FAMILY = Family(
    name="deepseek_v2",
    config_class=DeepseekV2Config,
    model_class="DeepseekV2ForCausalLM",
    presets={
        p.name: p
        for p in [
            Preset("tiny", dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                qk_rope_head_dim=8, v_head_dim=16, head_dim=8, topk_method="greedy",
                                max_position_embeddings=512, rope_parameters=_rope(1e4)),
                   "tests"),
            Preset("small", dict(vocab_size=4096, hidden_size=512, intermediate_size=2048, moe_intermediate_size=256,
                                 num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8,
                                 n_routed_experts=32, n_shared_experts=2, num_experts_per_tok=4,
                                 first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64,
                                 qk_rope_head_dim=32, v_head_dim=64, head_dim=32, topk_method="greedy",
                                 max_position_embeddings=4096, rope_parameters=_rope(1e4)),
                   "benchmarks on a laptop"),
            Preset("deepseek-v2-lite", dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                            moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                                            num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                                            num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                                            q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                            v_head_dim=128, head_dim=64, topk_method="greedy",
                                            routed_scaling_factor=1.0, norm_topk_prob=False,
                                            max_position_embeddings=163840, rope_parameters=_rope(1e4)),
                   "deepseek-ai/DeepSeek-V2-Lite"),
            Preset("deepseek-v2", dict(vocab_size=102400, hidden_size=5120, intermediate_size=12288,
                                       moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128,
                                       num_key_value_heads=128, n_routed_experts=160, n_shared_experts=2,
                                       num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                                       q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                       head_dim=64, topk_method="group_limited_greedy", n_group=8, topk_group=3,
                                       routed_scaling_factor=16.0, norm_topk_prob=False,
                                       max_position_embeddings=163840, rope_parameters=_rope(1e4)),
                   "deepseek-ai/DeepSeek-V2"),
        ]
    },
)
