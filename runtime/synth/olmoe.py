"""OLMoE (allenai/OLMoE-1B-7B-0924): ``mlp.gate`` router, ``mlp.experts.N.gate_proj/up_proj/
down_proj``, q/k RMS norms over the whole projection (not per head)."""

from transformers import OlmoeConfig

from .family import Family, Preset


def _rope(theta):
    return {"rope_type": "default", "rope_theta": theta}


FAMILY = Family(
    name="olmoe",
    config_class=OlmoeConfig,
    model_class="OlmoeForCausalLM",
    presets={
        p.name: p
        for p in [
            Preset("tiny", dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                                max_position_embeddings=512, rope_parameters=_rope(1e4)),
                   "tests"),
            Preset("small", dict(vocab_size=4096, hidden_size=512, intermediate_size=256, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
                                 max_position_embeddings=4096, rope_parameters=_rope(1e4)),
                   "benchmarks on a laptop"),
            Preset("olmoe-1b-7b", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                       num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                       num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_parameters=_rope(1e4)),
                   "allenai/OLMoE-1B-7B-0924"),
        ]
    },
)
