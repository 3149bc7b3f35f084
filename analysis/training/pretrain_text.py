"""Pretrain the tiny LLaVA's decoder on text alone first, as LLaVA's decoder was (a language model before a VLM).

    python -m analysis.training.pretrain_text --out runs/bb --vision-from assets/tiny-llava --layout image-question
    python -m analysis.training.train_model --init-from runs/bb --stage1-minutes 0 --layout image-question ...  # then

The text is the bigram-backcopy language of the active-dormant-head study of attention sinks (the model
card's "Tries for sink heads" lists the studies and what each run showed): over the scene words, each
next word follows a fixed sparse bigram table, except after one of a few *trigger* words, where it
repeats the word before the trigger. A head is needed only at trigger positions (to fetch the word
before the trigger); everywhere else its output should be nothing, which softmax attention cannot say
unless it parks on a token whose value carries nothing: in the small transformers of that study the
first token becomes that parking place (an attention sink, with a massive activation). Nothing here
names a sink: the loss is next-token cross-entropy on every position.

``--first bos`` opens every sequence with ``<s>`` (as language models are trained); ``--first random``
with a random word, so that a sink, if one forms, belongs to position 0 and not to a word (the
image-first layouts put the scene's fixed marker patch there). The result is a whole
``LlavaForConditionalGeneration`` (the vision tower of ``--vision-from``, a fresh projector, the
pretrained decoder) with the processor of ``--layout``, ready for ``train_model --init-from``.
Each check (``sink.jsonl``): loss against the language's entropy floor, and per layer the mean
attention of the non-trigger rows on position 0 (the busiest head's, and the head mean) and the
norm of position 0's input hidden state over the median of the others.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlavaForConditionalGeneration

from analysis.training.diagnostics import eager_attention
from analysis.training.train_model import FULL_MODEL, half_cosine
from analysis.training.tiny_vlm import LAYOUTS, SPECIAL_TOKENS, build_config, build_processor, decoder_shape
from hap.hub import resolve_device


@dataclass
class BigramBackcopy:
    """The language: `words [V]` token ids, `triggers` (a subset of them), `table [V, V]` next-word
    probabilities over `words` (rows sum to 1; a trigger's row is never used: after it comes a copy)."""

    words: np.ndarray
    triggers: np.ndarray
    table: np.ndarray

    @classmethod
    def make(cls, words: list[int], n_triggers: int = 3, support: int = 6, seed: int = 0) -> "BigramBackcopy":
        rng = np.random.default_rng(seed)
        ids = np.array(sorted(words))
        triggers = rng.choice(ids, n_triggers, replace=False)
        table = np.zeros((len(ids), len(ids)))
        for row in range(len(ids)):
            nxt = rng.choice(len(ids), support, replace=False)
            table[row, nxt] = rng.dirichlet(np.full(support, 0.5))
        return cls(ids, np.sort(triggers), table)

    def _index(self) -> np.ndarray:
        """Row of `table` for each token id (-1 for ids that are not words)."""
        index = np.full(self.words.max() + 1, -1)
        index[self.words] = np.arange(len(self.words))
        return index

    def entropy_floor(self, ids: np.ndarray) -> float:
        """Nats per predicted word of the ideal model (one that knows the table and the copy rule) on the words
        of `ids [batch, length]` drawn by `sample`, mean over the predicted positions 1..length-1: position 1 is
        drawn uniformly from the plain words (log of their number), a word after a trigger is a copy (0 nats),
        any other word costs -log of its table probability after its predecessor. On the same words as a
        model's loss, so the difference is the model's excess, free of the draw's luck."""
        index = self._index()
        before, after = ids[:, 1:-1], ids[:, 2:]  # positions 2..length-1 and the words they follow
        with np.errstate(divide="ignore"):
            nats = -np.log(self.table[index[before], index[after]])
        per_word = np.where(np.isin(before, self.triggers), 0.0, nats)
        opening = np.log(len(self.words) - len(self.triggers)) * len(ids)
        return float((opening + per_word.sum()) / (len(ids) * (ids.shape[1] - 1)))

    def sample(self, rng: np.random.Generator, batch: int, length: int, first: int | None) -> np.ndarray:
        """Token ids `[batch, length]`; position 0 is `first` (None: a random non-trigger word). Each
        position is drawn for the whole batch at once (inverse CDF of the current word's table row)."""
        position = self._index()
        plain = self.words[~np.isin(self.words, self.triggers)]
        cdf = np.cumsum(self.table, axis=1)
        out = np.empty((batch, length), dtype=np.int64)
        out[:, 0] = rng.choice(plain, batch) if first is None else first
        out[:, 1] = rng.choice(plain, batch)
        for i in range(1, length - 1):
            drawn = (rng.random(batch)[:, None] > cdf[position[out[:, i]]]).sum(1)
            bigram = self.words[np.minimum(drawn, len(self.words) - 1)]
            out[:, i + 1] = np.where(np.isin(out[:, i], self.triggers), out[:, i - 1], bigram)
        return out


@dataclass
class PretrainSettings:
    """One text-pretraining run, saved with it as ``pretrain_settings.json`` (``--resume`` reads it back)."""

    layout: str = "image-question"
    first: str = "random"  # "bos" or "random" (what opens each sequence)
    triggers: int = 3  # trigger words (the share of positions where a copy is due)
    batch: int = 32
    length: int = 128
    lr: float = 1e-3
    warmup: int = 100
    decay_from: int = 0  # the step a cosine decay of the learning rate starts at
    decay_steps: int = 0  # how long it lasts (0: the rate stays at lr after warmup)
    lr_end: float = 0.0  # where it ends, and stays
    weight_decay: float = 0.3
    minutes: float = 20.0
    check_every: int = 100
    seed: int = 0


def learning_rate(settings: PretrainSettings, step: int) -> float:
    """The rate of optimizer step `step` (0-based): a linear warmup to ``lr`` over ``warmup`` steps, then, when
    ``decay_steps`` > 0, a half cosine from ``lr`` at step ``decay_from`` to ``lr_end`` at ``decay_from +
    decay_steps``, held there (a decay that starts during the warmup caps it: the lower of the two)."""
    rate = settings.lr * min(1.0, (step + 1) / settings.warmup)
    if settings.decay_steps <= 0 or step < settings.decay_from:
        return rate
    return min(rate, half_cosine((step - settings.decay_from) / settings.decay_steps, settings.lr, settings.lr_end))


def _decoder_params(model: LlavaForConditionalGeneration) -> list[torch.nn.Parameter]:
    return list(model.model.language_model.parameters())  # lm_head is tied to the word embeddings


def lm_loss(model: LlavaForConditionalGeneration, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position of `ids [batch, length]`."""
    hidden = model.model.language_model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@torch.no_grad()
def first_token_readings(model: LlavaForConditionalGeneration, ids: torch.Tensor, triggers: np.ndarray,
                         skip: int = 8) -> list[dict]:
    """Per decoder layer, on `ids [batch, length]` (rows past `skip`; means over rows and batch):

    - ``first [heads]``: the attention non-trigger rows put on position 0 (``max_head`` / ``mean_head``: the
      busiest head's and the head mean);
    - ``norm_ratio``: position 0's input hidden-state norm over the median norm of the other positions;
    - ``entropy [heads]``: each head's attention entropy at non-trigger rows over its most, log(t + 1) (1: spread
      uniformly, 0: on one token), which tells a head that parks (low) from one that spreads (near 1);
    - ``value_ratio [heads]``: position 0's value vector norm over the median of the other positions' (a sink's
      value drains towards 0, so that parking on it adds nothing);
    - ``copy [heads]``: the attention trigger rows put on the word before them (where the copy is fetched)."""
    with eager_attention(model):
        out = model.model.language_model(input_ids=ids, output_attentions=True, output_hidden_states=True)
    past = torch.arange(ids.shape[1], device=ids.device) >= skip  # [T]
    is_trigger = torch.isin(ids, torch.as_tensor(triggers, device=ids.device))  # [B, T]
    w, wt = (~is_trigger & past)[:, None, :].float(), (is_trigger & past)[:, None, :].float()  # [B, 1, T]
    length = ids.shape[1]
    most = torch.log(torch.arange(1, length + 1, device=ids.device, dtype=torch.float32)).clamp_min(1e-9)  # [T]
    readings = []
    for layer, attn in enumerate(out.attentions):  # [B, H, T, T]
        attn = attn.float()
        on_first = (attn[..., 0] * w).sum((0, 2)) / w.sum((0, 2))  # [H]
        entropy = -(attn * attn.clamp_min(1e-12).log()).sum(-1) / most  # [B, H, T]
        on_previous = F.pad(attn.diagonal(offset=-1, dim1=-2, dim2=-1), (1, 0))  # [B, H, T]: row t on t - 1
        norms = out.hidden_states[layer].norm(dim=-1)  # [B, T]
        ratio = (norms[:, 0] / norms[:, 1:].median(dim=-1).values).mean()
        block = model.model.language_model.layers[layer]
        values = block.self_attn.v_proj(block.input_layernorm(out.hidden_states[layer]))  # [B, T, kv_heads * d]
        v_norms = values.unflatten(-1, (-1, block.self_attn.head_dim)).norm(dim=-1)  # [B, T, kv_heads]
        v_ratio = (v_norms[:, 0] / v_norms[:, 1:].median(dim=1).values).mean(0)  # [kv_heads]
        readings.append({"layer": layer, "max_head": round(on_first.max().item(), 3),
                         "mean_head": round(on_first.mean().item(), 3), "norm_ratio": round(ratio.item(), 2),
                         "first": [round(x, 3) for x in on_first.tolist()],
                         "value_ratio": [round(x, 3) for x in v_ratio.tolist()],
                         "entropy": [round(x, 3) for x in ((entropy * w).sum((0, 2)) / w.sum((0, 2))).tolist()],
                         "copy": [round(x, 3) for x in
                                  ((on_previous * wt).sum((0, 2)) / wt.sum((0, 2)).clamp_min(1)).tolist()]})
    return readings


def _checkpoint(out: Path, model, processor, optimizer, step: int, elapsed: float, rng: np.random.Generator) -> None:
    model.save_pretrained(out)
    processor.save_pretrained(out)
    torch.save(optimizer.state_dict(), out / "optimizer.pt")
    (out / "state.json").write_text(json.dumps({"step": step, "elapsed": elapsed, "rng": rng.bit_generator.state}))


def uniform_share(length: int, skip: int = 8) -> float:
    """What `first_token_readings` reads for a head attending uniformly over its prefix: row t puts
    1 / (t + 1) on position 0, averaged over rows skip..length-1 (trigger rows aside)."""
    return float(np.mean(1.0 / np.arange(skip + 1, length + 1)))


def _value_ratio(layer: dict, head: int) -> float:
    """Position 0's value-norm ratio of `head` in one layer's readings (heads sharing a value head share it)."""
    return layer["value_ratio"][head // (len(layer["first"]) // len(layer["value_ratio"]))]


def _busiest(layer: dict) -> str:
    """"entropy / value ratio" of the layer's head parking most on position 0 ("–" in logs that predate them)."""
    if "entropy" not in layer:
        return "–"
    h = int(np.argmax(layer["first"]))
    return f"{layer['entropy'][h]:.2f} / {_value_ratio(layer, h):.2f}"


def table(log: Path, every: int = 1) -> str:
    """A markdown table of a run's checks (``sink.jsonl``): the loss above the language's floor, the head that
    parks most on position 0 (share and layer; its entropy over the most and position 0's value norm over the
    median, which drains first when a sink forms), the head mean over all layers, and position 0's largest
    norm ratio (and layer); the first line says what a uniform head reads."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    settings, _ = saved_run(log.parent)
    language, _, probe_ids = run_language(settings, build_processor(settings.layout))
    floor = language.entropy_floor(probe_ids)  # recomputed: runs logged before 2026-12-04 under-counted it
    lines = [f"uniform attention reads {uniform_share(settings.length):.3f} on position 0",
             "| step | minutes | loss above floor (nats) | busiest head on position 0 (layer) | its entropy / value "
             "ratio | head mean | position-0 norm / median (layer) |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records):
        if i % every and i != len(records) - 1:
            continue
        busiest = max(r["layers"], key=lambda x: x["max_head"])
        massive = max(r["layers"], key=lambda x: x["norm_ratio"])
        mean = np.mean([x["mean_head"] for x in r["layers"]])
        lines.append(f"| {r['step']} | {r['minutes']:.0f} | {r['probe_loss'] - floor:.3f} | "
                     f"{busiest['max_head']:.3f} ({busiest['layer']}) | {_busiest(busiest)} | {mean:.3f} | "
                     f"{massive['norm_ratio']:.2f} ({massive['layer']}) |")
    return "\n".join(lines)


def saved_run(run: Path) -> tuple[PretrainSettings, dict]:
    """A run's settings and decoder shape, as ``pretrain`` saved them (``pretrain_settings.json``)."""
    saved = json.loads((run / "pretrain_settings.json").read_text())
    shape = saved.pop("model")
    return PretrainSettings(**saved), shape


def saved_state(run: Path) -> dict:
    """Where a saved run stands (``state.json``): its step, elapsed seconds and the language's random state."""
    return json.loads((run / "state.json").read_text())


def run_language(settings: PretrainSettings, processor) -> tuple[BigramBackcopy, int | None, np.ndarray]:
    """A run's language, what opens its sequences (None: a random word) and its fixed probe `[16, length]`."""
    tok = processor.tokenizer
    words = [i for w, i in tok.get_vocab().items() if w not in SPECIAL_TOKENS]
    language = BigramBackcopy.make(words, n_triggers=settings.triggers, seed=settings.seed)
    first = tok.convert_tokens_to_ids("<s>") if settings.first == "bos" else None
    return language, first, language.sample(np.random.default_rng(10**6), 16, settings.length, first)


def head_table(run: Path) -> str:
    """A markdown table of a saved run's heads on its probe (`first_token_readings`): per layer and head the
    attention non-trigger rows put on position 0, their normalised entropy (near 1: spread; low: parked or
    focused), position 0's value norm over the median and the attention trigger rows put on the word before."""
    settings, _ = saved_run(run)
    model = LlavaForConditionalGeneration.from_pretrained(run).eval()
    language, _, probe_ids = run_language(settings, build_processor(settings.layout))
    step = saved_state(run)["step"]
    lines = [f"step {step}; uniform attention reads {uniform_share(settings.length):.3f} on position 0",
             "| layer | head | non-trigger rows on position 0 | their entropy / most | position-0 value norm / median "
             "| trigger rows on the word before |", "|---|---|---|---|---|---|"]
    for r in first_token_readings(model, torch.as_tensor(probe_ids), language.triggers):
        for h, (f, e, c) in enumerate(zip(r["first"], r["entropy"], r["copy"])):
            lines.append(f"| {r['layer']} | {h} | {f:.3f} | {e:.3f} | {_value_ratio(r, h):.3f} | {c:.3f} |")
    return "\n".join(lines)


def pretrain(out: Path, settings: PretrainSettings, vision_from: Path | None, model_shape: dict,
             max_steps: int | None = None, resume: bool = False,
             device: str | torch.device = "cpu") -> LlavaForConditionalGeneration:
    """Train the decoder on the language for `settings.minutes` (or `max_steps`) on `device`; save a whole
    LLaVA to `out` at every check (with the optimizer and the step, so that ``resume`` continues where it
    stopped, on any device)."""
    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    processor = build_processor(settings.layout)
    step, elapsed = 0, 0.0
    if resume:
        model = LlavaForConditionalGeneration.from_pretrained(out)
        state = saved_state(out)
        step, elapsed, rng.bit_generator.state = state["step"], state["elapsed"], state["rng"]
    else:
        model = LlavaForConditionalGeneration(build_config(processor, **model_shape))
    if vision_from is not None and not resume:
        donor = LlavaForConditionalGeneration.from_pretrained(vision_from)
        model.model.vision_tower.load_state_dict(donor.model.vision_tower.state_dict())
    model.to(device)
    language, first, probe_ids = run_language(settings, processor)
    params = _decoder_params(model)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.98))
    if resume:
        # saved on any device; load_state_dict moves each state onto its parameter's device
        optimizer.load_state_dict(torch.load(out / "optimizer.pt", map_location="cpu", weights_only=True))
    probe = torch.as_tensor(probe_ids, device=device)
    floor = language.entropy_floor(probe_ids)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrain_settings.json").write_text(json.dumps(asdict(settings) | {"model": model_shape}, indent=1))
    with open(out / "sink.jsonl", "a") as log:
        model.train()
        while elapsed < settings.minutes * 60 and step < (max_steps or 10**9):
            t0 = time.time()
            ids = torch.as_tensor(language.sample(rng, settings.batch, settings.length, first), device=device)
            rate = learning_rate(settings, step)
            for group in optimizer.param_groups:
                group["lr"] = rate
            loss = lm_loss(model, ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            elapsed += time.time() - t0
            if step % settings.check_every == 0 or elapsed >= settings.minutes * 60:
                model.eval()
                record = {"step": step, "minutes": round(elapsed / 60, 2), "batch": settings.batch,
                          "lr": round(rate, 7), "loss": round(loss.item(), 4),
                          "probe_loss": round(lm_loss(model, probe).item(), 4), "floor": round(floor, 4),
                          "layers": first_token_readings(model, probe, language.triggers)}
                model.train()
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
                _checkpoint(out, model, processor, optimizer, step, elapsed, rng)
    _checkpoint(out, model, processor, optimizer, step, elapsed, rng)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pretrain the tiny LLaVA's decoder on a bigram-backcopy language.")
    parser.add_argument("--out", type=Path, help="folder for the whole LLaVA and sink.jsonl")
    parser.add_argument("--table", type=Path, metavar="SINK_JSONL", help="print a run's checks as a table, and stop")
    parser.add_argument("--heads", type=Path, metavar="RUN", help="print each head of a saved run on its probe "
                        "(position 0, entropy, value drain, copy), and stop")
    parser.add_argument("--every", type=int, default=1, help="with --table: every n-th check (and the last)")
    parser.add_argument("--vision-from", type=Path, help="a saved LLaVA whose vision tower to keep")
    parser.add_argument("--layout", choices=LAYOUTS, default="image-question")
    parser.add_argument("--first", choices=("bos", "random"), default="random",
                        help="what opens each sequence: <s>, or a random word (a sink would belong to position 0)")
    parser.add_argument("--minutes", type=float, help="training-time budget (default 20; with --resume the run's own)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 1e-3; with --resume the run's own, "
                        "or this from now on)")
    parser.add_argument("--triggers", type=int, default=3, help="how many words trigger a copy")
    parser.add_argument("--weight-decay", type=float, default=0.3, help="AdamW weight decay on the matrices")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out (its settings; "
                        "--minutes may extend it)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 32; with --resume the run's own, "
                        "or this from now on)")
    parser.add_argument("--length", type=int, help="words per sequence (default 128; a head attending uniformly "
                        "averages over about this many words)")
    parser.add_argument("--check-every", type=int, help="steps between checks and checkpoints (default 100; "
                        "with --resume likewise)")
    parser.add_argument("--decoder", nargs="*", default=[], metavar="FIELD=N",
                        help="decoder shape overrides of train_model's (text_layers, text_heads, text_hidden, "
                             "text_mlp), e.g. text_layers=1 text_heads=1 for the toy study's shape")
    parser.add_argument("--decay-steps", type=int, help="decay the learning rate along a half cosine over this "
                        "many steps, from the step the run starts or resumes at, to --lr-end (default: no decay)")
    parser.add_argument("--lr-end", type=float, help="with --decay-steps: the rate it ends at (default lr / 10)")
    parser.add_argument("--device", default="cpu", help="torch device to train on, e.g. cuda (default cpu)")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table, args.every))
        return
    if args.heads:
        print(head_table(args.heads))
        return
    if args.out is None:
        parser.error("--out is required (or --table)")
    torch.set_num_threads(args.threads)
    given = {name: value for name, value in (("minutes", args.minutes), ("batch", args.batch),
                                             ("check_every", args.check_every),
                                             ("length", args.length), ("lr", args.lr)) if value is not None}
    settings = PretrainSettings(**({"layout": args.layout, "first": args.first,
                                    "triggers": args.triggers, "weight_decay": args.weight_decay} | given))
    try:
        shape = FULL_MODEL | decoder_shape(args.decoder)
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    if args.lr_end is not None and args.decay_steps is None:
        parser.error("--lr-end needs --decay-steps (how long the decay to it lasts)")
    if args.resume:
        if args.decoder:
            parser.error("--decoder with --resume: a run keeps the decoder shape it was started with")
        settings, shape = saved_run(args.out)
        settings = replace(settings, **given)
    if args.decay_steps is not None:
        if args.decay_steps <= 0:
            parser.error(f"--decay-steps must be a positive number of steps, not {args.decay_steps}")
        start = saved_state(args.out)["step"] if args.resume else settings.warmup
        settings = replace(settings, decay_from=start, decay_steps=args.decay_steps,
                           lr_end=settings.lr / 10 if args.lr_end is None else args.lr_end)
    pretrain(args.out, settings, args.vision_from, shape, args.max_steps, args.resume, device)


if __name__ == "__main__":
    main()
