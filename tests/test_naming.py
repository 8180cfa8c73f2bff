"""zipmoe.codecs.naming: expert/dense recognition per family."""

from __future__ import annotations

import pytest

from zipmoe.codecs.naming import SWITCH_DECODER_OFFSET_NO_CONFIG, TensorRole, classify, num_experts

E = "expert"
D = "dense"


@pytest.mark.parametrize(
    "name,shape,expected",
    [
        # Mixtral
        ("model.layers.3.block_sparse_moe.experts.7.w1.weight", (14, 4), (E, 3, 7, "gate", False)),
        ("model.layers.3.block_sparse_moe.experts.7.w3.weight", (14, 4), (E, 3, 7, "up", False)),
        ("model.layers.3.block_sparse_moe.experts.7.w2.weight", (4, 14), (E, 3, 7, "down", False)),
        ("model.layers.3.block_sparse_moe.gate.weight", (8, 4), (D, 3, None, None, False)),
        # Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V2
        ("model.layers.0.mlp.experts.12.gate_proj.weight", (8, 4), (E, 0, 12, "gate", False)),
        ("model.layers.0.mlp.experts.12.up_proj.weight", (8, 4), (E, 0, 12, "up", False)),
        ("model.layers.11.mlp.experts.0.down_proj.weight", (4, 8), (E, 11, 0, "down", False)),
        ("model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv", (1, 1), (E, 1, 3, "gate", False)),
        ("model.layers.0.mlp.gate.weight", (60, 4), (D, 0, None, None, False)),
        ("model.layers.0.mlp.gate.e_score_correction_bias", (60,), (D, 0, None, None, False)),
        # shared experts are dense
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", (8, 4), (D, 0, None, None, False)),
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 4), (D, 0, None, None, False)),
        ("model.layers.2.mlp.shared_experts.down_proj.weight", (4, 8), (D, 2, None, None, False)),
        # fused transformers-5 layout
        ("model.layers.5.mlp.experts.gate_up_proj", (8, 16, 4), (E, 5, None, "gate_up", True)),
        ("model.layers.5.mlp.experts.down_proj", (8, 4, 8), (E, 5, None, "down", True)),
        ("model.layers.5.mlp.experts.gate_up_proj_bias", (8, 16), (E, 5, None, "gate_up", True)),
        ("model.layers.5.mlp.experts.down_proj_bias", (8,), (D, 5, None, None, False)),
        # dense bits
        ("model.embed_tokens.weight", (100, 4), (D, None, None, None, False)),
        ("lm_head.weight", (100, 4), (D, None, None, None, False)),
        ("model.layers.4.self_attn.q_proj.weight", (4, 4), (D, 4, None, None, False)),
        ("model.layers.0.mlp.gate_proj.weight", (8, 4), (D, 0, None, None, False)),
        ("model.norm.weight", (4,), (D, None, None, None, False)),
        # Jamba-style
        ("model.layers.1.feed_forward.experts.2.up_proj.weight", (8, 4), (E, 1, 2, "up", False)),
    ],
)
def test_classify(name, shape, expected):
    r = classify(name, shape, None)
    assert isinstance(r, TensorRole)
    assert tuple(r) == expected


SWITCH_CFG = {"model_type": "switch_transformers", "num_layers": 12, "num_decoder_layers": 12, "num_experts": 8}


def test_switch_transformers():
    r = classify("encoder.block.1.layer.1.mlp.experts.expert_5.wi.weight", (32, 8), SWITCH_CFG)
    assert r == TensorRole(E, 1, 5, "up", False)
    r = classify("encoder.block.3.layer.1.mlp.experts.expert_0.wo.weight", (8, 32), SWITCH_CFG)
    assert r == TensorRole(E, 3, 0, "down", False)
    # decoder blocks are numbered after the encoder's: unique across both stacks
    r = classify("decoder.block.1.layer.2.mlp.experts.expert_5.wi.weight", (32, 8), SWITCH_CFG)
    assert r == TensorRole(E, 13, 5, "up", False)
    assert classify("decoder.block.1.layer.2.mlp.router.classifier.weight", (8, 8), SWITCH_CFG).role == D
    assert classify("encoder.block.0.layer.1.DenseReluDense.wi.weight", (32, 8), SWITCH_CFG).role == D
    assert classify("shared.weight", (100, 8), SWITCH_CFG) == TensorRole(D, None, None, None, False)
    # no config: still unique
    r = classify("decoder.block.1.layer.2.mlp.experts.expert_5.wi.weight", (32, 8), None)
    assert r.layer == SWITCH_DECODER_OFFSET_NO_CONFIG + 1


def test_switch_layers_unique():
    names = [f"{s}.block.{b}.layer.{1 if s == 'encoder' else 2}.mlp.experts.expert_0.wi.weight"
             for s in ("encoder", "decoder") for b in range(1, 12, 2)]
    layers = [classify(n, (2, 2), SWITCH_CFG).layer for n in names]
    assert len(set(layers)) == len(layers)
    assert layers == sorted(layers)  # module order


def test_num_experts():
    assert num_experts({"num_local_experts": 8}) == 8
    assert num_experts({"n_routed_experts": 64}) == 64
    assert num_experts({"text_config": {"num_experts": 4}}) == 4
    assert num_experts(None) is None and num_experts({}) is None


def test_encoder_decoder_layers_style():
    cfg = {"model_type": "nllb-moe", "is_encoder_decoder": True, "encoder_layers": 24, "decoder_layers": 24}
    r = classify("model.encoder.layers.3.ffn.experts.expert_7.fc1.weight", (8, 4), cfg)
    assert r == TensorRole(E, 3, 7, "up", False)
    r = classify("model.decoder.layers.3.ffn.experts.expert_7.fc2.weight", (4, 8), cfg)
    assert r == TensorRole(E, 27, 7, "down", False)
    # a decoder-only model whose stack is called "decoder" (OPT) keeps plain layer numbers
    r = classify("model.decoder.layers.5.self_attn.q_proj.weight", (4, 4), {"model_type": "opt"})
    assert r.layer == 5
