"""The ``hf`` rollout server without Ray: sampling parameters, log-probs, weight updates, registration."""

import asyncio

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from verl_prefix.backend.trainer import rollout_hf
from verl_prefix.harness import tiny_models


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from verl.workers.config import RolloutConfig

    model_dir = tiny_models.write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama")
    config = RolloutConfig(name="hf", dtype="float32", prompt_length=32, response_length=12, calculate_log_probs=True)
    model_config = OmegaConf.create({"path": str(model_dir), "trust_remote_code": False})
    return rollout_hf.HFRolloutServer(config=config, model_config=model_config, replica_rank=0), model_dir


PROMPT = [2, 10, 11, 12, 13, 14, 15, 16]


def _gen(srv, seed=1, **params):
    return srv._generate(list(PROMPT), {"logprobs": True, **params}, seed)


def test_log_probs_are_the_actors(server):
    srv, model_dir = server
    out = _gen(srv, temperature=0.7, top_p=0.9, top_k=20)
    assert 1 <= len(out.token_ids) <= 12 and len(out.log_probs) == len(out.token_ids)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1] / 0.7
    want = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs), want, rtol=1e-5, atol=1e-5)


def test_sampling_parameters(server):
    srv, _ = server
    assert len(_gen(srv, max_tokens=3, ignore_eos=True).token_ids) == 3
    assert len(_gen(srv, max_new_tokens=5, ignore_eos=True).token_ids) == 5
    # default: response_length, capped by what prompt_length + response_length leaves
    assert len(_gen(srv, ignore_eos=True).token_ids) == 12
    greedy = _gen(srv, temperature=0, ignore_eos=True, seed=1).token_ids
    assert greedy == _gen(srv, temperature=0, ignore_eos=True, seed=2).token_ids
    assert greedy == _gen(srv, temperature=1.0, top_k=1, ignore_eos=True, seed=3).token_ids
    # same seed, same sample; other seeds differ somewhere
    a = _gen(srv, temperature=1.0, seed=5, ignore_eos=True).token_ids
    assert a == _gen(srv, temperature=1.0, seed=5, ignore_eos=True).token_ids
    assert any(_gen(srv, temperature=1.0, seed=s, ignore_eos=True).token_ids != a for s in range(6, 10))
    # an explicit seed in sampling_params wins (no seed book needed)
    assert asyncio.run(srv._seed(PROMPT, {"seed": 7})) == 7
    with pytest.raises(ValueError, match="no room"):
        srv._max_tokens({}, 44)


def test_weight_update_installs_and_refuses_partial(server):
    srv, _ = server
    state = {k: v.clone() + 0.5 for k, v in srv.model.state_dict().items()}
    names = list(state)
    srv.load_weights([(n, state[n]) for n in names[:3]])
    srv.load_weights([(n, state[n]) for n in names[3:]])
    assert srv.finish_weight_update(global_steps=4) == len(names)
    assert srv.global_steps == 4
    torch.testing.assert_close(srv.model.state_dict()[names[0]], state[names[0]])
    srv.load_weights([(names[0], state[names[0]])])
    with pytest.raises(RuntimeError, match="missing"):
        srv.finish_weight_update(global_steps=5)


def test_registered_in_verl():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import verl_prefix  # noqa: F401

    assert rollout_hf.is_registered()
    assert get_rollout_replica_class("hf") is rollout_hf.HFReplica
    assert get_rollout_class("hf", "async") is rollout_hf.HFServerAdapter


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    """The server on the CPU smoke recipe's tiny Qwen2.5-VL (image-only processor, remote code)."""
    from verl.workers.config import RolloutConfig

    from verl_prefix.tools.smoke.vl import write_smoke_vl_model

    model_dir = write_smoke_vl_model(tmp_path_factory.mktemp("vl") / "model")
    config = RolloutConfig(name="hf", dtype="float32", prompt_length=96, response_length=8, calculate_log_probs=True)
    model_config = OmegaConf.create({"path": str(model_dir), "trust_remote_code": True})
    return rollout_hf.HFRolloutServer(config=config, model_config=model_config, replica_rank=0)


def _image_prompt(srv, size, seed):
    """An image prompt as verl's agent loop builds it: the processor renders and expands the placeholders."""
    import numpy as np
    from PIL import Image

    from verl_prefix.tools.smoke.vl import synthetic_image

    image = Image.open(__import__("io").BytesIO(synthetic_image(*size, np.random.default_rng(seed)))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t9 t10 t11"}]}]
    text = srv.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = srv.processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    return ids, image


@pytest.fixture(params=["as_loaded", "after_verl_patch"])
def vl_patch_state(request, vl_server):
    """The server's model as loaded, and after verl's ``apply_monkey_patch`` replaced its classes' forwards
    class-wide (what a stock engine loading the same family in this process does); HF's are back after."""
    from verl_prefix.schedule.models.hf_forwards import VISUAL_PATCHED_CLASSES, class_forwards, patched_by_verl

    with class_forwards([(cls, cls.forward) for cls in VISUAL_PATCHED_CLASSES]):
        if request.param == "after_verl_patch":
            from verl.models.transformers.monkey_patch import apply_monkey_patch

            apply_monkey_patch(vl_server.model, use_remove_padding=True)
            assert patched_by_verl(type(vl_server.model))
        yield vl_server


def test_vl_generates_from_image_prompts_with_the_actors_log_probs(vl_patch_state):
    from verl_prefix.harness.vl import IMAGE_PAD, vl_positions
    from verl_prefix.schedule.models.hf_forwards import hf_own_forwards

    srv = vl_patch_state
    ids, image = _image_prompt(srv, (112, 168), seed=0)
    assert ids.count(IMAGE_PAD) == 24  # 8 x 12 patches merged 2 x 2
    visual = srv.image_inputs(ids, [image])
    out = srv._generate(ids, {"logprobs": True, "temperature": 0.8, "ignore_eos": True}, 3, visual)
    assert len(out.token_ids) == 8 == len(out.log_probs)
    # the smoke model never samples Qwen's vision tokens (verl would read one in a response as a placeholder)
    assert srv.model.generation_config.suppress_tokens == [124, 125, 126, 127]
    # the log-probs are the actor's recompute: a forward over prompt + response with the image, at the
    # [4, L] positions verl's get_rope_index gives the row (text, then temporal/height/width after the image)
    full = torch.tensor([ids + out.token_ids])
    positions = vl_positions(full[0], {"image_grid_thw": visual["image_grid_thw"]})[:, None]
    pixels = {k: visual[k] for k in ("pixel_values", "image_grid_thw")}

    def log_probs(**inputs):  # HF's forward, whatever verl patched in this process
        with torch.no_grad(), hf_own_forwards(srv.model):
            logits = srv.model(input_ids=full, **inputs).logits[0, len(ids) - 1 : -1] / 0.8
        return logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]

    want = log_probs(position_ids=positions, **pixels)
    torch.testing.assert_close(torch.tensor(out.log_probs), want, rtol=1e-5, atol=1e-5)
    # negative control: without the token types transformers runs the image at text positions
    assert (log_probs(**pixels) - want).abs().max() > 1e-4
    # the image reaches the model: another image of the same size changes the distribution
    other = srv.image_inputs(ids, [_image_prompt(srv, (112, 168), seed=1)[1]])
    moved = log_probs(position_ids=positions, **{k: other[k] for k in ("pixel_values", "image_grid_thw")})
    assert (moved - want).abs().max() > 1e-4
    # seeds: the same prompt and image have the same seed key; another image another one
    assert srv.prompt_digest(ids, visual) == srv.prompt_digest(ids, srv.image_inputs(ids, [image]))
    assert srv.prompt_digest(ids, visual) != srv.prompt_digest(ids, other) != srv.prompt_digest(ids)
    # placeholders that do not match the images, and videos, are refused
    with pytest.raises(ValueError, match="image tokens"):
        srv.image_inputs(ids[:-30] + ids[-5:], [image])
    with pytest.raises(NotImplementedError, match="video"):
        asyncio.run(srv.generate("r", ids, {}, video_data=[image]))


def test_generation_refuses_a_verl_forward_it_cannot_undo(vl_server, monkeypatch):
    """A class verl patched before HF's forward was remembered: generation raises, naming the class, rather
    than running verl's training forward under a generation cache."""
    from verl.models.transformers.qwen2_vl import forward_with_normal_backend

    unremembered = type("UnrememberedVL", (type(vl_server.model),), {"forward": forward_with_normal_backend})
    monkeypatch.setattr(vl_server.model, "__class__", unremembered)
    with pytest.raises(RuntimeError, match="UnrememberedVL"):
        vl_server._generate(PROMPT, {"temperature": 0.0}, 0)


def test_text_model_refuses_images(server):
    srv, _ = server
    with pytest.raises(NotImplementedError, match="vision-language"):
        srv.image_inputs(PROMPT, ["an image"])


def test_eager_actor_gets_an_eager_rollout_with_its_sinks_and_windows(tmp_path):
    """GPT-OSS has no sdpa in transformers; with the actor's ``attn_implementation=eager`` the server generates
    eagerly, its log-probs the actor's (attention sinks and the 16-token window applied) past the window."""
    from verl.workers.config import RolloutConfig

    assert rollout_hf.rollout_attention({"attn_implementation": "eager"}) == "eager"
    assert rollout_hf.rollout_attention({"attn_implementation": "flash_attention_2"}) == "sdpa"
    assert rollout_hf.rollout_attention({}) == "sdpa"
    model_dir = tiny_models.write_tiny_model(tmp_path / "gpt_oss", "gpt_oss")
    config = RolloutConfig(name="hf", dtype="float32", prompt_length=32, response_length=12, calculate_log_probs=True)
    model_config = OmegaConf.create(
        {"path": str(model_dir), "trust_remote_code": False, "override_config": {"attn_implementation": "eager"}}
    )
    srv = rollout_hf.HFRolloutServer(config=config, model_config=model_config, replica_rank=0)
    assert srv.model.config._attn_implementation == "eager"
    prompt = [2] + list(range(10, 39))  # 30 tokens: past the window
    out = srv._generate(prompt, {"logprobs": True, "temperature": 1.0}, 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    want = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.log_probs), want, rtol=1e-5, atol=1e-5)
