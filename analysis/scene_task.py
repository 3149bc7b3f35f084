"""`hap_scenes`: the held-out synthetic scenes (`analysis.scenes`) as a local lmms-eval task, for running the field's
table offline on the shipped model (`analysis.paper_table --scenes A:B --per-scene K`).

`write_task(folder, seeds, per_scene)` writes `folder/hap_scenes/`: `docs.jsonl` (one document per question: the
scene's seed, the question text, its answer and kind), `hap_scenes.yaml` (the task lmms-eval reads through
`--include_path folder`) and `utils.py` (lmms-eval's `!function` hooks, which import the ones below). The image is
drawn again from its seed (`make_scene`, deterministic), so a document is a line of text.

Scoring is the benchmark's (`analysis.benchmark`): up to three greedy answer tokens, stripped, equal to the answer;
the per-question score is lmms-eval's `exact_match` (1.0 or 0.0) and the task's value its mean.
"""

from __future__ import annotations

import json
from pathlib import Path

from analysis.scenes import heldout_items, make_scene

TASK = "hap_scenes"
METRIC = "exact_match"
ANSWER_TOKENS = 3  # the benchmark's max_new_tokens: the small model answers in one word

YAML = """\
# Written by analysis.paper_table (analysis/scene_task.py): held-out scenes {seeds}, {per_scene} question(s) each.
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
process_results: !function utils.process_results
generation_kwargs:
  max_new_tokens: {tokens}
  temperature: 0
  do_sample: false
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

UTILS = '''"""lmms-eval's hooks of the {task} task (written by analysis.paper_table): those of analysis.scene_task."""
from analysis.scene_task import doc_to_text, doc_to_visual, process_results  # noqa: F401
'''


def documents(seeds: range, per_scene: int) -> list[dict]:
    """One document per held-out question of scenes `seeds` (`heldout_items`), in order."""
    return [{"seed": scene.seed, "question": q.text, "answer": q.answer, "kind": q.qtype}
            for scene, q in heldout_items(seeds, per_scene)]


def write_task(folder: str | Path, seeds: range, per_scene: int, root: Path | None = None) -> Path:
    """Write the `hap_scenes` task under `folder/hap_scenes/` (the folder to give lmms-eval's `--include_path` is
    `folder`); returns the task's folder. The task names its documents' file relative to `root` (the folder lmms-eval
    runs in) where it lies inside it, else by its absolute path. Rewriting the same seeds writes the same bytes."""
    if per_scene < 1:
        raise ValueError(f"--per-scene {per_scene}: at least one question per scene")
    if len(seeds) == 0:
        raise ValueError(f"--scenes {seeds.start}:{seeds.stop} holds no scene (A:B with A < B)")
    task = Path(folder).resolve() / TASK
    task.mkdir(parents=True, exist_ok=True)
    docs = task / "docs.jsonl"
    docs.write_text("".join(json.dumps(d) + "\n" for d in documents(seeds, per_scene)))
    (task / f"{TASK}.yaml").write_text(YAML.format(seeds=f"{seeds.start}:{seeds.stop}", per_scene=per_scene, task=TASK,
                                                   docs=json.dumps(str(within(docs, root))), tokens=ANSWER_TOKENS, metric=METRIC))
    (task / "utils.py").write_text(UTILS.format(task=TASK))
    return task


def within(path: Path, root: Path | None) -> Path:
    """`path` relative to `root` where it lies inside it, else `path`."""
    return path.relative_to(root) if root is not None and path.is_relative_to(root) else path


def doc_to_visual(doc: dict) -> list:
    """The scene's image, drawn from its seed."""
    return [make_scene(int(doc["seed"])).image.convert("RGB")]


def doc_to_text(doc: dict, lmms_eval_specific_kwargs: dict | None = None) -> str:
    """The question as the small model was trained on it (the chat template adds the image and the roles)."""
    return doc["question"]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """`exact_match`: 1.0 when the answer, stripped, is the document's answer (the benchmark's rule)."""
    return {METRIC: float(results[0].strip() == doc["answer"])}
