"""``mlxr demo-vision``: the tiny random Gemma 3 vision model it writes from numpy alone is a
checkpoint transformers loads without a missing or unexpected tensor, and mlxr's logits for a
prompt with an image equal transformers' (CPU, float32); the folder serves an image request."""

from __future__ import annotations

import numpy as np
import pytest

from mlxr_core.cli.demo_vision import BEGIN, END, IMAGE, write_demo_vision
from mlxr_core.errors import MlxrError

PROMPT = [0, 6, 17, 9, BEGIN, *[IMAGE] * 4, END, 33, 12, 40, 7]


def test_the_folder_is_transformers_gemma3_and_mlxr_computes_what_it_does(tmp_path):
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    import mlx.core as mx

    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.model.vision import logits_with_images
    from mlxr_core.plugins import load_plugins

    folder = write_demo_vision(tmp_path / "demo")
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        folder, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.eval()(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits[0].numpy()

    loaded = load_model(ModelConfig(path=str(folder), dtype="float32", compile_decode=False), load_plugins().registries)
    assert loaded.vision is not None and loaded.vision.tokens.tokens_per_image == 4
    images = loaded.vision.encode(list(pixels.numpy()))
    got = np.array(logits_with_images(loaded.model, mx.array([PROMPT]), images, loaded.vision.tokens)[0])
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    # and the image changes the answer: the tower is wired in, not skipped
    other = np.array(logits_with_images(loaded.model, mx.array([PROMPT]), loaded.vision.encode(list(-pixels.numpy())),
                                        loaded.vision.tokens)[0])  # fmt: skip
    assert np.abs(other[-1] - got[-1]).max() > 1e-3


def test_the_seed_decides_the_weights_and_an_existing_folder_is_kept(tmp_path):
    from safetensors.numpy import load_file

    a, b, c = (write_demo_vision(tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    wa, wb, wc = (load_file(folder / "model.safetensors") for folder in (a, b, c))
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert np.array_equal(wa[name], wb[name]) and not np.array_equal(wa[name], wc[name])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(MlxrError, match="not an empty folder"):
        write_demo_vision(tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pytest.mark.slow
def test_it_serves_an_image_through_the_openai_client(tmp_path):
    openai = pytest.importorskip("openai", reason="the client test needs the openai package")
    pytest.importorskip("PIL", reason="images need the vision extra (Pillow)")
    import base64
    import io

    from PIL import Image

    from mlxr_core.testing.serving import serve_command, start

    folder = write_demo_vision(tmp_path / "demo")
    image = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 30)).save(image, "PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {folder}\n    name: demo\nserver:\n  access_log: false\n")
    process, base_url, _ = start(serve_command(config))
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        content = [{"type": "text", "text": "t9 t10"}, {"type": "image_url", "image_url": {"url": url}}]
        with_image = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                                    max_tokens=4, temperature=0)  # fmt: skip
        text_only = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "t9 t10"}],
                                                   max_tokens=4, temperature=0)  # fmt: skip
    finally:
        process.terminate()
        process.wait(60)
    # the image's 4 tokens and its two markers are in the prompt
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + 6
    assert with_image.usage.completion_tokens == 4
