"""The lmms-eval plugin `llava_hf_hap` (hap/lmms_eval.py) on a tiny LLaVA saved to disk, offline.

The model is built through lmms-eval's own registry and `create_from_arg_string`, as its CLI does; the
requests are lmms-eval `Instance`s of a small in-memory task (`task_dict` is the evaluator's boundary:
no dataset download).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "lmms_eval.models.simple.llava_hf",
    reason="lmms-eval is not installed (bash .ci/install-eval installs it with the few packages it imports)",
)

from lmms_eval import models  # noqa: E402
from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.api.registry import MODEL_REGISTRY  # noqa: E402
from lmms_eval.models.registry_v2 import ModelRegistryV2  # noqa: E402

import hap  # noqa: E402
import hap.lmms_eval as plugin  # noqa: E402
from test_frontier_rules import clip_folder as small_clip  # noqa: E402, F401 (a fixture: a tiny CLIP folder)
from tiny_models import noise_image, tiny_llava  # noqa: E402

TASK, SPLIT = "tiny", "test"
DOCS = [{"question": q, "seed": s} for s, q in enumerate(["What is in the image?", "Is there a dog?", "Which color?"])]
GEN = {"max_new_tokens": 6, "until": ["\n\n"], "temperature": 0}
HAP_ARGS = "method=hap,retain=0.3,first_layers=1"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    model, processor = tiny_llava(layers=6)
    path = tmp_path_factory.mktemp("tiny_llava")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def build(name: str, pretrained: str, extra: str = "", force_simple: bool = True):
    """What `lmms_eval.evaluator.simple_evaluate` does with `--model NAME --model_args ... --device cpu`."""
    plugin.register()
    cls = models.get_model(name, force_simple=force_simple)
    args = f"pretrained={pretrained},dtype=float32" + (f",{extra}" if extra else "")
    if name == "llava_hf":  # stock LlavaHf hands its default device_map="" to from_pretrained: transformers 5 refuses
        args += ",device_map=cpu"
    lm = cls.create_from_arg_string(args, {"batch_size": 1, "device": "cpu"})
    lm.task_dict = {TASK: {SPLIT: DOCS}}
    return lm


def requests(chat: bool) -> list[Instance]:
    def visual(doc):
        return [noise_image(doc["seed"])]

    def messages(doc):
        return [{"role": "user", "content": [{"type": "image", "url": noise_image(doc["seed"])},
                                             {"type": "text", "text": doc["question"]}]}]

    out = []
    for i, doc in enumerate(DOCS):
        args = ((doc["question"], messages, dict(GEN), i, TASK, SPLIT) if chat
                else (doc["question"], dict(GEN), visual, i, TASK, SPLIT))
        out.append(Instance(request_type="generate_until", arguments=args, idx=0,
                            metadata={"task": TASK, "doc_id": i, "repeats": 1}))
    return out


def answers(lm, chat: bool = False) -> list[str]:
    return [getattr(a, "text", a) for a in lm.generate_until(requests(chat))]


def test_registered_and_resolved_like_llava_hf():
    plugin.register()
    assert models.get_model("llava_hf_hap") is plugin.LlavaHfHapChat  # chat first, as for llava_hf
    assert models.get_model("llava_hf_hap", force_simple=True) is plugin.LlavaHfHap
    assert MODEL_REGISTRY["llava_hf_hap"] is plugin.LlavaHfHap  # lmms-eval's register_model
    assert "llava_hf_hap" in models.list_available_models()


def test_entry_point_manifest(tmp_path, monkeypatch):
    """The pyproject entry point `llava_hf_hap = "hap.lmms_eval:manifest"` loads through lmms-eval's loader."""
    info = tmp_path / "hap_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hap-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text('[lmms_eval.models]\nllava_hf_hap = hap.lmms_eval:manifest\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = ModelRegistryV2()
    registry.load_entrypoint_manifests()
    assert registry.get_model_class("llava_hf_hap", force_simple=True) is plugin.LlavaHfHap
    assert registry.get_model_class("llava_hf_hap") is plugin.LlavaHfHapChat


def test_knobs_are_typed_and_validated():
    cfg = plugin.config_from_args({"method": "uniform", "retain": "0.1", "first_layers": "1", "groups": 2,
                                   "temperature": "inf", "seed": 3.0, "flops_ratio": "none"})
    assert (cfg.method, cfg.retain, cfg.first_layers, cfg.groups, cfg.seed) == ("uniform", 0.1, 1, 2, 3)
    assert cfg.temperature == float("inf") and cfg.flops_ratio is None
    with pytest.raises(ValueError, match="retain='abc' must be a number"):
        plugin.config_from_args({"retain": "abc"})
    with pytest.raises(ValueError, match="first_layers=1.5 must be an integer"):
        plugin.config_from_args({"first_layers": 1.5})
    with pytest.raises(ValueError, match="method='hop' is not allowed"):
        plugin.config_from_args({"method": "hop"})


def test_bad_knob_fails_before_loading(pretrained):
    with pytest.raises(ValueError, match=r"retain=2(\.0)? must be a number"):
        build("llava_hf_hap", "/nonexistent", "retain=2")
    # the 32-layer example of the docstring, scaled: 6 layers, first_layers=2 keep >= 2/6 of the tokens
    with pytest.raises(ValueError, match="retain=0.2 is unreachable"):
        build("llava_hf_hap", pretrained, "retain=0.2,first_layers=2")


def test_autoprune_refuses_a_batch_before_loading():
    plugin.register()
    cls = models.get_model("llava_hf_hap", force_simple=True)
    with pytest.raises(ValueError, match="autoprune prunes one prompt at a time.*--batch_size 1, not 2"):
        cls.create_from_arg_string("pretrained=/nonexistent,method=autoprune", {"batch_size": 2, "device": "cpu"})


def test_generate_until_prunes_and_none_is_stock(pretrained):
    stock = build("llava_hf", pretrained)
    assert type(stock).__name__ == "LlavaHf"
    expected_stock = answers(stock)

    none = build("llava_hf_hap", pretrained, "method=none")
    assert answers(none) == expected_stock
    assert none.model._hap.state is None  # the patch saw every prefill and left it alone

    pruned = build("llava_hf_hap", pretrained, HAP_ARGS)
    got = answers(pruned)
    assert len(got) == len(DOCS) and all(isinstance(a, str) and a for a in got)
    state = pruned.model._hap.state  # the last request's prefill
    # layer average (144 + 47 + 2 x 23 + 2 x 11) / 6 / 144 = 0.2998: the realised budget never exceeds retain=0.3
    assert state.schedule.cuts == [1, 2, 4] and state.schedule.kept == [47, 23, 11]
    assert (144 + 47 + 2 * 23 + 2 * 11) / 6 / 144 <= 0.3 < (144 + 47 + 2 * 23 + 2 * 12) / 6 / 144
    assert state.kept_orig.shape == (1, 11)  # 11 of 144 visual tokens reach the last layers
    # the same pruning as hap's own patch on the stock wrapper's model
    with hap.patched(stock.model, hap.HAPConfig(retain=0.3, first_layers=1)):
        assert answers(stock) == got


def test_pruned_cache_is_shorter(pretrained):
    lm = build("llava_hf_hap", pretrained, HAP_ARGS)
    seen = {}
    generate = lm.model.generate

    def spy(*args, **kwargs):
        out = generate(*args, return_dict_in_generate=True, **kwargs)
        seen["T"] = kwargs["input_ids"].shape[1]
        seen["cache"] = [out.past_key_values.get_seq_length(i) for i in range(6)]
        return out.sequences

    lm.model.generate = spy
    answers(lm)
    full, *rest = seen["cache"]
    assert full > seen["T"]  # layer 0 cached every prompt token and the decoded ones
    assert [full - n for n in rest] == [144 - k for k in (47, 23, 23, 11, 11)]  # later layers: the kept only


def test_chat_model_prunes(pretrained):
    stock = build("llava_hf", pretrained, force_simple=False)
    assert type(stock).__name__ == "LlavaHf" and not stock.is_simple
    expected = answers(stock, chat=True)
    assert answers(build("llava_hf_hap", pretrained, "method=none", force_simple=False), chat=True) == expected
    pruned = build("llava_hf_hap", pretrained, HAP_ARGS, force_simple=False)
    assert isinstance(pruned, plugin.LlavaHfHapChat)
    assert all(answers(pruned, chat=True)) and pruned.model._hap.state.kept_orig.shape == (1, 11)


def test_loglikelihood_refused_when_pruning(pretrained):
    request = Instance(request_type="loglikelihood", arguments=("Is it red?", "no", lambda d: [noise_image(0)], 0,
                                                                TASK, SPLIT), idx=0,
                       metadata={"task": TASK, "doc_id": 0, "repeats": 1})
    with pytest.raises(NotImplementedError, match="loglikelihood"):
        build("llava_hf_hap", pretrained, HAP_ARGS).loglikelihood([request])
    # (method=none hands over to the stock LlavaHf.loglikelihood, which in lmms-eval 0.7.3 fails under
    # transformers 5 anyway: it tokenizes the "<image>" context without its image)


def test_generation_errors_are_raised_not_scored_empty(pretrained, monkeypatch):
    lm = build("llava_hf_hap", pretrained, HAP_ARGS)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(lm.model.model.language_model.layers[2], "forward", broken)
    with pytest.raises(plugin.GenerationFailed, match="boom"):
        lm.generate_until(requests(chat=False))
    assert len(calls) == 1  # the later requests failed fast


TASK_YAML = """task: hap_tiny_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_messages: !function utils.doc_to_messages
doc_to_target: answer
generation_kwargs:
  max_new_tokens: {max_new_tokens}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASK_UTILS = '''import numpy as np
from PIL import Image


def _image(doc):
    return Image.fromarray(np.random.RandomState(doc["seed"]).randint(0, 255, (168, 168, 3), dtype=np.uint8))


def doc_to_visual(doc):
    return [_image(doc)]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]


def doc_to_messages(doc, lmms_eval_specific_kwargs=None):
    return [{"role": "user", "content": [{"type": "image", "url": _image(doc)}, {"type": "text", "text": doc["question"]}]}]
'''


def _cli_importable() -> bool:
    """Whether the CLI's extra imports are there, without importing it (lmms_eval.api.task sets PIL's
    LOAD_TRUNCATED_IMAGES for the whole process)."""
    from importlib.util import find_spec

    return all(find_spec(m) for m in ("sacrebleu", "pytablewriter", "aiohttp", "lxml", "tenacity")) and bool(
        find_spec("filelock._api"))


@pytest.mark.slow
@pytest.mark.skipif(not _cli_importable(), reason="lmms-eval's CLI imports more (bash .ci/install-eval --cli)")
def test_cli_runs_a_local_task(pretrained, tmp_path):
    """The documented command, `python -m hap.lmms_eval --model llava_hf_hap ...`, on a local 2-doc task."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    task = tmp_path / "task"
    task.mkdir()
    data = task / "data.jsonl"
    data.write_text("".join(json.dumps({**doc, "answer": "no"}) + "\n" for doc in DOCS[:2]))
    (task / "hap_tiny_task.yaml").write_text(TASK_YAML.format(data=data, max_new_tokens=GEN["max_new_tokens"]))
    (task / "utils.py").write_text(TASK_UTILS)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hap.lmms_eval", "--model", "llava_hf_hap",
           "--model_args", f"pretrained={pretrained},dtype=float32,{HAP_ARGS}", "--tasks", "hap_tiny_task",
           "--include_path", str(task), "--device", "cpu", "--batch_size", "1",
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "hap_tiny_task" in proc.stdout and "exact_match" in proc.stdout
    samples = [json.loads(line) for f in out.rglob("*samples_hap_tiny_task.jsonl") for line in f.read_text().splitlines()]
    assert len(samples) == 2
    # the chat model (lmms-eval's default for llava_hf*) with the same pruning, in this process
    pruned = build("llava_hf_hap", pretrained, HAP_ARGS, force_simple=False)
    expected = answers(pruned, chat=True)[:2]
    assert [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])] == expected


def test_cdpruner_loads_its_clip_and_reads_each_requests_question(pretrained, small_clip, tmp_path, monkeypatch):
    from test_frontier_pruners import save_clip

    clip = save_clip(tmp_path / "clip", small_clip)
    lm = build("llava_hf_hap", pretrained, f"method=cdpruner,retain=0.3,clip_model={clip}")
    assert lm.hap_patch.clip is not None  # loaded with the model, from the folder
    asked, ask = [], lm.hap_patch.ask
    monkeypatch.setattr(lm.hap_patch, "ask", lambda question: asked.append(question) or ask(question))
    got = answers(lm)
    assert asked == [doc["question"] for doc in DOCS] and all(isinstance(a, str) for a in got)
    assert lm.model._hap.state.cuts[0].layer == 0 and lm.model._hap.state.question is not None


def test_timings_write_one_prefill_per_request(pretrained, tmp_path):
    """`timings=PATH`: a JSON line per request with its prefill time and the FLOPs ratio its schedule achieved (what
    `analysis.paper_table` reads); 1.0 unpruned."""
    path = tmp_path / "t.jsonl"
    lm = build("llava_hf_hap", pretrained, f"{HAP_ARGS},timings={path}")
    answers(lm)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    state = lm.model._hap.state
    assert len(records) == len(DOCS) and all(r["prefill_s"] > 0 and r["peak_bytes"] is None for r in records)
    last = records[-1]
    assert last["retained_tokens"] == pytest.approx((144 + 47 + 2 * 23 + 2 * 11) / 6) and last["num_visual"] == 144
    assert last["flops_ratio"] == pytest.approx(
        state.schedule.flops_ratio(state.prompt_len - 144, plugin.decoder_shape(lm.model))) and last["flops_ratio"] < 0.5
    none = tmp_path / "none.jsonl"
    answers(build("llava_hf_hap", pretrained, f"method=none,timings={none}"))
    assert [json.loads(line)["flops_ratio"] for line in none.read_text().splitlines()] == [1.0] * len(DOCS)


def test_timings_files_per_process():
    one, four = SimpleNamespace(num_processes=1, process_index=0), SimpleNamespace(num_processes=4, process_index=2)
    assert plugin._rank_file("cell/timings.jsonl", one) == Path("cell/timings.jsonl")
    assert plugin._rank_file("cell/timings.jsonl", four) == Path("cell/timings.rank2.jsonl")
