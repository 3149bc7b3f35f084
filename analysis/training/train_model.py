"""Train the tiny LLaVA on synthetic scenes (two-stage recipe; CPU with one thread, or ``--device cuda``).

    python -m analysis.training.train_model --out assets/tiny-llava --run-dir runs/v3 [options]   # a new run
    python -m analysis.training.train_model --out assets/tiny-llava --resume runs/v3               # continue it
    python -m analysis.training.train_model --smoke                                                # < 60 s check

Stage 1: dense per-patch supervision of the CLIP tower. A linear head on the last hidden
state (CLS dropped) predicts each patch's colour (5 + background) and shape (3 + background),
and with ``--position-targets`` its row and column (to keep the patch's place linearly readable
for relational questions); a patch is labelled with the object covering most of it if that
covers > 30%. Early stop when per-object accuracy (majority vote over the object's labelled
patches) reaches the targets.

Stage 2: answer-only training of the whole ``LlavaForConditionalGeneration`` with
shared-prefix packing: one sequence = ``<s> user : <image>x144`` followed by K question
blocks ``<question> assistant : <answer>``; a 4D mask lets each block see only the prefix and
itself, and each block gets the position ids of a single-question prompt. The loss is on the
answer word (predicted from the last prompt token) and on ``</s>`` (predicted from the answer);
with ``--text-loss W`` also, at weight W, on every other text token of a block (the question and
the template words), as a language model is trained.
Curriculum: first part of the time on 2-object scenes. Question kinds are drawn in the
proportions of ``Settings.s2_kinds`` (balanced; ``--relation-weight 2`` asks relations twice as often). The vision tower is frozen first, then
trained at 0.1x lr. Time-based warmup + cosine schedule for each stage.

Training seeds start at ``scenes.TRAIN_SEED_START``; held-out evaluation uses seeds below it.
Checkpoints (model safetensors, head, optimizer, ``state.json``, and the run's ``settings.json``) go to
``--run-dir``; ``--resume RUN_DIR`` continues from the last one with the saved settings (a new
``--stage1-minutes`` / ``--stage2-minutes`` may extend a stage's budget). A run may continue on another
device than the one it started on: the scenes are drawn on the CPU, everything else runs on ``--device``.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor
from transformers.utils import logging as hf_logging

from analysis.evaluate import evaluate
from hap.runs.run import chat_prompt
from analysis.training.diagnostics import diagnose
from analysis.scenes import (AUX_KINDS, COLORS, GRID, LETTERS, MIN_OBJECTS, N_PATCHES, QTYPES, SHAPES,
                             TRAIN_SEED_START, Question, Scene, heldout_items, make_questions, make_scene)
from analysis.training.tiny_vlm import LAYOUTS, build_config, build_processor, decoder_shape
from hap.hub import resolve_device

STAGE1_EVAL_START = 900_000  # held-out scenes for the stage-1 probe start here
STAGE2_EVAL_START = 0  # held-out scenes for periodic stage-2 evaluation start here
DIAG_START = 300_000  # held-out scenes of the fixed diagnostics batch start here


@dataclass
class Settings:
    """Hyper-parameters; ``--smoke`` swaps in a tiny configuration."""

    model: dict
    s1_batch: int = 32
    s1_lr: float = 2e-3
    s1_warmup: int = 50
    s1_minutes: float = 16.0
    s1_min_steps: int = 800  # earliest step for the early-stop check
    s1_check_every: int = 200
    s1_target_color: float = 0.98
    s1_target_shape: float = 0.97
    s1_target_fine: float = 0.97  # letter and dot, per object / per scene
    s2_images: int = 16
    s2_questions: int = 16
    s2_lr: float = 1.5e-3
    s2_warmup: int = 60
    s2_minutes: float = 65.0
    s2_final_lr: float = 0.05  # cosine floor, fraction of the peak
    s2_curriculum: float = 0.15  # fraction of stage-2 time on 2-object scenes
    s2_frozen: float = 0.30  # fraction of stage-2 time with the vision tower frozen
    s2_vision_lr: float = 0.1  # vision lr multiplier once unfrozen
    s2_target: float = 0.99  # early stop when every type reaches this
    s2_kinds: tuple[str, ...] = QTYPES + AUX_KINDS  # a kind listed twice is asked twice as often
    s2_relation_stage: float = 0.0  # fraction of stage-2 time on two-object scenes, relation and position only
    s2_followups: float = 0.25  # fraction of question blocks asked as the second turn of a conversation
    s2_patch_weight: float = 0.0  # weight of the per-patch labels predicted from the projector's output
    s2_text_weight: float = 0.0  # weight of the next-token loss on every text token of a block (0: answer only)
    s2_letter_stage: float = 0.0  # fraction of stage-2 time on one-object scenes, letter and position only
    s1_position: bool = False  # stage 1 also predicts each patch's row and column
    layout: str = "text-first"  # the prompt layout (analysis.training.tiny_vlm.LAYOUTS)
    vision_from: str | None = None  # a saved LLaVA whose vision tower replaces stage 1
    init_from: str | None = None  # a saved LLaVA whose whole weights stage 2 continues from
    s2_weight_decay: float = 0.3  # on the matrices (sinks grow with weight decay, head-heterogeneity note)
    s1_probe_scenes: int = 128
    s1_max_steps: int | None = None
    s2_max_steps: int | None = None
    eval_minutes: float = 8.0
    eval_scenes: int = 100
    eval_per_scene: int = 9
    diag_per_kind: int = 10
    ckpt_minutes: float = 3.0
    log_every: int = 20


FULL_MODEL = dict(text_layers=6, text_heads=8, text_hidden=128, text_mlp=384,
                  vision_hidden=128, vision_layers=3, vision_heads=4)
SMOKE_MODEL = dict(text_layers=2, text_heads=2, text_hidden=32, text_mlp=64,
                   vision_hidden=32, vision_layers=1, vision_heads=2)


def load_settings(path: Path, s1_minutes: float | None, s2_minutes: float | None) -> Settings:
    """A run's saved settings; a stage's time budget may be given anew (to extend it)."""
    saved = json.loads(path.read_text())
    saved["s2_kinds"] = tuple(saved["s2_kinds"])
    settings = Settings(**saved)
    settings.s1_minutes = settings.s1_minutes if s1_minutes is None else s1_minutes
    settings.s2_minutes = settings.s2_minutes if s2_minutes is None else s2_minutes
    return settings


def smoke_settings() -> Settings:
    return Settings(model=SMOKE_MODEL, s1_batch=4, s1_warmup=2, s1_minutes=0.2, s1_min_steps=2,
                    s1_check_every=2, s1_max_steps=6, s2_images=2, s2_questions=4, s2_warmup=2,
                    s2_minutes=0.3, s2_max_steps=8, s1_probe_scenes=4, eval_minutes=0.0,
                    eval_scenes=4, ckpt_minutes=0.0, log_every=2, diag_per_kind=1)


@dataclass
class State:
    """Resumable progress; ``elapsed`` is training time (s) in the current stage."""

    stage: int = 1
    step: int = 0
    elapsed: float = 0.0
    next_seed: int = TRAIN_SEED_START
    last_eval: float = 0.0
    best: float = -1.0  # best min-over-types held-out accuracy in stage 2


def half_cosine(progress: float, start: float, end: float) -> float:
    """The value a half cosine from ``start`` (progress 0) to ``end`` (progress 1) has at ``progress``; held at
    ``end`` past 1."""
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_factor(step: int, elapsed: float, warmup: int, budget_s: float, floor: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine over the time budget down to ``floor``."""
    return min(1.0, (step + 1) / warmup) * half_cosine(elapsed / budget_s, 1.0, floor)


def pixel_values(processor: LlavaProcessor, scenes: list[Scene]) -> torch.Tensor:
    """Float [B, 3, 168, 168] as the processor would produce them."""
    return processor.image_processor([s.image for s in scenes], return_tensors="pt")["pixel_values"]


RELATION_STAGE_KINDS = ("relation", "position")
LETTER_STAGE_KINDS = ("letter", "position")


def followup_histories(questions: list[Question], share: float, rng: np.random.Generator) -> list[tuple]:
    """For each question about one image: no earlier turn, or (with probability ``share``) one earlier
    turn, another question about the same image with its right answer."""
    out = []
    for j, _ in enumerate(questions):
        others = [q for i, q in enumerate(questions) if i != j]
        if others and rng.random() < share:
            prev = others[int(rng.integers(len(others)))]
            out.append(((prev.text, prev.answer),))
        else:
            out.append(())
    return out


def next_scenes(state: State, n: int, max_objects: int | None = None,
                n_objects: int | None = None) -> list[Scene]:
    """The next ``n`` training scenes (seed stream in ``state``), optionally size-filtered, or all
    with ``n_objects`` objects."""
    out: list[Scene] = []
    while len(out) < n:
        scene = make_scene(state.next_seed, n_objects)
        state.next_seed += 1
        if max_objects is None or len(scene.objects) <= max_objects:
            out.append(scene)
    return out


# ----------------------------------------------------------------------------- stage 1

def diagnostic_items(per_kind: int, start: int = DIAG_START) -> list[tuple[Scene, Question]]:
    """A fixed, kind-balanced list of held-out (scene, question) pairs for the diagnostics."""
    items, seed = [], start
    wanted = {kind: per_kind for kind in QTYPES}
    while any(wanted.values()):
        scene = make_scene(seed)
        for q in make_questions(scene, seed):
            if wanted[q.qtype]:
                wanted[q.qtype] -= 1
                items.append((scene, q))
        seed += 1
    return items


class PatchHead(torch.nn.Module):
    """Linear per-patch classifier: hidden -> colour [6], shape [4], letter [6], dot colour [6] (and
    with ``position`` row [12], column [12]) logits; index 0 of each = none / background."""

    def __init__(self, hidden: int, position: bool = False):
        super().__init__()
        self.sizes = ((1 + len(COLORS), 1 + len(SHAPES), 1 + len(LETTERS), 1 + len(COLORS))
                      + ((GRID, GRID) if position else ()))
        self.proj = torch.nn.Linear(hidden, sum(self.sizes))

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """feats [B, 144, D] -> (colour [B, 144, 6], shape [B, 144, 4], letter [B, 144, 6],
        dot [B, 144, 6][, row [B, 144, 12], column [B, 144, 12]]) logits."""
        return tuple(self.proj(feats).split(self.sizes, dim=-1))


def patch_features(model: LlavaForConditionalGeneration, pixels: torch.Tensor) -> torch.Tensor:
    """Last vision layer's hidden states without CLS: [B, 144, D] (what LLaVA projects)."""
    return model.model.vision_tower(pixels).last_hidden_state[:, 1:]


def patch_labels(scenes: list[Scene]) -> tuple[torch.Tensor, ...]:
    """(colour, shape, letter, dot colour, row, column) ids, each [B, 144]; 0 = background / none
    for the first four."""
    labels = [s.patch_labels() + s.fine_labels() for s in scenes]
    place = torch.arange(N_PATCHES).expand(len(scenes), N_PATCHES)
    return (*(torch.from_numpy(np.stack(column)) for column in zip(*labels)), place // GRID, place % GRID)


@torch.no_grad()
def probe_objects(model, head: PatchHead, processor, seeds: range) -> dict[str, float]:
    """Per-object colour/shape accuracy (majority vote over its labelled patches), per-object letter
    accuracy (on its letter patch), per-scene dot colour accuracy (on its dot patch), bg accuracy."""
    scenes = [make_scene(s) for s in seeds]
    hits = {"color": 0, "shape": 0, "letter": 0, "objects": 0, "dot": 0, "dots": 0, "bg_hit": 0, "bg": 0}
    for start in range(0, len(scenes), 32):
        chunk = scenes[start:start + 32]
        pixels = pixel_values(processor, chunk).to(model.device)
        preds = [out.argmax(-1).cpu().numpy() for out in head(patch_features(model, pixels))]
        c_pred, s_pred, l_pred, d_pred = preds[:4]
        for i, scene in enumerate(chunk):
            if scene.dot_patch >= 0:
                hits["dots"] += 1
                hits["dot"] += int(d_pred[i][scene.dot_patch] == list(COLORS).index(scene.dot_color) + 1)
            for obj in scene.objects:
                hits["letter"] += int(l_pred[i][obj.letter_patch] == LETTERS.index(obj.letter) + 1)
            c_lab, _ = scene.patch_labels()
            hits["bg_hit"] += int((c_pred[i][c_lab == 0] == 0).sum())
            hits["bg"] += int((c_lab == 0).sum())
            owner = scene.coverage.argmax(0)
            for j, obj in enumerate(scene.objects):
                patches = (owner == j) & (c_lab > 0)
                if not patches.any():
                    continue
                hits["objects"] += 1
                hits["color"] += int(np.bincount(c_pred[i][patches], minlength=6).argmax()
                                     == list(COLORS).index(obj.color) + 1)
                hits["shape"] += int(np.bincount(s_pred[i][patches], minlength=4).argmax()
                                     == SHAPES.index(obj.shape) + 1)
    n_objects = sum(len(s.objects) for s in scenes)
    return {"color": hits["color"] / hits["objects"], "shape": hits["shape"] / hits["objects"],
            "letter": hits["letter"] / n_objects, "dot": hits["dot"] / max(hits["dots"], 1),
            "background": hits["bg_hit"] / hits["bg"]}


# ----------------------------------------------------------------------------- stage 2

@dataclass
class PackedBatch:
    """Shared-prefix packed batch.

    input_ids, position_ids: [B, T]; attention_mask: float [B, 1, T, T] (0 = attend,
    dtype-min = masked); pixel_values: [B, 3, H, W]; loss_rows: [N] flat indices into B*T
    whose next-token prediction is supervised; loss_targets: [N]; answer_rows: [K_total]
    the subset of loss_rows predicting the answer word (for train accuracy); text_rows,
    text_targets: [M] every other text token of a block predicting the next one (empty unless the
    packer was built with ``text_rows``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    pixel_values: torch.Tensor
    loss_rows: torch.Tensor
    loss_targets: torch.Tensor
    answer_rows: torch.Tensor
    text_rows: torch.Tensor
    text_targets: torch.Tensor

    def to(self, device: torch.device) -> "PackedBatch":
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class Packer:
    """Builds packed batches; prompt pieces come from the real chat template + tokenizer."""

    def __init__(self, processor: LlavaProcessor, n_image_tokens: int = N_PATCHES, text_rows: bool = False):
        self.processor = processor
        self.text_rows = text_rows
        self.tok = processor.tokenizer
        self.image_id = self.tok.image_token_id
        self.n_image_tokens = n_image_tokens
        self._blocks: dict[str, list[int]] = {}
        self.prefix = self._split("x")[0]

    def _split(self, question: str, history: tuple[tuple[str, str], ...] = ()) -> tuple[list[int], list[int]]:
        """(prefix ids with the image expanded, ids of the rest: earlier turns, then the question)."""
        ids = self.tok(chat_prompt(self.processor, question, history))["input_ids"]
        cut = ids.index(self.image_id)
        return ids[:cut] + [self.image_id] * self.n_image_tokens, ids[cut + 1:]

    def block(self, question: str, history: tuple[tuple[str, str], ...] = ()) -> list[int]:
        """Token ids after the image for ``question`` asked after the ``history`` turns."""
        if history:
            return self._split(question, history)[1]
        if question not in self._blocks:
            self._blocks[question] = self._split(question)[1]
        return self._blocks[question]

    def pack(self, scenes: list[Scene], questions: list[list],
             histories: list[list[tuple]] | None = None) -> tuple[list[list[int]], ...]:
        """Token ids, positions, block ids (0 prefix, j>0 block, -1 pad) and loss triples (row, target,
        role: "answer", "eos" or, with ``text_rows``, "text"); ``histories[b][j]`` holds the earlier turns
        of question j of image b (default none)."""
        eos = self.tok.eos_token_id
        seqs, poss, blks, losses = [], [], [], []
        for b, qs in enumerate(questions):
            ids, pos, blk = list(self.prefix), list(range(len(self.prefix))), [0] * len(self.prefix)
            loss = []  # (row, target, role)
            for j, q in enumerate(qs, start=1):
                history = histories[b][j - 1] if histories else ()
                body = self.block(q.text, history) + [self.tok.convert_tokens_to_ids(q.answer)]
                start = len(ids)
                ids += body
                pos += range(len(self.prefix), len(self.prefix) + len(body))
                blk += [j] * len(body)
                if self.text_rows:  # each block token before the answer's predecessor predicts the next one
                    loss += [(start + i, body[i + 1], "text") for i in range(len(body) - 2)]
                loss += [(start + len(body) - 2, body[-1], "answer"), (start + len(body) - 1, eos, "eos")]
            seqs.append(ids), poss.append(pos), blks.append(blk), losses.append(loss)
        return seqs, poss, blks, losses

    def batch(self, scenes: list[Scene], questions: list[list],
              histories: list[list[tuple]] | None = None) -> PackedBatch:
        seqs, poss, blks, losses = self.pack(scenes, questions, histories)
        B, T = len(seqs), max(len(s) for s in seqs)
        input_ids = torch.full((B, T), self.tok.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((B, T), dtype=torch.long)
        block = torch.full((B, T), -1, dtype=torch.long)
        rows, targets, is_answer, text = [], [], [], []
        for b in range(B):
            n = len(seqs[b])
            input_ids[b, :n] = torch.tensor(seqs[b])
            position_ids[b, :n] = torch.tensor(poss[b])
            block[b, :n] = torch.tensor(blks[b])
            for row, target, role in losses[b]:
                if role == "text":
                    text.append((b * T + row, target))
                else:
                    rows.append(b * T + row), targets.append(target), is_answer.append(role == "answer")
        q_blk, k_blk = block[:, :, None], block[:, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        allowed = causal & (q_blk >= 0) & ((k_blk == 0) | (k_blk == q_blk))
        allowed |= torch.eye(T, dtype=torch.bool)  # padding rows attend to themselves
        mask = torch.zeros((B, 1, T, T)).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        rows_t, text_t = torch.tensor(rows), torch.tensor(text, dtype=torch.long).reshape(-1, 2)
        return PackedBatch(input_ids, position_ids, mask, pixel_values(self.processor, scenes),
                           rows_t, torch.tensor(targets), rows_t[torch.tensor(is_answer)],
                           text_t[:, 0], text_t[:, 1])


@contextmanager
def projected_tokens(model: LlavaForConditionalGeneration) -> Iterator[list[torch.Tensor]]:
    """Collects the projector's output ([B, 144, D]: the visual tokens the decoder reads) of the
    forwards run inside the block."""
    out: list[torch.Tensor] = []
    handle = model.model.multi_modal_projector.register_forward_hook(lambda _m, _i, o: out.append(o))
    try:
        yield out
    finally:
        handle.remove()


def patch_loss(head: "PatchHead", feats: torch.Tensor, scenes: list[Scene]) -> torch.Tensor:
    """Sum of the per-patch cross-entropies of ``head`` on feats [B, 144, D] (only the labels the head
    predicts: row/column with its position logits)."""
    return sum(F.cross_entropy(out.flatten(0, 1), target.to(out.device).flatten())
               for out, target in zip(head(feats), patch_labels(scenes)))


def packed_loss(model: LlavaForConditionalGeneration, batch: PackedBatch,
                text_weight: float = 0.0) -> tuple[torch.Tensor, float]:
    """(mean cross-entropy over the answer and end rows, plus ``text_weight`` x the mean over the other
    text rows when there are any; train accuracy on the answer words)."""
    hidden = model.model(input_ids=batch.input_ids, pixel_values=batch.pixel_values,
                         attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids).last_hidden_state
    flat = hidden.reshape(-1, hidden.shape[-1])
    logits = model.lm_head(flat[batch.loss_rows])
    loss = F.cross_entropy(logits, batch.loss_targets)
    is_answer = torch.isin(batch.loss_rows, batch.answer_rows)
    acc = (logits[is_answer].argmax(-1) == batch.loss_targets[is_answer]).float().mean().item()
    if text_weight and len(batch.text_rows):
        loss = loss + text_weight * F.cross_entropy(model.lm_head(flat[batch.text_rows]), batch.text_targets)
    return loss, acc


# ----------------------------------------------------------------------------- driver

class Trainer:
    """Runs both stages with time budgets, periodic evaluation and resumable checkpoints."""

    def __init__(self, out: Path, run_dir: Path, settings: Settings, resume: bool,
                 device: torch.device = torch.device("cpu")):
        self.out, self.run_dir, self.cfg, self.device = out, run_dir, settings, device
        run_dir.mkdir(parents=True, exist_ok=True)
        self.processor = build_processor(settings.layout)
        self.model = LlavaForConditionalGeneration(build_config(self.processor, **settings.model)).to(device)
        self.head = PatchHead(self.model.config.vision_config.hidden_size, settings.s1_position).to(device)
        # stage 2 (with s2_patch_weight): the same labels from the projected visual tokens, so that every
        # patch attribute the tower learned stays readable by the decoder
        self.token_head = PatchHead(self.model.config.text_config.hidden_size, position=True).to(device)
        self.token_optimizer = torch.optim.AdamW(self.token_head.parameters(), lr=settings.s2_lr)
        self.packer = Packer(self.processor, text_rows=settings.s2_text_weight > 0)
        self.state = State()
        self.optimizer = self._make_optimizer()
        self._probe_seeds = range(STAGE1_EVAL_START, STAGE1_EVAL_START + settings.s1_probe_scenes)
        self._diag_items = diagnostic_items(settings.diag_per_kind)
        resuming = resume and (run_dir / "state.json").exists()
        (run_dir / "settings.json").write_text(json.dumps(asdict(settings), default=str, indent=1))  # as run
        if resuming:
            self._load()
        elif settings.vision_from or settings.init_from:
            self._adopt(Path(settings.init_from or settings.vision_from), whole=bool(settings.init_from))
        print(f"parameters: {sum(p.numel() for p in self.model.parameters()):,}", flush=True)

    # -- optimisation set-up
    def _make_optimizer(self) -> torch.optim.Optimizer:
        if self.state.stage == 1:
            groups = [{"params": list(self.model.model.vision_tower.parameters())
                       + list(self.head.parameters()), "lr_mult": 1.0}]
            lr = self.cfg.s1_lr
        else:
            vision = list(self.model.model.vision_tower.parameters())
            ids = {id(p) for p in vision}
            rest = [p for p in self.model.parameters() if id(p) not in ids]
            decay = self.cfg.s2_weight_decay
            groups = [{"params": [p for p in rest if p.ndim >= 2], "lr_mult": 1.0, "weight_decay": decay},
                      {"params": [p for p in rest if p.ndim < 2], "lr_mult": 1.0, "weight_decay": 0.0},
                      {"params": vision, "lr_mult": self.cfg.s2_vision_lr}]
            lr = self.cfg.s2_lr
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def _set_lr(self, base: float, factor: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = base * factor * group["lr_mult"]

    # -- checkpoints
    def _save(self) -> None:
        tmp = self.run_dir / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp / "model")
        save_file(self.head.state_dict(), str(tmp / "head.safetensors"))
        save_file(self.token_head.state_dict(), str(tmp / "token_head.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(self.token_optimizer.state_dict(), tmp / "token_optimizer.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(self.state)))
        for name in ("model", "head.safetensors", "token_head.safetensors", "optimizer.pt",
                     "token_optimizer.pt", "state.json"):
            dest = self.run_dir / name
            if dest.is_dir():
                shutil.rmtree(dest)
            (tmp / name).replace(dest)
        tmp.rmdir()

    def _load(self) -> None:
        self.state = State(**json.loads((self.run_dir / "state.json").read_text()))
        loaded = LlavaForConditionalGeneration.from_pretrained(self.run_dir / "model")
        self.model.load_state_dict(loaded.state_dict())
        self.head.load_state_dict(load_file(str(self.run_dir / "head.safetensors")))
        self.optimizer = self._make_optimizer()
        # saved on any device; load_state_dict moves each state onto its parameter's device
        self.optimizer.load_state_dict(torch.load(self.run_dir / "optimizer.pt", map_location="cpu",
                                                  weights_only=True))
        if (self.run_dir / "token_head.safetensors").exists():  # runs before s2_patch_weight lack it
            self.token_head.load_state_dict(load_file(str(self.run_dir / "token_head.safetensors")))
            self.token_optimizer.load_state_dict(torch.load(self.run_dir / "token_optimizer.pt", map_location="cpu",
                                                            weights_only=True))
        print(f"resumed: {self.state}", flush=True)

    def _adopt(self, folder: Path, whole: bool) -> None:
        """Start from a saved LLaVA: its vision tower (stage 1 done there: start at stage 2) or all of
        it (stage 1 still runs, to teach the tower this data's labels). Word embeddings are copied
        word by word, so a grown vocabulary keeps every row the donor knew."""
        donor = LlavaForConditionalGeneration.from_pretrained(folder)
        if not whole:
            self.model.model.vision_tower.load_state_dict(donor.model.vision_tower.state_dict())
            self.state = State(stage=2)
            self.optimizer = self._make_optimizer()
            print(f"vision tower from {folder}; stage 1 skipped", flush=True)
            return
        embed = "model.language_model.embed_tokens.weight"
        weights = {k: v for k, v in donor.state_dict().items() if k != embed and not k.startswith("lm_head")}
        missing = set(self.model.load_state_dict(weights, strict=False).missing_keys) - {embed, "lm_head.weight"}
        if missing:
            raise ValueError(f"{folder} lacks weights of this architecture: {sorted(missing)[:5]}")
        old_vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
        with torch.no_grad():
            rows = self.model.get_input_embeddings().weight
            for word, i in self.processor.tokenizer.get_vocab().items():
                if word in old_vocab:
                    rows[i] = donor.get_input_embeddings().weight[old_vocab[word]]
        print(f"weights from {folder} ({sum(w not in old_vocab for w in self.processor.tokenizer.get_vocab())} "
              "new words)", flush=True)

    def export(self) -> None:
        """Save the model and processor for ``from_pretrained`` into ``out``."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(self.out)
        self.processor.save_pretrained(self.out)

    # -- stages
    def stage1(self) -> None:
        cfg, st = self.cfg, self.state
        budget = cfg.s1_minutes * 60
        self.model.train()
        last_ckpt = time.time()
        while st.elapsed < budget and st.step < (cfg.s1_max_steps or math.inf):
            t0 = time.time()
            scenes = next_scenes(st, cfg.s1_batch)
            pixels = pixel_values(self.processor, scenes).to(self.device)
            loss = patch_loss(self.head, patch_features(self.model, pixels), scenes)
            self._set_lr(cfg.s1_lr, lr_factor(st.step, st.elapsed, cfg.s1_warmup, budget, 0.05))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], 1.0)
            self.optimizer.step()
            st.step += 1
            dt = time.time() - t0
            st.elapsed += dt
            if st.step % cfg.log_every == 0:
                print(f"[s1] step {st.step} loss {loss.item():.4f} {dt:.2f}s/step "
                      f"t={st.elapsed / 60:.1f}min", flush=True)
            if st.step >= cfg.s1_min_steps and st.step % cfg.s1_check_every == 0:
                acc = probe_objects(self.model, self.head, self.processor, self._probe_seeds)
                print(f"[s1] step {st.step} probe {json.dumps(acc)}", flush=True)
                if (acc["color"] >= cfg.s1_target_color and acc["shape"] >= cfg.s1_target_shape
                        and min(acc["letter"], acc["dot"]) >= cfg.s1_target_fine):
                    break
            if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
                self._save()
                last_ckpt = time.time()
        acc = probe_objects(self.model, self.head, self.processor, self._probe_seeds)
        print(f"[s1] done: step {st.step}, {st.elapsed / 60:.1f} min, probe {json.dumps(acc)}", flush=True)
        self.state = State(stage=2, next_seed=st.next_seed)
        self.optimizer = self._make_optimizer()
        self._save()

    def _eval(self) -> dict:
        seeds = range(STAGE2_EVAL_START, STAGE2_EVAL_START + self.cfg.eval_scenes)
        result = evaluate(self.model, self.processor, heldout_items(seeds, self.cfg.eval_per_scene))
        follow = evaluate(self.model, self.processor, heldout_items(seeds[: len(seeds) // 2], 3), followup=True)
        diag = diagnose(self.model, self.processor, self._diag_items)
        record = {"step": self.state.step, "minutes": round(self.state.elapsed / 60, 2),
                  "fraction": round(self.state.elapsed / (self.cfg.s2_minutes * 60), 3),
                  "accuracy": result, "followup": follow["overall"], "diagnostics": diag}
        with open(self.run_dir / "diagnostics.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        print(f"[s2] step {self.state.step} follow-up accuracy {follow['overall']:.3f}; "
              f"diagnostics {json.dumps(diag)}", flush=True)
        return result

    def stage2(self) -> None:
        cfg, st = self.cfg, self.state
        budget = cfg.s2_minutes * 60
        rng = np.random.default_rng([st.next_seed, 2])
        vision = self.model.model.vision_tower
        last_ckpt = time.time()
        self.model.train()
        while st.elapsed < budget and st.step < (cfg.s2_max_steps or math.inf):
            t0 = time.time()
            frozen = st.elapsed < cfg.s2_frozen * budget
            vision.requires_grad_(not frozen)
            lettered = st.elapsed < cfg.s2_letter_stage * budget
            relational = not lettered and st.elapsed < (cfg.s2_letter_stage + cfg.s2_relation_stage) * budget
            curriculum = not (lettered or relational) and st.elapsed < (
                cfg.s2_letter_stage + cfg.s2_relation_stage + cfg.s2_curriculum) * budget
            if lettered or relational:
                scenes = next_scenes(st, cfg.s2_images, n_objects=1 if lettered else 2)
                kinds = LETTER_STAGE_KINDS if lettered else RELATION_STAGE_KINDS
                questions = [make_questions(s, s.seed, cfg.s2_questions, kinds) for s in scenes]
            else:
                scenes = next_scenes(st, cfg.s2_images, max_objects=MIN_OBJECTS if curriculum else None)
                questions = [make_questions(s, s.seed, cfg.s2_questions, cfg.s2_kinds) for s in scenes]
            histories = [followup_histories(qs, cfg.s2_followups, rng) for qs in questions]
            with projected_tokens(self.model) as projected:
                loss, acc = packed_loss(self.model, self.packer.batch(scenes, questions, histories).to(self.device),
                                        cfg.s2_text_weight)
            if cfg.s2_patch_weight:
                loss = loss + cfg.s2_patch_weight * patch_loss(self.token_head, projected[0], scenes)
            factor = lr_factor(st.step, st.elapsed, cfg.s2_warmup, budget, cfg.s2_final_lr)
            self._set_lr(cfg.s2_lr, factor)
            self.token_optimizer.param_groups[0]["lr"] = cfg.s2_lr * factor
            self.optimizer.zero_grad(set_to_none=True)
            self.token_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.token_optimizer.step()
            st.step += 1
            dt = time.time() - t0
            st.elapsed += dt
            if st.step % cfg.log_every == 0:
                phase = ("letters " if lettered else "relations " if relational else
                         "curriculum " if curriculum else "") + (
                    "frozen" if frozen else "unfrozen")
                print(f"[s2] step {st.step} loss {loss.item():.4f} train_acc {acc:.3f} {dt:.2f}s/step "
                      f"t={st.elapsed / 60:.1f}min ({phase})", flush=True)
            if st.elapsed - st.last_eval > cfg.eval_minutes * 60:
                st.last_eval = st.elapsed
                res = self._eval()
                print(f"[s2] step {st.step} held-out {json.dumps(res)}", flush=True)
                worst = min(res[t] for t in QTYPES)
                if worst > st.best:
                    st.best = worst
                    self.export()
                    print(f"[s2] exported (min type accuracy {worst:.3f}) to {self.out}", flush=True)
                if worst >= cfg.s2_target:
                    break
            if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
                self._save()
                last_ckpt = time.time()
        res = self._eval()
        print(f"[s2] done: step {st.step}, {st.elapsed / 60:.1f} min, held-out {json.dumps(res)}", flush=True)
        self.export()  # the end of the schedule is the model (a kind that never learns makes min-over-kinds noise)
        print(f"[s2] exported final model to {self.out}", flush=True)
        st.stage = 3
        self._save()


def main(argv: list[str] | None = None) -> LlavaForConditionalGeneration:
    parser = argparse.ArgumentParser(description="Train the tiny LLaVA on synthetic scenes.")
    parser.add_argument("--out", type=Path, help="export folder (default with --smoke: a temp dir)")
    parser.add_argument("--run-dir", type=Path, help="checkpoint folder (default runs/train)")
    parser.add_argument("--resume", nargs="?", const=True, metavar="RUN_DIR",
                        help="continue from the last checkpoint of RUN_DIR (default --run-dir) with its saved settings")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a tiny config (< 60 s)")
    parser.add_argument("--stage1-minutes", type=float, help="stage-1 time budget")
    parser.add_argument("--stage2-minutes", type=float, help="stage-2 time budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu",
                        help="torch device to train on, e.g. cuda (default cpu; a run may resume on another)")
    parser.add_argument("--layout", choices=LAYOUTS, default="text-first",
                        help="prompt layout: <s> USER: <image> q (text-first), <image> USER: q (image-first: the "
                             "marker patch at position 0), <image> q (image-question: no fixed text before q)")
    parser.add_argument("--vision-from", type=Path, help="skip stage 1: the vision tower of this saved model")
    parser.add_argument("--init-from", type=Path, help="start from this saved model's weights (words matched by "
                        "name; stage 1 still teaches the tower this data's labels, --stage1-minutes 0 skips it)")
    parser.add_argument("--frozen", type=float, help="fraction of stage-2 time with the tower frozen")
    parser.add_argument("--curriculum", type=float, help="fraction of stage-2 time on the smallest scenes")
    parser.add_argument("--lr", type=float, help="stage-2 peak learning rate")
    parser.add_argument("--final-lr", type=float,
                        help="stage-2 learning rate at the end of the cosine, a fraction of the peak (default 0.05; "
                             "1 keeps it constant, to train far past convergence)")
    parser.add_argument("--position-targets", action="store_true", help="stage 1 also predicts each patch's row/column")
    parser.add_argument("--relation-weight", type=int, default=1, help="relations asked this many times as often")
    parser.add_argument("--relation-stage", type=float,
                        help="fraction of stage-2 time first spent on two-object scenes, relation and position only")
    parser.add_argument("--letter-stage", type=float,
                        help="fraction of stage-2 time first spent on one-object scenes, letter and position only")
    parser.add_argument("--text-loss", type=float,
                        help="weight of a next-token loss on every text token of a question block (default 0: "
                             "the answer word and </s> only)")
    parser.add_argument("--followups", type=float, help="share of questions asked as a conversation's second turn")
    parser.add_argument("--patch-weight", type=float,
                        help="stage 2: weight of the per-patch labels (stage 1's, with row/column) predicted from the "
                             "projector's output, so every attribute the tower learned stays readable by the decoder")
    parser.add_argument("--decoder", nargs="*", default=[], metavar="FIELD=N",
                        help="decoder shape overrides of the model dict (text_layers, text_heads, text_hidden, "
                             "text_mlp), e.g. text_heads=16 for more heads than the task needs")
    parser.add_argument("--kind-weight", nargs="*", default=[], metavar="KIND=N",
                        help="ask these kinds N times as often (e.g. letter=3)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    settings = smoke_settings() if args.smoke else Settings(model=FULL_MODEL)
    if args.stage1_minutes is not None:
        settings.s1_minutes = args.stage1_minutes
    if args.stage2_minutes is not None:
        settings.s2_minutes = args.stage2_minutes
    for name, value in (("s2_frozen", args.frozen), ("s2_curriculum", args.curriculum), ("s2_lr", args.lr),
                        ("s2_relation_stage", args.relation_stage), ("s2_followups", args.followups),
                        ("s2_patch_weight", args.patch_weight), ("s2_letter_stage", args.letter_stage),
                        ("s2_text_weight", args.text_loss), ("s2_final_lr", args.final_lr)):
        if value is not None:
            setattr(settings, name, value)
    try:
        settings.model = settings.model | decoder_shape(args.decoder)
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    settings.layout, settings.vision_from, settings.init_from = args.layout, args.vision_from, args.init_from
    settings.s1_position = args.position_targets
    weights = {"relation": args.relation_weight} | {k: int(n) for k, n in (w.split("=") for w in args.kind_weight)}
    settings.s2_kinds = QTYPES + AUX_KINDS + tuple(k for k, n in weights.items() for _ in range(n - 1))
    if args.out is None and not args.smoke:
        parser.error("--out is required")
    out = args.out or Path(tempfile.mkdtemp(prefix="tiny-llava-smoke-"))
    if isinstance(args.resume, str):
        args.run_dir = Path(args.resume)
    run_dir = args.run_dir or (out / "_run" if args.smoke else Path("runs/train"))
    if args.resume and (run_dir / "settings.json").exists():
        settings = load_settings(run_dir / "settings.json", args.stage1_minutes, args.stage2_minutes)
    trainer = Trainer(out, run_dir, settings, bool(args.resume), device)
    started = time.time()
    if trainer.state.stage == 1:
        trainer.stage1()
    if trainer.state.stage == 2:
        trainer.stage2()
    if not (out / "config.json").exists():
        trainer.export()
    if args.smoke and args.run_dir is None:
        shutil.rmtree(run_dir)
    print(f"finished in {(time.time() - started) / 60:.1f} min (this process); model in {out}", flush=True)
    return trainer.model


if __name__ == "__main__":
    main()
