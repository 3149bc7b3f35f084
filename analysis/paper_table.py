"""The field's table in one command: every method at every budget on every benchmark, through lmms-eval.

    python -m analysis.paper_table --methods all,hap_paper --tokens 48 32 16 --scenes 500000:500050 --per-scene 2 \\
        --out results/paper_table                                   # offline, the shipped model
    python -m analysis.paper_table --model llava-hf/llava-1.5-7b-hf --methods all,hap_paper --tokens 192 128 64 \\
        --tasks gqa,mme,pope,scienceqa_img,textvqa_val,mmmu_val,seedbench --processes 8 --out table-7b --dry-run

A cell is one (method, budget): one run of the lmms-eval plugin (`python -m hap.lmms_eval --model llava_hf_hap
--force_simple ... --log_samples`, one question per batch) over every task, in a process of its own. The unpruned
model (method `none`) is always a cell: the upper-bound row and what `relative` divides by.

Budgets: `--tokens T` is the papers' count, the visual tokens per image averaged over the decoder layers (so every
method at a budget has the same prefill FLOPs), turned into `retain = T / N` with N the model's visual tokens per
image (`image_seq_length`: 576 on LLaVA-1.5, 144 on the shipped model); `--retain` gives the share itself; the
default is the papers' 192 / 128 / 64 of 576 (retain 1/3, 2/9, 1/9). For each method and budget the cell takes the
method's default schedule, else the largest `first_layers` below it that reaches the budget
(`hap.planning.budget.plan`), else it is refused with the reason (no run; its row in the table says why). A method
that reads CLIP (CDPruner) gets `--clip-model`. `hap_paper` is HAP with every knob at the paper's value
(`hap.HAPConfig.paper`). `--methods all`: every pruning method of the registry.

Resuming: a finished cell leaves `cells/<method>-<tokens>/cell.json` (its arguments, scores, samples files and
timings) and is never run again with the same arguments; a run that stops loses at most the cells it was running.
`--processes N` runs N cells at a time, each on one GPU (`CUDA_VISIBLE_DEVICES`) where the device is cuda, else
on cores / N CPU threads; the table is the same as with one process. `--data-parallel` instead runs each cell under
`accelerate launch --num_processes N` (lmms-eval's data parallel, one model replica per GPU); `--accelerate-args`
passes more to that launcher, e.g. several machines (`--num_machines M --machine_rank R --main_process_ip IP
--main_process_port P`, the same command on every machine, `--out` on a shared disk: machine 0 writes the table).

Outputs in `--out`: `table.csv` (one row per method, budget and task: method, tokens, retain, task, metric, value,
relative = value / the unpruned value, samples = the cell's lmms-eval samples file relative to `--out`, then
first_layers, flops_ratio = the mean prefill FLOPs / unpruned, prefill_ms = the median prefill time per sample,
peak_mb = the median peak GPU memory of a prefill (empty on the CPU), refused = why the cell did not run),
`table.md` (the field's layout), `table.png` (the share of the unpruned score kept against tokens) and `cells/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from queue import Queue

import numpy as np

from analysis import scene_task
from analysis.scene_task import within
from analysis.table_files import write_tables
from hap.config import HAPConfig
from hap.knobs import KNOBS
from hap.methods import NONE, load_plugins, pruner_class
from hap.patch.decoder import decoder_shape, image_tokens
from hap.planning.budget import plan
from hap.runs.keeps import pruning, refusal

load_plugins()  # the pruners named in HAP_PRUNERS join `--methods all`
ROOT = Path(__file__).resolve().parent.parent  # the checkout: the cells' working folder (`analysis` importable)
SHIPPED = "assets/tiny-llava"
PAPER = "hap_paper"  # HAP with every knob at the paper's value
PAPER_TOKENS = (192, 128, 64)  # the field's budgets, of LLaVA-1.5's 576 visual tokens
PAPER_VISUAL = 576
MODEL = "llava_hf_hap"
# Questions per task in lmms-eval 0.7's splits (approximate, for --dry-run's estimate only); a task not listed counts
# --limit, or nothing
TASK_SIZES = {"gqa": 12578, "mme": 2374, "pope": 9000, "scienceqa_img": 2017, "textvqa_val": 5000, "mmmu_val": 900,
              "seedbench": 17990, "vizwiz_vqa_val": 4319, "vqav2_val": 214354, "mmbench_en_dev": 4329,
              "mmbench_en_dev_static": 4329}
ANSWER_TOKENS = 16  # tokens an answer runs to, for the estimate (hap_scenes: 3)
# The estimate's device: (prefill FLOP/s reached, decode bytes/s of weights read, model load bytes/s), assumed
THROUGHPUT = {"cuda": (2.5e14, 2.0e12, 1.0e9), "cpu": (5.0e10, 1.0e10, 5.0e8)}


@dataclass(frozen=True)
class Cell:
    """One (method, budget) of the table: its HAP knobs for `--model_args`, or why it does not run."""

    row: str  # the method's name in the table (a registry name, or hap_paper)
    retain: float
    tokens: float  # retain x the model's visual tokens per image
    knobs: tuple[tuple[str, str], ...]  # (knob, value) pairs for --model_args; () when refused
    refused: str | None = None

    @property
    def key(self) -> str:
        return f"{self.row}-{self.tokens:.4g}"

    @property
    def first_layers(self) -> int | None:
        return next((int(v) for k, v in self.knobs if k == "first_layers"), None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m analysis.paper_table", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SHIPPED, help="hub id or folder (default: the shipped model)")
    p.add_argument("--methods", default="all", help=f"comma-separated registry names, {PAPER}, or all "
                   f"(default all); {NONE} is always run")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=float, nargs="+", help="visual tokens per image averaged over the decoder "
                        f"layers (default: {' / '.join(map(str, PAPER_TOKENS))} of {PAPER_VISUAL}, scaled to the model)")
    budget.add_argument("--retain", type=float, nargs="+", help="the budgets as shares of the visual tokens")
    p.add_argument("--tasks", default="", help="comma-separated lmms-eval tasks")
    p.add_argument("--include-path", default=None, help="lmms-eval's --include_path: a folder of your own tasks")
    p.add_argument("--scenes", default=None, help="A:B: add the local task hap_scenes of held-out scenes A..B-1")
    p.add_argument("--per-scene", type=int, default=1, help="questions per scene of --scenes (default 1)")
    p.add_argument("--limit", type=int, default=None, help="lmms-eval's --limit: the first N questions of each task")
    p.add_argument("--out", required=True, help="the folder of the table and its cells")
    p.add_argument("--processes", type=int, default=1, help="cells run at a time (one GPU each where present)")
    p.add_argument("--data-parallel", action="store_true",
                   help="run each cell under accelerate launch --num_processes N instead (one replica per GPU)")
    p.add_argument("--accelerate-args", default="", help="more arguments for accelerate launch (several machines)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on the CPU")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per cell (default: the cores / --processes; 1 for steadier CPU timings)")
    p.add_argument("--clip-model", default=None, help="the CLIP checkpoint of methods that read CLIP (cdpruner)")
    p.add_argument("--dry-run", action="store_true", help="print every cell, its command and a time estimate")
    return p


def method_rows(text: str) -> list[str]:
    """The table's methods in order, `none` excluded (it is always the first cell); ValueError naming a bad one."""
    allowed = [*pruning(), PAPER]
    rows: list[str] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        names = pruning() if name == "all" else [name]
        for n in names:
            if n not in allowed and n != NONE:
                raise ValueError(f"--methods: {n!r} is not a method; allowed: {', '.join(allowed)}, all")
            if n not in rows and n != NONE:
                rows.append(n)
    return rows


def budgets(args: argparse.Namespace, num_visual: int) -> list[float]:
    """The retain of each budget, from --retain, --tokens (T / num_visual) or the papers' defaults."""
    if args.retain:
        shares = args.retain
    else:
        shares = [t / num_visual for t in args.tokens] if args.tokens else [t / PAPER_VISUAL for t in PAPER_TOKENS]
    for r in shares:
        if not 0 < r < 1:
            raise ValueError(f"a budget of retain {r:g} ({r * num_visual:g} of {num_visual} visual tokens) is out of "
                             "range: give fewer tokens than the image has, more than none")
    return shares


def meta_model(name: str):
    """The model built on the meta device from its config (no weights): enough for planning and refusals."""
    import torch
    from transformers import AutoModelForImageTextToText

    from hap.hub import load_config

    local = Path(name).expanduser()
    config = load_config(name, f"local folder {local}" if local.is_dir() else f"hub id {name!r}")
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def method_config(row: str, retain: float, clip_model: str | None) -> HAPConfig:
    """The HAPConfig of table row `row` at `retain` (the paper's knobs for hap_paper; the CLIP folder where read)."""
    config = HAPConfig.paper(retain=retain) if row == PAPER else HAPConfig(method=row, retain=retain)
    if clip_model is not None and pruner_class(config.method).clip:
        config = replace(config, clip_model=clip_model)
    return config


def reachable(model, config: HAPConfig, num_visual: int, refused: dict[str, str | None]) -> HAPConfig | str:
    """`config` with the first schedule that reaches its budget: its `first_layers` (the method's default where
    unset), else the largest one below it that does; the reason when the model refuses the method (asked once per
    method: `refused`) or no schedule reaches the budget."""
    if config.method not in refused:
        refused[config.method] = refusal(model, config)
    if refused[config.method] is not None:
        return refused[config.method]
    shape = decoder_shape(model)
    default = config.resolved(shape.layers).first_layers
    first_error = None
    for k in range(default, -1, -1):
        candidate = replace(config, first_layers=k)
        try:
            plan(candidate, shape, num_visual)
        except ValueError as err:
            first_error = first_error or str(err)
            continue
        return candidate
    return first_error if default == 0 else f"{first_error} (nor does any first_layers below {default})"


def knob_args(config: HAPConfig) -> tuple[tuple[str, str], ...]:
    """The knobs of `config` that differ from their defaults, as --model_args text (method, retain and first_layers
    always), in the knobs' order."""
    defaults = HAPConfig()
    keep = {"method", "retain", "first_layers"}
    return tuple((k.name, str(getattr(config, k.name))) for k in KNOBS
                 if k.name in keep or getattr(config, k.name) != getattr(defaults, k.name))


def plan_cells(model, rows: list[str], shares: list[float], clip_model: str | None) -> list[Cell]:
    """The unpruned cell, then every (method, budget), reachable or refused."""
    num_visual = image_tokens(model)
    cells = [Cell(NONE, 1.0, float(num_visual), (("method", NONE),))]
    refused: dict[str, str | None] = {}
    for retain in shares:
        for row in rows:
            found = reachable(model, method_config(row, retain, clip_model), num_visual, refused)
            tokens = retain * num_visual
            cells.append(Cell(row, retain, tokens, knob_args(found)) if isinstance(found, HAPConfig)
                         else Cell(row, retain, tokens, (), found))
    return cells


@dataclass(frozen=True)
class Setup:
    """What every cell of one invocation shares."""

    model: str  # as given (a folder inside the checkout: relative to it)
    tasks: tuple[str, ...]
    include: tuple[str, ...]  # lmms-eval task folders: --include-path's, then the scenes task's
    scenes: str | None  # "A:B x K" of the scenes task, or None
    limit: int | None
    device: str
    dtype: str
    processes: int
    threads: int  # CPU threads of a cell
    data_parallel: bool
    accelerate_args: tuple[str, ...]
    out: Path

    def model_args(self, cell: Cell) -> str:
        return ",".join([f"pretrained={self.model}", f"device={self.device}", f"dtype={self.dtype}",
                         *(f"{k}={v}" for k, v in cell.knobs)])

    def command(self, cell: Cell) -> list[str]:
        """The cell's command line (the timings file is added when it runs)."""
        if self.data_parallel and self.device.startswith("cuda"):
            launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(self.processes),
                      *self.accelerate_args, "-m", "hap.lmms_eval"]
        elif self.data_parallel:  # CPU processes: accelerate's launcher starts one without MPI; torchrun's gloo group
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                      str(self.processes), *self.accelerate_args, "-m", "hap.lmms_eval"]
        else:
            launch = [sys.executable, "-m", "hap.lmms_eval"]
        return [*launch, "--model", MODEL, "--force_simple", "--model_args", self.model_args(cell),
                "--tasks", ",".join(self.tasks), "--batch_size", "1", "--log_samples",
                "--output_path", str(within(self.out / "cells" / cell.key / "lmms", ROOT)),
                *(["--include_path", os.pathsep.join(self.include)] if self.include else []),
                *(["--limit", str(self.limit)] if self.limit is not None else [])]

    def spec(self, cell: Cell) -> dict:
        """What decides a cell's result: a finished cell with the same spec is reused."""
        users = self.include[:-1] if self.scenes else self.include  # the scenes task is named by its seeds
        return {"model_args": self.model_args(cell), "tasks": list(self.tasks), "include": list(users),
                "scenes": self.scenes, "limit": self.limit}

    @property
    def writer(self) -> bool:
        """Whether this machine writes results (machine rank 0 of several; the only one otherwise)."""
        args = list(self.accelerate_args)
        return "--machine_rank" not in args or args[args.index("--machine_rank") + 1] == "0"


def shown_command(command: list[str]) -> str:
    """The command as a user types it (`python`, not this interpreter's path)."""
    return shlex.join(["python" if c == sys.executable else c for c in command])


def cell_dir(setup: Setup, cell: Cell) -> Path:
    return setup.out / "cells" / cell.key


def finished(setup: Setup, cell: Cell) -> dict | None:
    """The stored record of `cell` when it finished with the same spec, else None."""
    path = cell_dir(setup, cell) / "cell.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("spec") == setup.spec(cell) else None


def finished_records(setup: Setup, cells: list[Cell]) -> dict[str, dict]:
    """key -> record of every cell that runs and has finished with the same spec."""
    return {c.key: r for c in cells if c.refused is None and (r := finished(setup, c)) is not None}


def environment(setup: Setup, slot: int) -> dict[str, str]:
    """The environment of a cell run in `slot`: this one's (the hub online or not, as the user set it), the checkout
    importable, one GPU per slot (cells in parallel on cuda) or `--threads` CPU threads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if setup.data_parallel and setup.device.startswith("cuda"):
        return env
    if setup.device.startswith("cuda"):
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(max(1, torch.cuda.device_count()))]
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    else:
        env.update(OMP_NUM_THREADS=str(setup.threads), MKL_NUM_THREADS=str(setup.threads))
    return env


def run_cell(setup: Setup, cell: Cell, slot: int) -> dict:
    """Run one cell from scratch (a leftover of an interrupted run is removed first) and store its record; a cell
    that fails returns {"failed": why} and stores nothing (the next invocation runs it again)."""
    folder = cell_dir(setup, cell)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    command = [*setup.command(cell)]
    command[command.index("--model_args") + 1] += f",timings={within(folder / 'timings.jsonl', ROOT)}"
    t0 = time.perf_counter()
    with (folder / "log.txt").open("w") as log:
        done = subprocess.run(command, cwd=ROOT, env=environment(setup, slot), stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    log = within(folder / "log.txt", ROOT)
    if done.returncode != 0:
        last = (folder / "log.txt").read_text().strip().splitlines()[-1:] or ["(empty)"]
        return {"failed": f"failed: exit {done.returncode}, see {log}; it ends: {last[0][-300:]}"}
    if not setup.writer:
        return {}
    try:
        found = collect(setup, folder)
    except (RuntimeError, KeyError, ValueError) as err:
        return {"failed": f"failed: its lmms-eval results do not read ({err}), see {log}"}
    record = {"spec": setup.spec(cell), "command": shown_command(command), "seconds": seconds, **found}
    (folder / "cell.json.tmp").write_text(json.dumps(record, indent=1))
    (folder / "cell.json.tmp").replace(folder / "cell.json")  # a cell is finished once this file exists
    return record


def collect(setup: Setup, folder: Path) -> dict:
    """A finished cell's scores (per task: the main metric, its value, the samples file, the questions) and
    timings (the prefill records of `hap.lmms_eval.PrefillMeter`, every process's)."""
    found = sorted((folder / "lmms").rglob("*_results.json"))
    if len(found) != 1:
        raise RuntimeError(f"{folder}: expected one lmms-eval results file, found {len(found)}")
    results = json.loads(found[0].read_text())
    scores = {}
    for task in setup.tasks:
        metric, value = main_metric(task, results["results"][task])
        samples = sorted((folder / "lmms").rglob(f"*_samples_{task}.jsonl"))
        scores[task] = {"metric": metric, "value": value,
                        "samples": str(samples[0].relative_to(setup.out)) if samples else "",
                        "n": results.get("n-samples", {}).get(task, {}).get("effective")}
    records = [json.loads(line) for f in sorted(folder.glob("timings*.jsonl")) for line in f.read_text().splitlines()]
    return {"scores": scores, "timings": summary(records)}


# The main metric of a task, as the field's tables print it (lmms-eval's `metric,filter` keys); MME adds two
MAIN_METRICS = {"pope": "pope_f1_score", "mmmu_val": "mmmu_acc", "seedbench": "seed_all",
                "mmbench_en_dev": "gpt_eval_score", "mmbench_en_dev_static": "gpt_eval_score",
                "mme": "mme_perception_score+mme_cognition_score"}


def main_metric(task: str, metrics: dict) -> tuple[str, float]:
    """(metric, value) of one task's lmms-eval results: `MAIN_METRICS`, else exact_match, else its first number."""
    values = {k.split(",")[0]: v for k, v in metrics.items()
              if "," in k and "stderr" not in k and isinstance(v, (int, float))}
    name = MAIN_METRICS.get(task, "exact_match" if "exact_match" in values else next(iter(values), None))
    if name is None or any(part not in values for part in name.split("+")):
        raise RuntimeError(f"task {task}: no metric {name!r} among its results {sorted(values)}")
    return name, float(sum(values[part] for part in name.split("+")))


def summary(records: list[dict]) -> dict:
    """The cell's prefill: mean FLOPs ratio and retained tokens, median time (ms) and peak memory (MB) per sample."""
    if not records:
        return {"flops_ratio": None, "retained_tokens": None, "prefill_ms": None, "peak_mb": None, "prefills": 0}
    peaks = [r["peak_bytes"] for r in records if r["peak_bytes"] is not None]
    retained = [r["retained_tokens"] for r in records if r["retained_tokens"] is not None]
    return {"flops_ratio": float(np.mean([r["flops_ratio"] for r in records])),
            "retained_tokens": float(np.mean(retained)) if retained else None,
            "prefill_ms": 1000 * float(np.median([r["prefill_s"] for r in records])),
            "peak_mb": float(np.median(peaks)) / 2**20 if peaks else None, "prefills": len(records)}


def run_cells(setup: Setup, cells: list[Cell]) -> dict[str, dict]:
    """Every cell that runs: the finished ones read back, the others run (`--processes` at a time) under a progress
    bar with an ETA; returns key -> record ({"failed": why} for a cell that failed: the others go on)."""
    from tqdm import tqdm

    records = finished_records(setup, cells)
    todo = [c for c in cells if c.refused is None and c.key not in records]
    print(f"{len(records)} finished cell(s) reused, {len(todo)} to run, "
          f"{sum(c.refused is not None for c in cells)} refused", flush=True)
    slots: Queue[int] = Queue()
    for s in range(1 if setup.data_parallel else setup.processes):
        slots.put(s)

    def work(cell: Cell) -> tuple[str, dict]:
        slot = slots.get()
        try:
            return cell.key, run_cell(setup, cell, slot)
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=slots.qsize()) as pool, tqdm(total=len(todo), unit="cell") as bar:
        for key, record in pool.map(work, todo):
            records[key] = record
            bar.update()
            if "failed" in record:
                bar.write(f"{key}: {record['failed']}")
    return records


def estimate(setup: Setup, model, cells: list[Cell], records: dict[str, dict]) -> tuple[float, str]:
    """(seconds, basis) to run the cells not finished: the measured seconds per question of finished cells where
    there are any, else an assumed device speed (`THROUGHPUT`) on the model's size and each cell's prefill FLOPs."""
    from hap.planning.flops import prefill_flops

    scenes = setup.out / "tasks" / scene_task.TASK / "docs.jsonl"
    sizes = [len(scenes.read_text().splitlines()) if t == scene_task.TASK else TASK_SIZES.get(t, setup.limit)
             for t in setup.tasks]
    questions = sum(min(s, setup.limit or s) if s else 0 for s in sizes)
    todo = [c for c in cells if c.refused is None and c.key not in records]
    done = [r for r in records.values() if "scores" in r]
    if done:
        per = sum(r["seconds"] for r in done) / max(1, sum(s["n"] or 0 for r in done for s in r["scores"].values()))
        return per * questions * len(todo), f"measured: {per:.3f} s per question in {len(done)} finished cell(s)"
    kind = "cuda" if setup.device.startswith("cuda") else "cpu"
    flops_rate, bandwidth, load = THROUGHPUT[kind]
    weight_bytes = sum(p.numel() for p in model.parameters()) * (4 if setup.dtype == "float32" else 2)
    shape, n = decoder_shape(model), image_tokens(model)
    total = 0.0
    for cell in todo:
        prefill = prefill_flops([round(cell.tokens)] * shape.layers, 64, shape) / flops_rate
        total += weight_bytes / load + questions * (prefill + ANSWER_TOKENS * weight_bytes / bandwidth)
    total /= setup.processes
    return total, (f"assumed {kind} speed ({flops_rate:.1e} FLOP/s in the prefill, {bandwidth:.0e} B/s of weights "
                   f"per answer token, {ANSWER_TOKENS} answer tokens; {n} visual tokens); {questions} questions "
                   f"per cell{'' if all(sizes) else ' (tasks of unknown size count 0: give --limit)'}")


def setup_of(args: argparse.Namespace) -> Setup:
    """The shared settings, the scenes task written where --scenes asks for it."""
    out = Path(args.out).resolve()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    include = [str(within(Path(args.include_path).resolve(), ROOT))] if args.include_path else []
    if args.scenes:
        try:
            a, b = (int(x) for x in args.scenes.split(":"))
        except ValueError:
            raise ValueError(f"--scenes {args.scenes!r}: give A:B, two seeds (e.g. 500000:500050)") from None
        scene_task.write_task(out / "tasks", range(a, b), args.per_scene, ROOT)
        include.append(str(within(out / "tasks", ROOT)))
        tasks.append(scene_task.TASK)
    if not tasks:
        raise ValueError("no task: give --tasks (lmms-eval task names) and/or --scenes A:B")
    if args.processes < 1:
        raise ValueError(f"--processes {args.processes}: at least 1")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    local = Path(args.model).expanduser()
    model = str(within(local.resolve(), ROOT)) if local.is_dir() else args.model
    scenes = f"{args.scenes} x {args.per_scene}" if args.scenes else None
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}: at least 1")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.processes)
    return Setup(model, tuple(tasks), tuple(include), scenes, args.limit, device, dtype, args.processes, threads,
                 args.data_parallel, tuple(shlex.split(args.accelerate_args)), out)


def eval_missing() -> str | None:
    """Why no cell can run here (lmms-eval not installed), or None. Found, not imported: importing lmms-eval's task
    module sets PIL's process-wide LOAD_TRUNCATED_IMAGES, and the cells import it in their own processes."""
    if importlib.util.find_spec("lmms_eval") is None:
        return "lmms-eval is not installed in this environment: bash .ci/install-eval --cli installs it"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        rows = method_rows(args.methods)
        setup = setup_of(args)
        model = meta_model(args.model)
        cells = plan_cells(model, rows, budgets(args, image_tokens(model)), args.clip_model)
    except (ValueError, OSError) as err:
        print(f"paper_table: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        records = finished_records(setup, cells)
        for cell in cells:
            state = ("refused: " + cell.refused if cell.refused else
                     "finished" if cell.key in records else shown_command(setup.command(cell)))
            print(f"{cell.key}: {state}")
        seconds, basis = estimate(setup, model, cells, records)
        print(f"estimate: {seconds / 3600:.2f} h for the cells to run ({basis})")
        return 0
    if (missing := eval_missing()) is not None:
        print(f"paper_table: {missing} (--dry-run works without it)", file=sys.stderr)
        return 2
    records = run_cells(setup, cells)
    failed = [key for key, r in records.items() if "failed" in r]
    if setup.writer:
        write_tables(setup.out, cells, records, setup.tasks, args.model)
        print(f"wrote {setup.out / 'table.md'}, table.csv, table.png")
    if failed:
        print(f"paper_table: {len(failed)} cell(s) failed ({', '.join(failed)}); the table says why, and the next "
              "run with the same arguments runs them again", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
