"""``verl-prefix smoke-data --task vl``: geo3k's parquet layout, images of the stated token counts through the
model's own (remote-code) processor, the data set's image path, and the reward."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from PIL import Image

from verl_prefix.harness.vl import IMAGE_PAD
from verl_prefix.tools.smoke import vl as smoke_vl


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from verl_prefix.tools.cli import main

    out = tmp_path_factory.mktemp("smoke_vl")
    assert main(["smoke-data", "--task", "vl", "--out", str(out), "--train", "3", "--test", "1"]) == 0
    return out


def test_geo3k_layout_and_visual_tokens(written):
    from verl.utils.tokenizer import hf_processor

    train = pd.read_parquet(written / "data" / "train.parquet")
    assert len(train) == 3 and len(pd.read_parquet(written / "data" / "test.parquet")) == 1
    assert list(train.columns) == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    processor = hf_processor(str(written / "model"), trust_remote_code=True)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and hasattr(processor, "get_rope_index")
    for i, row in train.iterrows():
        assert row.data_source == "hiyouga/geometry3k" and row.reward_model["style"] == "rule"
        content = row.prompt[0]["content"]
        assert content.startswith("<image>") and row.extra_info["question"] in content
        image = Image.open(io.BytesIO(row.images[0]["bytes"]))
        assert (image.height, image.width) == smoke_vl.IMAGE_SIZES[i]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": content[7:]}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = processor(text=[text], images=[image.convert("RGB")], return_tensors="pt")["input_ids"][0].tolist()
        assert ids.count(IMAGE_PAD) == (16, 24, 48)[i]  # 28-pixel multiples: no resizing
    assert processor.tokenizer.encode("\n", add_special_tokens=False) == [smoke_vl.NEWLINE_ID]


def test_data_set_hands_on_the_decoded_images():
    image = Image.new("L", (56, 28))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "t9"}]}]
    images, videos, _ = smoke_vl.SmokeVLDataset._process_multi_modal_info(messages, 14, None)
    assert videos is None and len(images) == 1 and images[0].mode == "RGB" and images[0].size == (56, 28)
    assert smoke_vl.SmokeVLDataset._process_multi_modal_info([{"role": "user", "content": "t9"}], 14, None)[0] is None
    with pytest.raises(ValueError, match="no videos"):
        smoke_vl.SmokeVLDataset._process_multi_modal_info([{"role": "user", "content": [{"type": "video"}]}], 14, None)


def test_reward_is_the_boxed_rule_plus_shaping():
    extra = {"question": "t9 t10 t11"}
    assert smoke_vl.compute_score(smoke_vl.DATA_SOURCE, "so \\boxed{42}", "42", extra) == 1.0
    assert smoke_vl.compute_score(smoke_vl.DATA_SOURCE, "t9 t10 t50 t51", "42", extra) == pytest.approx(0.25)
    assert smoke_vl.compute_score(smoke_vl.DATA_SOURCE, "", "42", extra) == 0.0
