"""Mixtral (mistralai/Mixtral-8x7B): on disk ``model.layers.L.block_sparse_moe.gate.weight`` and
``block_sparse_moe.experts.N.w1/w2/w3.weight`` (w1 = gate, w3 = up, w2 = down); transformers 5
renames ``block_sparse_moe`` to ``mlp`` and fuses the experts at load."""

from transformers import MixtralConfig

from .family import Family, Preset


def _rope(theta):
    return {"rope_type": "default", "rope_theta": theta}


FAMILY = Family(
    name="mixtral",
    config_class=MixtralConfig,
    model_class="MixtralForCausalLM",
    expert_projs={"gate": "w1", "up": "w3", "down": "w2"},
    moe_module="block_sparse_moe",
    presets={
        p.name: p
        for p in [
            Preset("tiny", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=512, rope_parameters=_rope(1e6)),
                   "tests"),
            Preset("small", dict(vocab_size=4096, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                                 num_experts_per_tok=2, max_position_embeddings=4096, rope_parameters=_rope(1e6)),
                   "benchmarks on a laptop"),
            Preset("mixtral-8x7b", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                                        rms_norm_eps=1e-5, rope_parameters=_rope(1e6)),
                   "mistralai/Mixtral-8x7B-v0.1"),
            Preset("mixtral-8x22b", dict(vocab_size=32768, hidden_size=6144, intermediate_size=16384,
                                         num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
                                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
                                         rms_norm_eps=1e-5, rope_parameters=_rope(1e6)),
                   "mistralai/Mixtral-8x22B-v0.1"),
        ]
    },
)
