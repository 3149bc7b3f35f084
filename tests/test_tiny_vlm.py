"""Tiny LLaVA: tokenizer/processor, packing, smoke training, the shipped model."""
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from analysis.evaluate import evaluate
from hap.runs.run import chat_prompt
from analysis.scenes import TRAIN_SEED_START, heldout_items, make_questions, make_scene
from analysis.training.tiny_vlm import build_config, build_processor

SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "tiny-llava"
NOT_LEARNED = ("relation", "letter")  # at chance in the shipped model (its card)


@pytest.fixture(scope="module")
def processor():
    return build_processor()


def tiny_model(processor) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    config = build_config(processor, text_layers=4, text_hidden=64, vision_hidden=32, vision_layers=1)
    return LlavaForConditionalGeneration(config).eval()


def test_chat_prompt_and_image_tokens(processor):
    prompt = chat_prompt(processor, "What color is the circle?")
    assert prompt == "USER: <image>\nWhat color is the circle? ASSISTANT:"
    inputs = processor(images=make_scene(0).image, text=prompt, return_tensors="pt")
    ids = inputs["input_ids"][0]
    tok = processor.tokenizer
    assert (ids == tok.image_token_id).sum() == 144
    assert inputs["pixel_values"].shape == (1, 3, 168, 168)
    words = tok.convert_ids_to_tokens(ids[ids != tok.image_token_id].tolist())
    assert words == ["<s>", "user", ":", "what", "color", "is", "the", "circle", "?", "assistant", ":"]


@pytest.mark.parametrize("layout, before, between", [("text-first", ["<s>", "user", ":"], []),
                                                     ("image-first", [], ["user", ":"]), ("image-question", [], [])])
def test_each_layout_places_the_image_and_the_question(layout, before, between):
    """The image-first layouts open with the image (its marker patch at position 0, no <s>); image-question puts
    no fixed text between the image and the question."""
    proc = build_processor(layout)
    ids = proc(images=make_scene(0).image, text=chat_prompt(proc, "what color is the circle ?"),
               return_tensors="pt")["input_ids"][0].tolist()
    first, last = ids.index(proc.tokenizer.image_token_id), len(ids) - 1 - ids[::-1].index(proc.tokenizer.image_token_id)
    words = proc.tokenizer.convert_ids_to_tokens(ids)
    assert words[:first] == before and last - first == 143
    assert words[last + 1:] == between + ["what", "color", "is", "the", "circle", "?", "assistant", ":"]
    with pytest.raises(ValueError, match="layout='sideways'; choose one of text-first"):
        build_processor("sideways")


def test_tokenizer_unknown_words_and_decoding(processor):
    tok = processor.tokenizer
    ids = tok("Is there a zebra?", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["is", "there", "a", "<unk>", "?"]
    answer = [tok.convert_tokens_to_ids("red"), tok.eos_token_id]
    assert processor.batch_decode([answer], skip_special_tokens=True) == ["red"]


def test_config_ids_and_small_sizes(processor):
    config = build_config(processor, text_layers=4, text_hidden=64, vision_hidden=32,
                          vision_layers=1, text_kv_heads=2)
    tok = processor.tokenizer
    assert config.image_token_index == tok.image_token_id < config.text_config.vocab_size
    assert config.image_seq_length == 144 and config.vision_feature_layer == -1
    assert config.text_config.num_key_value_heads == 2
    model = LlavaForConditionalGeneration(config)
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    default = build_config(processor)
    assert (default.text_config.num_hidden_layers, default.text_config.hidden_size) == (6, 128)


@pytest.mark.parametrize("followups", [0.0, 1.0])
def test_packing_matches_single_prompts(processor, followups):
    """Shared-prefix packed logits equal those of separate single-question prompts, and of two-turn
    conversations (the chat template over an earlier turn, then the question) for follow-up blocks."""
    import numpy as np

    from analysis.training.train_model import Packer, followup_histories

    model = tiny_model(processor)
    scenes = [make_scene(TRAIN_SEED_START + i) for i in range(2)]
    questions = [make_questions(s, s.seed, 3) for s in scenes]
    rng = np.random.default_rng(0)
    histories = [followup_histories(qs, followups, rng) for qs in questions]
    assert all(len(h) == (1 if followups else 0) for hs in histories for h in hs)
    batch = Packer(processor).batch(scenes, questions, histories)
    with torch.no_grad():
        hidden = model.model(input_ids=batch.input_ids, pixel_values=batch.pixel_values,
                             attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids).last_hidden_state
        packed = model.lm_head(hidden.reshape(-1, hidden.shape[-1])[batch.loss_rows])
        row = 0
        for scene, qs, hs in zip(scenes, questions, histories):
            for q, history in zip(qs, hs):
                assert all(h[0] != q.text or h[1] == q.answer for h in history)  # right answers only
                text = chat_prompt(processor, q.text, history) + " " + q.answer
                inputs = processor(images=scene.image, text=text, return_tensors="pt")
                single = model(**inputs).logits[0]
                assert batch.loss_targets[row] == inputs["input_ids"][0, -1]
                assert batch.loss_targets[row + 1] == processor.tokenizer.eos_token_id
                torch.testing.assert_close(packed[row], single[-2], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(packed[row + 1], single[-1], atol=1e-5, rtol=1e-4)
                row += 2


@pytest.mark.parametrize("layout", ["text-first", "image-first"])
def test_text_rows_predict_every_next_token_of_a_block(layout):
    """With ``text_rows`` every block token before the answer's predecessor predicts the next one at its
    own position: the targets, read back, spell the block (question and template words) after its first
    token; the answer and </s> rows are the same as without them."""
    from analysis.training.train_model import Packer, packed_loss

    processor = build_processor(layout)
    scenes = [make_scene(TRAIN_SEED_START + i) for i in range(2)]
    questions = [make_questions(s, s.seed, 2) for s in scenes]
    plain = Packer(processor).batch(scenes, questions)
    full = Packer(processor, text_rows=True).batch(scenes, questions)
    assert len(plain.text_rows) == 0
    assert torch.equal(plain.loss_rows, full.loss_rows) and torch.equal(plain.loss_targets, full.loss_targets)
    ids = full.input_ids.flatten()
    assert torch.equal(ids[full.text_rows + 1], full.text_targets)  # next token of the same block
    packer = Packer(processor)
    blocks = [packer.block(q.text) for qs in questions for q in qs]
    assert len(full.text_rows) == sum(len(b) - 1 for b in blocks)  # every block token but the last
    model = tiny_model(processor)
    with torch.no_grad():
        answer_only, _ = packed_loss(model, plain)
        same, _ = packed_loss(model, full, text_weight=0.0)
        with_text, _ = packed_loss(model, full, text_weight=1.0)
    assert same == answer_only and with_text > answer_only


def test_smoke_training_saves_and_reloads(tmp_path, capsys):
    from analysis.training.train_model import main

    with pytest.raises(SystemExit):
        main(["--smoke", "--out", str(tmp_path), "--decoder", "text_heads=many"])
    assert "FIELD=N with N >= 1 and FIELD one of text_layers, text_heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one GPU past the last this machine has
        main(["--smoke", "--out", str(tmp_path), "--device", f"cuda:{torch.cuda.device_count()}"])
    assert "this machine has" in capsys.readouterr().err
    model = main(["--smoke", "--out", str(tmp_path), "--decoder", "text_heads=4"]).eval()
    assert model.config.text_config.num_attention_heads == 4  # the override reaches the decoder
    processor = AutoProcessor.from_pretrained(tmp_path)
    reloaded = LlavaForConditionalGeneration.from_pretrained(tmp_path).eval()
    inputs = processor(images=make_scene(3).image, text=chat_prompt(processor, "is there a red circle ?"),
                       return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reloaded(**inputs).logits, atol=0, rtol=0)
    assert (tmp_path / "model.safetensors").stat().st_size < 25e6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_smoke_training_on_a_gpu_resumes_on_the_cpu(tmp_path):
    """Both stages on cuda (scenes drawn on the CPU, batches moved), then the checkpoint continues on the CPU."""
    from analysis.training.train_model import main

    run = tmp_path / "run"
    model = main(["--smoke", "--out", str(tmp_path / "out"), "--run-dir", str(run), "--device", "cuda"])
    assert model.device.type == "cuda" and (tmp_path / "out" / "config.json").exists()
    assert main(["--out", str(tmp_path / "out"), "--resume", str(run), "--stage2-minutes", "0.5"]).device.type == "cpu"


def test_resume_restores_state(tmp_path):
    from analysis.training.train_model import Trainer, smoke_settings

    trainer = Trainer(tmp_path / "out", tmp_path / "run", smoke_settings(), resume=False)
    trainer.stage1()  # ends with a checkpoint at the start of stage 2
    resumed = Trainer(tmp_path / "out", tmp_path / "run", smoke_settings(), resume=True)
    assert resumed.state == trainer.state and resumed.state.stage == 2
    for (name, a), b in zip(trainer.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_reads_the_runs_settings(tmp_path):
    """--resume RUN_DIR continues with the settings the run started with; a new stage budget extends it."""
    from analysis.training.train_model import Trainer, load_settings, smoke_settings

    settings = smoke_settings()
    settings.s2_relation_stage, settings.s2_kinds = 0.4, ("relation", "dot")
    Trainer(tmp_path / "out", tmp_path / "run", settings, resume=False)
    loaded = load_settings(tmp_path / "run" / "settings.json", None, 9.0)
    assert loaded.s2_kinds == ("relation", "dot") and loaded.s2_relation_stage == 0.4
    assert loaded.s2_minutes == 9.0 and loaded.s1_minutes == settings.s1_minutes
    Trainer(tmp_path / "out", tmp_path / "run", loaded, resume=True)  # the extended budget is recorded
    assert load_settings(tmp_path / "run" / "settings.json", None, None).s2_minutes == 9.0


def test_learning_rate_schedule_warms_up_then_decays_to_its_floor():
    """Linear warmup, then cosine over the time budget to the floor; a floor of 1 (--final-lr 1) is constant."""
    from analysis.training.train_model import lr_factor

    assert lr_factor(0, 0.0, warmup=10, budget_s=100.0, floor=0.05) == pytest.approx(0.1)
    assert lr_factor(50, 50.0, warmup=10, budget_s=100.0, floor=0.05) == pytest.approx(0.525)
    assert lr_factor(99, 100.0, warmup=10, budget_s=100.0, floor=0.05) == pytest.approx(0.05)
    assert [lr_factor(s, t, 10, 100.0, 1.0) for s, t in ((20, 0.0), (50, 60.0), (99, 250.0))] == [1.0, 1.0, 1.0]


def test_init_from_keeps_every_known_word(tmp_path, monkeypatch):
    """A donor with a smaller vocabulary: every weight and every word's embedding it knows carry over."""
    from analysis.training import tiny_vlm
    from analysis.training.train_model import Trainer, smoke_settings

    full = list(tiny_vlm.VOCAB)
    monkeypatch.setattr(tiny_vlm, "VOCAB", [w for w in full if w not in ("dot", "letter", "z")])
    old_processor = build_processor()
    torch.manual_seed(1)
    donor = LlavaForConditionalGeneration(build_config(old_processor, **smoke_settings().model))
    donor.save_pretrained(tmp_path / "donor")
    old_processor.save_pretrained(tmp_path / "donor")
    monkeypatch.setattr(tiny_vlm, "VOCAB", full)
    settings = smoke_settings()
    settings.init_from = str(tmp_path / "donor")
    trainer = Trainer(tmp_path / "out", tmp_path / "run", settings, resume=False)
    assert trainer.state.stage == 1  # stage 1 still teaches the tower this data's labels
    new, old = trainer.processor.tokenizer.get_vocab(), old_processor.tokenizer.get_vocab()
    rows, old_rows = trainer.model.get_input_embeddings().weight, donor.get_input_embeddings().weight
    assert len(new) == len(old) + 3
    for word, i in old.items():
        assert torch.equal(rows[new[word]], old_rows[i]), word
    tower, old_tower = trainer.model.model.vision_tower.state_dict(), donor.model.vision_tower.state_dict()
    assert all(torch.equal(tower[k], old_tower[k]) for k in tower)


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no shipped model")
def test_shipped_model_answers_heldout_questions():
    processor = AutoProcessor.from_pretrained(SHIPPED)
    model = LlavaForConditionalGeneration.from_pretrained(SHIPPED)
    items = list(heldout_items(range(700_000, 700_012), 9))
    for followup in (False, True):  # a first question, and the same asked as a conversation's second turn
        result = evaluate(model, processor, items, followup=followup)
        assert result["n"]["overall"] == 108
        learned = [k for k in result["n"] if k not in NOT_LEARNED + ("overall",)]
        hits = sum(result[k] * result["n"][k] for k in learned) / sum(result["n"][k] for k in learned)
        assert hits >= 0.9, (followup, result)  # the model card's held-out figures: 0.96-1.00 per learned kind


def test_projected_tokens_are_what_the_decoder_reads(processor):
    """The stage-2 patch loss sees the projector's output for every image: [B, 144, text hidden], the
    visual rows of the decoder's input embeddings; the hook is gone afterwards."""
    from analysis.training.train_model import PatchHead, patch_loss, projected_tokens

    model = tiny_model(processor)
    scenes = [make_scene(TRAIN_SEED_START + i) for i in range(2)]
    inputs = processor(images=[s.image for s in scenes], text=[chat_prompt(processor, "what color is the dot ?")] * 2,
                       return_tensors="pt")
    embeds = []
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _m, args, kwargs: embeds.append(kwargs["inputs_embeds"]), with_kwargs=True)
    with torch.no_grad(), projected_tokens(model) as projected:
        model(**inputs)
    hook.remove()
    assert len(projected) == 1 and projected[0].shape == (2, 144, model.config.text_config.hidden_size)
    visual = inputs["input_ids"] == model.config.image_token_id
    torch.testing.assert_close(embeds[0][visual].reshape(2, 144, -1), projected[0])
    assert not model.model.multi_modal_projector._forward_hooks
    head = PatchHead(model.config.text_config.hidden_size, position=True)
    assert patch_loss(head, projected[0], scenes).item() > 0
