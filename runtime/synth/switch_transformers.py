"""SwitchTransformers (google/switch-base-8), encoder-decoder with top-1 routing: experts stay
separate modules in transformers 5 (``...layer.N.mlp.experts.expert_K.wi/wo.weight``, router
``...mlp.router.classifier.weight``), every other feed-forward layer sparse, embeddings tied
(``shared.weight``). Tokens over an expert's capacity skip the expert."""

from transformers import SwitchTransformersConfig

from .family import Family, Preset


def _switch(**kw):
    base = dict(vocab_size=32128, d_kv=64, relative_attention_num_buckets=32, expert_capacity=64,
                tie_word_embeddings=True, decoder_start_token_id=0, feed_forward_proj="relu")
    base.update(kw)
    return base


FAMILY = Family(
    name="switch_transformers",
    config_class=SwitchTransformersConfig,
    model_class="SwitchTransformersForConditionalGeneration",
    expert_projs={"up": "wi", "down": "wo"},
    fused=False,
    presets={
        p.name: p
        for p in [
            Preset("tiny", _switch(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_sparse_encoder_layers=2, num_sparse_decoder_layers=2,
                                   num_heads=4, num_experts=8, expert_capacity=1024), "tests"),
            Preset("small", _switch(vocab_size=4096, d_model=512, d_ff=2048, num_layers=4, num_decoder_layers=4,
                                    num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_heads=8,
                                    num_experts=16), "benchmarks on a laptop"),
            Preset("switch-base-8", _switch(d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12,
                                            num_sparse_encoder_layers=6, num_sparse_decoder_layers=6, num_heads=12,
                                            num_experts=8), "google/switch-base-8"),
            Preset("switch-base-128", _switch(d_model=768, d_ff=3072, num_layers=12, num_decoder_layers=12,
                                              num_sparse_encoder_layers=6, num_sparse_decoder_layers=6,
                                              num_heads=12, num_experts=128), "google/switch-base-128"),
            Preset("switch-large-128", _switch(d_model=1024, d_ff=4096, d_kv=64, num_layers=24,
                                               num_decoder_layers=24, num_sparse_encoder_layers=12,
                                               num_sparse_decoder_layers=12, num_heads=16, num_experts=128),
                   "google/switch-large-128"),
        ]
    },
)
