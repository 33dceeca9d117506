"""Gemma 3n's audio side against transformers 5.25: the log-Mel front end against
``Gemma3nAudioFeatureExtractor``, the conformer tower against ``Gemma3nAudioEncoder`` and the
embedder against ``Gemma3nMultimodalEmbedder``, on a tiny random ``Gemma3nAudioConfig`` (the
full ``Gemma3nForConditionalGeneration`` needs timm for its vision tower). Weights are drawn
away from transformers' init (norms around 1, a nonzero ``per_dim_scale``) so that a dropped
scale shows; the tower's last frames are masked, as a shorter sound's padding in a batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.errors import ConfigError, ModelLoadError, RequestError

torch = pytest.importorskip("torch")
gemma3n = pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n")
features_hf = pytest.importorskip("transformers.models.gemma3n.feature_extraction_gemma3n")

from mlxr_plugins.archs.gemma3n_audio import AudioArgs, Gemma3nAudio, sanitize  # noqa: E402
from mlxr_plugins.archs.gemma3n_audio_features import Gemma3nLogMel  # noqa: E402

AUDIO = {
    "hidden_size": 32,
    "input_feat_size": 16,
    "vocab_size": 8,
    "vocab_offset": 90,
    "conf_num_attention_heads": 4,
    "conf_num_hidden_layers": 2,
    "conf_attention_chunk_size": 4,
    "conf_attention_context_left": 5,
    "conf_attention_context_right": 0,
    "conf_conv_kernel_size": 3,
    "conf_reduction_factor": 2,
    "sscp_conv_channel_size": [8, 4],
}
TEXT_HIDDEN = 32


def sound(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.4 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


@pytest.mark.parametrize("settings", [{}, {"feature_size": 16, "per_bin_mean": list(range(16)),
                                           "per_bin_stddev": [2.0] * 16, "preemphasis_htk_flavor": False}])
def test_log_mel_matches_the_feature_extractor(settings):
    samples = sound(0.77)
    reference = features_hf.Gemma3nAudioFeatureExtractor(**settings)(samples, return_tensors="np")
    features, valid = Gemma3nLogMel.from_config(settings)(samples)
    assert features.shape == reference["input_features"][0].shape
    np.testing.assert_allclose(features, reference["input_features"][0], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(valid, reference["input_features_mask"][0])


def test_a_sound_shorter_than_a_frame_is_a_request_error():
    with pytest.raises(RequestError, match="shorter than one frame"):
        Gemma3nLogMel()(np.zeros(300, np.float32))


def test_dither_is_refused_naming_it():
    with pytest.raises(ConfigError, match="dither"):
        Gemma3nLogMel.from_config({"dither": 1e-4})


def reference_modules():
    torch.manual_seed(0)
    config = gemma3n.Gemma3nAudioConfig(**AUDIO)
    text = gemma3n.Gemma3nTextConfig(hidden_size=TEXT_HIDDEN, vocab_size=100, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    tower = gemma3n.Gemma3nAudioEncoder(config).eval()
    embedder = gemma3n.Gemma3nMultimodalEmbedder(config, text).eval()
    with torch.no_grad():
        for name, p in [*tower.named_parameters(), *embedder.named_parameters()]:
            if name.endswith("weight") and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "per_dim_scale" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / max(1, p.shape[-1]) ** 0.5)
    return tower, embedder


def ours_from(tower, embedder, tokens: int) -> Gemma3nAudio:
    weights = {f"model.audio_tower.{k}": mx.array(v.detach().numpy()) for k, v in tower.state_dict().items()}
    weights |= {f"model.embed_audio.{k}": mx.array(v.detach().numpy()) for k, v in embedder.state_dict().items()}
    module = Gemma3nAudio(AudioArgs.from_config(AUDIO), TEXT_HIDDEN, tokens)
    module.load_weights(list(sanitize(weights, AudioArgs.from_config(AUDIO)).items()), strict=True)
    return module


def test_tower_and_embedder_match_transformers():
    tower, embedder = reference_modules()
    features, valid = Gemma3nLogMel(feature_size=16)(sound(0.61))
    valid[-9:] = False  # as a shorter sound padded in a batch: masked frames reach every layer
    with torch.no_grad():
        out = tower(torch.tensor(features)[None], ~torch.tensor(valid)[None])
        expected = embedder(inputs_embeds=out.last_hidden_state)
        pad = embedder(input_ids=torch.tensor([[AUDIO["vocab_offset"] + AUDIO["vocab_size"] - 1]]))
        expected = torch.where(out.audio_mel_mask[..., None], pad, expected)[0].numpy()
    tokens = expected.shape[0] + 3
    ours = ours_from(tower, embedder, tokens)
    encodings, kept = ours.audio_tower(mx.array(features)[None], mx.array(valid)[None])
    np.testing.assert_array_equal(np.array(kept[0]), ~out.audio_mel_mask[0].numpy())
    assert not np.array(kept).all()  # a masked frame reaches the attention and the output
    np.testing.assert_allclose(np.array(encodings[0]), out.last_hidden_state[0].numpy(), atol=2e-4, rtol=2e-4)
    merged = np.array(ours(mx.array(features)[None], mx.array(valid)[None])[0])
    assert merged.shape == (tokens, TEXT_HIDDEN)
    np.testing.assert_allclose(merged[: len(expected)], expected, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(merged[len(expected):], np.broadcast_to(pad[0].numpy(), (3, TEXT_HIDDEN)),
                               atol=2e-4, rtol=2e-4)  # fmt: skip


def test_two_sounds_padded_together_match_transformers():
    """A batch as the feature extractor pads it (the shorter sound's frames masked): each row of
    the tower's output against transformers' on the same batch."""
    tower, embedder = reference_modules()
    batch = features_hf.Gemma3nAudioFeatureExtractor(feature_size=16)([sound(0.9, 1), sound(0.4, 2)],
                                                                       return_tensors="np")  # fmt: skip
    features, valid = batch["input_features"], batch["input_features_mask"]
    assert not valid[1].all()
    with torch.no_grad():
        out = tower(torch.tensor(features), ~torch.tensor(valid))
    ours = ours_from(tower, embedder, 8)
    encodings, kept = ours.audio_tower(mx.array(features), mx.array(valid))
    np.testing.assert_array_equal(np.array(kept), ~out.audio_mel_mask.numpy())
    np.testing.assert_allclose(np.array(encodings), out.last_hidden_state.numpy(), atol=2e-4, rtol=2e-4)


def test_convolutions_already_in_mlx_layout_are_kept():
    """An MLX conversion's folder (convolutions channels last, names without ``model.``) gives the
    same tensors as the PyTorch layout."""
    args = AudioArgs.from_config(AUDIO)
    tower, _ = reference_modules()
    hub = {f"model.audio_tower.{k}": mx.array(v.detach().numpy()) for k, v in tower.state_dict().items()}
    ours = sanitize(hub, args)
    converted = sanitize(dict(ours), args)  # sanitized names are the MLX conversion's
    assert converted.keys() == ours.keys()
    for name, value in ours.items():
        np.testing.assert_array_equal(np.array(converted[name]), np.array(value), err_msg=name)
    assert ours["audio_tower.subsample_conv_projection.conv_1.conv.weight"].shape == (4, 3, 3, 8)


def test_a_third_subsampling_convolution_is_refused_naming_the_key():
    with pytest.raises(ModelLoadError, match="sscp_conv_channel_size"):
        AudioArgs.from_config({**AUDIO, "sscp_conv_channel_size": [8, 4, 2]})


TEXT = {
    "vocab_size": 97, "hidden_size": TEXT_HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "sliding_window": 8, "max_position_embeddings": 256, "laurel_rank": 4,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 90, "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "num_kv_shared_layers": 0,
    "intermediate_size": 48, "altup_num_inputs": 2, "altup_active_idx": 1, "altup_correct_scale": False,
}  # fmt: skip


def test_merged_sequence_logits_match_transformers(tmp_path):
    """A prompt of text, ``<start_of_audio>`` (a text id), the sound's soft tokens and
    ``<end_of_audio>`` (an id of the audio vocabulary, embedded by the audio embedder's table):
    mlxr's logits against transformers' text model fed the merged ``inputs_embeds`` and the
    per-layer inputs its ``Gemma3nModel`` makes (ids past the per-layer table read row 0)."""
    from mlxr_core.plugins import load_plugins
    from mlxr_core.testing.hf_reference import load_reference_model, tiny_reference
    from mlxr_plugins.archs.gemma3n_audio import AudioTokens, embeddings_with_audio

    reference = tiny_reference("Gemma3nForCausalLM", "Gemma3nTextConfig", TEXT, tmp_path, lengths=(4,))
    text = load_reference_model(reference, load_plugins().registries).model
    hf = pytest.importorskip("transformers").Gemma3nForCausalLM.from_pretrained(tmp_path).eval()
    tower, embedder = reference_modules()
    features, valid = Gemma3nLogMel(feature_size=16)(sound(0.3))
    ours = ours_from(tower, embedder, 12)
    tokens = AudioTokens(audio_token_id=91, tokens=12, vocab_offset=90, vocab_size=8)
    eoa = 90
    ids = [2, 17, 33, 5, *[91] * tokens.tokens, eoa, 44, 8]
    sounds = ours(mx.array(features)[None], mx.array(valid)[None])
    inputs = mx.array([ids])
    logits = np.array(text(inputs, None, None, embeddings=embeddings_with_audio(text, inputs, sounds, ours, tokens)))
    with torch.no_grad():
        t_ids = torch.tensor([ids])
        hard = t_ids >= 90
        embeds = hf.model.embed_tokens(torch.where(hard, 0, t_ids))
        embeds = torch.where(hard[..., None], embedder(input_ids=torch.where(hard, t_ids, 90)), embeds)
        out = tower(torch.tensor(features)[None], ~torch.tensor(valid)[None])
        soft = embedder(inputs_embeds=out.last_hidden_state)
        pad = embedder(input_ids=torch.tensor([[97]]))
        soft = torch.where(out.audio_mel_mask[..., None], pad, soft)
        soft = torch.cat([soft, pad.expand(1, tokens.tokens - soft.shape[1], -1)], dim=1)
        assert soft.shape[1] == tokens.tokens
        embeds = embeds.masked_scatter((t_ids == 91)[..., None].expand_as(embeds), soft)
        per_layer = hf.model.get_per_layer_inputs(torch.where(t_ids < 90, t_ids, 0))
        hidden = hf.model(inputs_embeds=embeds, per_layer_inputs=per_layer).last_hidden_state
        expected = hf.lm_head(hidden)
        cap = hf.config.final_logit_softcapping
        if cap:
            expected = torch.tanh(expected / cap) * cap
    np.testing.assert_allclose(logits, expected.numpy(), atol=2e-4, rtol=2e-4)
