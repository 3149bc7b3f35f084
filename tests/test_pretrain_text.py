"""Text-only pretraining of the tiny decoder on the bigram-backcopy language (analysis/training/pretrain_text.py)."""
import json

import numpy as np
import pytest
import torch
from transformers import LlavaForConditionalGeneration

from analysis.training.pretrain_text import (BigramBackcopy, PretrainSettings, first_token_readings, learning_rate, lm_loss,
                                   pretrain, table, uniform_share)
from analysis.training.pretrain_text import main as pretrain_main
from analysis.training.tiny_vlm import build_config, build_processor, decoder_shape
from analysis.training.train_model import SMOKE_MODEL, main as train_main

WORDS = list(range(10, 40))


@pytest.fixture(scope="module")
def language():
    return BigramBackcopy.make(WORDS, n_triggers=3, support=4, seed=1)


def test_the_language_copies_after_triggers_and_follows_its_table_elsewhere(language):
    ids = language.sample(np.random.default_rng(0), 8, 64, first=None)
    assert ids.shape == (8, 64)
    assert not np.isin(ids[:, :2], language.triggers).any()  # sequences open on plain words
    index = {int(w): i for i, w in enumerate(language.words)}
    copies = 0
    for row in ids:
        for i in range(1, 63):
            if row[i] in language.triggers:
                assert row[i + 1] == row[i - 1]
                copies += 1
            else:
                assert language.table[index[int(row[i])], index[int(row[i + 1])]] > 0
    assert copies > 0
    assert (language.sample(np.random.default_rng(0), 2, 8, first=1)[:, 0] == 1).all()
    np.testing.assert_allclose(language.table.sum(1), 1.0)
    assert ((language.table > 0).sum(1) == 4).all()


def test_entropy_floor_counts_the_opening_word_and_the_bigram_positions_but_not_the_copies():
    table = np.full((3, 3), 0.25)
    table[:, 0] = 0.5  # after any word: 5 with 1/2, 6 and 7 with 1/4
    language = BigramBackcopy(np.array([5, 6, 7]), np.array([7]), table)
    ids = np.array([[1, 5, 7, 5, 6]])  # predicted: 5 (1 of 2 plain words), 7 (after 5), 5 (a copy), 6 (after 5)
    assert language.entropy_floor(ids) == pytest.approx((np.log(2) + np.log(4) + 0 + np.log(4)) / 4)
    drawn = language.sample(np.random.default_rng(0), 512, 40, first=1)
    row_entropy = -(table[0] * np.log(table[0])).sum()
    share = np.isin(drawn[:, 1:-1], language.triggers).mean()
    expected = (np.log(2) + 38 * (1 - share) * row_entropy) / 39  # every row alike: the floor's expectation
    assert language.entropy_floor(drawn) == pytest.approx(expected, abs=0.02)


def test_pretraining_lowers_the_loss_and_saves_a_llava_stage_two_can_start_from(tmp_path):
    torch.set_num_threads(1)
    settings = PretrainSettings(batch=4, length=24, lr=3e-3, warmup=1, check_every=15, minutes=5)
    model = pretrain(tmp_path / "bb", settings, None, SMOKE_MODEL, max_steps=30)
    records = [json.loads(line) for line in (tmp_path / "bb" / "sink.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [15, 30]
    printed = table(tmp_path / "bb" / "sink.jsonl").splitlines()
    assert printed[0] == f"uniform attention reads {uniform_share(24):.3f} on position 0"
    assert [row.split(" | ")[0] for row in printed[3:]] == ["| 15", "| 30"]
    assert f"| {records[-1]['probe_loss'] - records[-1]['floor']:.3f} |" in printed[-1]  # the same floor
    busiest = max(records[-1]["layers"], key=lambda x: x["max_head"])
    h = busiest["first"].index(busiest["max_head"])
    assert f"| {busiest['entropy'][h]:.2f} / {busiest['value_ratio'][h]:.2f} |" in printed[-1]
    assert records[-1]["probe_loss"] < np.log(len(model.get_input_embeddings().weight)) - 0.3
    assert len(records[-1]["layers"]) == SMOKE_MODEL["text_layers"]
    reloaded = LlavaForConditionalGeneration.from_pretrained(tmp_path / "bb")
    ids = torch.randint(10, 40, (1, 12))
    torch.testing.assert_close(lm_loss(reloaded.eval(), ids), lm_loss(model.eval(), ids))
    # stage 2 continues from it by name (--init-from): the pretrained decoder's layers arrive unchanged
    trained = train_main(["--smoke", "--init-from", str(tmp_path / "bb"), "--stage1-minutes", "0",
                          "--layout", "image-question", "--out", str(tmp_path / "vlm")])
    assert trained.config.text_config.num_hidden_layers == SMOKE_MODEL["text_layers"]


def test_first_token_readings_match_uniform_attention_exactly():
    """With every query zeroed each row attends uniformly over its prefix: row t puts 1/(t+1) on position 0."""
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(build_config(build_processor("image-question"), **SMOKE_MODEL)).eval()
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.zero_()
    ids = torch.randint(10, 40, (2, 20))
    ids[:, 10] = 12  # a trigger row is left out of the mean
    readings = first_token_readings(model, ids, np.array([12]), skip=4)
    rows = [t for t in range(4, 20) if t != 10]
    expected = float(np.mean([1 / (t + 1) for t in rows]))
    assert uniform_share(20, skip=4) == pytest.approx(np.mean([1 / (t + 1) for t in range(4, 20)]))
    assert len(readings) == SMOKE_MODEL["text_layers"]
    for r in readings:
        assert r["max_head"] == pytest.approx(expected, abs=1e-3)
        assert r["mean_head"] == pytest.approx(expected, abs=1e-3)
        assert r["first"] == pytest.approx([expected] * SMOKE_MODEL["text_heads"], abs=1e-3)
        assert r["norm_ratio"] > 0
        assert len(r["value_ratio"]) == SMOKE_MODEL["text_heads"] and min(r["value_ratio"]) > 0
        assert r["entropy"] == pytest.approx([1.0] * SMOKE_MODEL["text_heads"], abs=1e-3)  # spread evenly
        assert r["copy"] == pytest.approx([1 / 11] * SMOKE_MODEL["text_heads"], abs=1e-3)  # trigger row 10: 1/11 each


def test_a_head_that_parks_on_position_0_reads_low_entropy_and_one_that_copies_reads_copy():
    """Build the attention by hand through the reading's own arithmetic: one head puts everything on position 0
    at every row, the other everything on the word before; readings must tell them apart."""
    model = LlavaForConditionalGeneration(build_config(build_processor("image-question"), **SMOKE_MODEL)).eval()
    length = 16
    parked = torch.zeros(length, length)
    parked[:, 0] = 1.0
    previous = torch.zeros(length, length)
    previous[0, 0] = 1.0
    previous[torch.arange(1, length), torch.arange(length - 1)] = 1.0
    attn = torch.stack([parked, previous])[None]  # [1, 2, T, T]

    class Out:
        attentions = (attn,)
        hidden_states = (torch.ones(1, length, SMOKE_MODEL["text_hidden"]),)  # every position alike

    ids = torch.randint(10, 40, (1, length))
    ids[0, 12] = 12
    model.model.language_model.forward = lambda **_: Out()
    (r,) = first_token_readings(model, ids, np.array([12]), skip=4)
    assert r["first"] == [1.0, 0.0]
    assert r["entropy"] == [0.0, 0.0]
    assert r["copy"] == [0.0, 1.0]
    assert r["value_ratio"] == pytest.approx([1.0] * SMOKE_MODEL["text_heads"])  # equal inputs, equal values


def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    """10 steps, stop, resume to 20: the same weights as 20 steps in one go (optimizer, step and data stream kept)."""
    torch.set_num_threads(1)
    settings = PretrainSettings(batch=2, length=12, lr=3e-3, warmup=4, check_every=5, minutes=5)
    straight = pretrain(tmp_path / "one", settings, None, SMOKE_MODEL, max_steps=20)
    pretrain(tmp_path / "two", settings, None, SMOKE_MODEL, max_steps=10)
    resumed = pretrain(tmp_path / "two", settings, None, SMOKE_MODEL, max_steps=20, resume=True)
    assert json.loads((tmp_path / "two" / "state.json").read_text())["step"] == 20
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    steps = [json.loads(line)["step"] for line in (tmp_path / "two" / "sink.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20]


def test_the_batched_sampler_draws_each_next_word_with_its_table_probability(language):
    ids = language.sample(np.random.default_rng(3), 512, 64, first=None)
    index = {int(w): i for i, w in enumerate(language.words)}
    counts = np.zeros_like(language.table)
    for a, b in zip(ids[:, 1:-1].ravel(), ids[:, 2:].ravel()):
        if a not in language.triggers:
            counts[index[int(a)], index[int(b)]] += 1
    seen = counts.sum(1) > 1000  # rows seen often enough for a 0.05 tolerance (> 3 standard errors)
    assert seen.sum() >= 5
    frequencies = counts[seen] / counts[seen].sum(1, keepdims=True)
    np.testing.assert_allclose(frequencies, language.table[seen], atol=0.05)


def test_decoder_overrides_are_parsed_and_bad_ones_name_the_allowed_fields():
    assert decoder_shape(["text_layers=1", "text_heads=2"]) == {"text_layers": 1, "text_heads": 2}
    assert decoder_shape([]) == {}
    for bad in ("vision_layers=2", "text_heads", "text_heads=0", "text_heads=two"):
        with pytest.raises(ValueError, match="text_layers, text_heads, text_hidden, text_mlp"):
            decoder_shape([bad])


def test_the_cli_pretrains_the_decoder_shape_it_is_given_and_resume_keeps_it(tmp_path, capsys):
    """--resume keeps the shape and the language; the batch and the learning rate may change from then on, and
    every check logs the ones its last step ran with (the rate still warming up: 100 steps to the peak)."""
    torch.set_num_threads(1)
    out = tmp_path / "shallow"
    pretrain_main(["--out", str(out), "--decoder", "text_layers=1", "text_heads=2", "--batch", "2",
                   "--max-steps", "2", "--check-every", "1"])
    pretrain_main(["--out", str(out), "--resume", "--max-steps", "3", "--lr", "3e-4", "--batch", "3"])
    config = LlavaForConditionalGeneration.from_pretrained(out).config.text_config
    assert (config.num_hidden_layers, config.num_attention_heads) == (1, 2)
    saved = json.loads((out / "pretrain_settings.json").read_text())
    assert (saved["model"]["text_layers"], saved["lr"], saved["batch"], saved["length"]) == (1, 3e-4, 3, 128)
    records = [json.loads(line) for line in (out / "sink.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"], r["batch"], len(r["layers"])) for r in records] == [
        (1, 1e-5, 2, 1), (2, 2e-5, 2, 1), (3, 9e-6, 3, 1)]
    capsys.readouterr()  # the training's own progress lines
    pretrain_main(["--heads", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step 3; uniform attention reads")
    assert [row.split(" | ")[:2] for row in printed[3:]] == [["| 0", "0"], ["| 0", "1"]]  # one row per head
    with pytest.raises(SystemExit):
        pretrain_main(["--out", str(tmp_path / "bad"), "--decoder", "text_depth=1"])
    assert "text_layers, text_heads, text_hidden, text_mlp" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a run keeps its shape
        pretrain_main(["--out", str(out), "--resume", "--decoder", "text_layers=2"])
    assert "keeps the decoder shape it was started with" in capsys.readouterr().err


def test_the_learning_rate_warms_up_then_follows_a_half_cosine_to_its_end_and_stays():
    flat = PretrainSettings(lr=1e-3, warmup=10)
    assert [learning_rate(flat, step) for step in (0, 4, 9, 10**6)] == pytest.approx([1e-4, 5e-4, 1e-3, 1e-3])
    decay = PretrainSettings(lr=1e-3, warmup=10, decay_from=100, decay_steps=50, lr_end=1e-4)
    assert [learning_rate(decay, step) for step in (0, 99, 100, 125, 150, 10**6)] == pytest.approx(
        [1e-4, 1e-3, 1e-3, 5.5e-4, 1e-4, 1e-4])
    rates = [learning_rate(decay, step) for step in range(100, 151)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    early = PretrainSettings(lr=1e-3, warmup=10, decay_from=2, decay_steps=4, lr_end=0.0)
    assert [learning_rate(early, step) for step in range(7)] == pytest.approx(  # the ramp, capped by the cosine
        [1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 1.464e-4, 0.0], abs=1e-7)


def test_the_cli_decays_the_rate_from_the_step_it_resumes_at(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    pretrain_main(["--out", str(out), "--decoder", "text_layers=1", "text_heads=1", "--batch", "2", "--length", "16",
                   "--max-steps", "2", "--check-every", "1", "--lr", "1e-2"])
    pretrain_main(["--out", str(out), "--resume", "--max-steps", "6", "--decay-steps", "2", "--lr-end", "1e-4"])
    saved = json.loads((out / "pretrain_settings.json").read_text())
    assert (saved["decay_from"], saved["decay_steps"], saved["lr_end"]) == (2, 2, 1e-4)
    rates = [json.loads(line)["lr"] for line in (out / "sink.jsonl").read_text().splitlines()]
    # warming up over 100 steps to 1e-2; the cosine from step 2 (1e-2, 5.05e-3, then 1e-4 held) caps the ramp
    assert rates == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 1e-4, 1e-4])
    capsys.readouterr()
    for bad, message in ((["--decay-steps", "0"], "positive number of steps"),
                         (["--lr-end", "1e-4"], "--lr-end needs --decay-steps")):
        with pytest.raises(SystemExit):
            pretrain_main(["--out", str(out), "--resume", "--max-steps", "7"] + bad)
        assert message in capsys.readouterr().err
