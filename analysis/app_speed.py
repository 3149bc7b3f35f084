"""What a visitor waits for on a CPU: `/analyze` and `/sweep` through the real app, as ratios to one unpruned prefill.

    python -m analysis.app_speed                   # llava-interleave-qwen-0.5b's real shape (0.92 B), 2 threads
    python -m analysis.app_speed --smoke           # the same code on a tiny shape (seconds; tested)
    python -m analysis.app_speed --stages --base /tmp/hap-before   # /analyze per stage, this checkout and another

Builds a random-weight model of the checkpoint's real shape offline (`SHAPES`: SigLIP tower, Qwen2 decoder, its
vocabulary; no download), with a processor built here (the small model's word-level tokenizer, SigLIP's 384-px image
processing: 729 visual tokens), and saves it to a folder. Then, in one run on one machine:
1. one plain unpruned prefill (`model(**inputs)`, vision tower included), median of `--repeats`, in this process,
   before the requests and again after them (the mean of the two: the machine's speed drifts);
2. for each mode, `before` (HAP_APP_SHARE=0: every run from the pixels, each answer decoded alone, as before the
   sharing) and `after` (HAP_APP_SHARE=1, the default): `python -m app` serving that folder, a warm-up `/analyze` on
   another scene (the load), then `/analyze` with causal off, with causal auto and with causal off and the opt-in
   comparison of every method (`keeps`; each the median of `--repeats`, each from a new client) and `/sweep`, each timed from the client (`gradio_client`, the real handler and queue).
Each time is printed as a ratio to the prefill. Random weights answer nonsense and never emit the end of the
sequence, so every answer of the page runs to its 32-token limit: upper bounds for a real checkpoint, which stops at
its end-of-sequence token (the table says what the decode steps cost). The tokenizer's vocabulary is filled to the
model's (made-up words), so that every id the model emits decodes to a word, as with a real tokenizer: the sweep,
which stops an answer once its first words are known, stops as it would on real text.
Writes `<slug>.json` and `<slug>.md` under `--out` (default results/app_speed).

`--stages`: `/analyze` (causal off) per stage instead, as shares of one prefill: the same model folder served in-process
by `app/stages.py` (every stage's function timed where it runs, the payload as the client's time less the
handler's) in this checkout and, with `--base`, in another one (a `git worktree` of an older commit), one after the
other in this run, each with its own plain prefill measured in its process; writes `<slug>.stages.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gradio_client import Client, handle_file
from PIL import Image
from transformers import (LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config,
                          SiglipImageProcessorPil, SiglipVisionConfig)

from analysis.training.tiny_vlm import CHAT_TEMPLATE, build_tokenizer
from hap.runs.run import chat_prompt

ROOT = Path(__file__).resolve().parent.parent
SCENE = ROOT / "assets" / "examples" / "scene_600000.png"
WARMUP = ROOT / "assets" / "examples" / "scene_600001.png"  # another image: the timed requests find no cached pass
PROMPT = "what color is the square ?"
SHAPES = {  # the real checkpoints' configs (llava-interleave-qwen-0.5b: SigLIP-so400m 26 layers, Qwen2-0.5B)
    "llava-hf/llava-interleave-qwen-0.5b-hf": dict(
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16),
        text=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936)),
    "smoke": dict(  # the same families and image size, tiny widths
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)),
}
PAGE_TOKENS = 32  # app.pipeline.MAX_NEW_TOKENS: the longest answer the page generates
IMAGE_SIZE, PATCH = 384, 14  # 27 x 27 = 729 visual tokens, SigLIP has no [CLS]
MODES = {"before": "0", "after": "1"}
STAGES = {  # the breakdown's rows (`stage_rows`): what each measures, as `app/stages.py` times them
    "vision": "vision pass (the tower and projector, once: the runs share the image's features)",
    "prefill": "a run's decoder prefill, its hooks included (one row per run, in order)",
    "scoring": "of which capture, scoring and selection, every run (the traced run's tracing included)",
    "tracing": "of which tracing: the maps recorded for the figures",
    "decode": "decode: the three answers as one batch",
    "figures": "figures: the view data and every view",
    "present": "presenting: cards, texts, JSON, the images written to files",
    "other": "the handler's rest: checks, loading the image, generate's setup, the results",
    "payload": "payload: gradio's processing of the outputs, the JSON and its transfer",
    "total": "total: the client's wait for `/analyze`",
}
PROBE = ROOT / "app" / "stages.py"  # run by its path in each checkout timed (`--stages`)


def build(name: str) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A random-weight LLaVA of `SHAPES[name]` and its offline processor."""
    shape = SHAPES[name]
    tokenizer = build_tokenizer(size=shape["text"]["vocab_size"])  # every id the model emits is a word
    tokenizer.model_max_length = 4096
    processor = LlavaProcessor(
        image_processor=SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="full", num_additional_image_tokens=0,
        chat_template=CHAT_TEMPLATE)
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(image_size=IMAGE_SIZE, patch_size=PATCH, **shape["vision"]),
        text_config=Qwen2Config(**shape["text"], max_position_embeddings=32768, rope_theta=1e6,
                                tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        image_token_index=tokenizer.image_token_id, vision_feature_select_strategy="full", vision_feature_layer=-1,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.set_attn_implementation("sdpa")
    return model, processor


def prefill_seconds(model, processor, repeats: int) -> tuple[float, float, float]:
    """Median seconds of (one plain unpruned prefill of the scene and prompt, vision tower included, as
    `model(**inputs)` runs it: logits at every position; the same with the last position's logits only, as a
    generation's prefill runs it; one decode step after it: the difference of 9 and 1 generated tokens, over 8)."""
    inputs = processor(images=Image.open(SCENE).convert("RGB"), text=chat_prompt(processor, PROMPT),
                       return_tensors="pt")

    def median(call) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def generate(tokens: int):
        return lambda: model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    with torch.inference_mode():
        model(**inputs)  # warm-up
        prefill, last = median(lambda: model(**inputs)), median(lambda: model(**inputs, logits_to_keep=1))
        return prefill, last, (median(generate(9)) - median(generate(1))) / 8


def serve(folder: Path, share: str, port: int, threads: int) -> subprocess.Popen:
    """`python -m app` serving only `folder`, with the sharing on ("1") or off ("0")."""
    env = {**os.environ, "HAP_APP_MODELS": str(folder), "HAP_APP_ALLOW_LOCAL": "1", "HAP_APP_SHARE": share,
           "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def connect(port: int, proc: subprocess.Popen, seconds: float = 300) -> Client:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited with {proc.returncode} before serving")
        try:
            return Client(f"http://127.0.0.1:{port}/", verbose=False)
        except Exception:  # not serving yet
            time.sleep(1)
    raise SystemExit(f"the app did not serve within {seconds:.0f} s")


def requests(connect_client, folder: Path, repeats: int) -> dict[str, float]:
    """Seconds of the load (a warm-up /analyze on another scene), /analyze with causal off and auto and with causal
    off and the opt-in comparison of every method (`keeps`; each the median of `repeats`, each from a new client: a
    new session, so no image features kept from before), /sweep (once: a repeat would read the app's sweep cache)."""
    def analyze(client: Client, image: Path, causal: str | None, keeps: bool = False) -> float:
        t0 = time.perf_counter()
        client.predict(image=handle_file(str(image)), prompt=PROMPT, model_name=str(folder), causal=causal,
                       keeps=keeps, api_name="/analyze")
        return time.perf_counter() - t0

    out = {"load": analyze(connect_client(), WARMUP, "off")}
    for key, causal, keeps in (("analyze_off", "off", False), ("analyze_auto", None, False),
                               ("analyze_keeps", "off", True)):
        out[key] = statistics.median(analyze(connect_client(), SCENE, causal, keeps) for _ in range(repeats))
    client = connect_client()
    t0 = time.perf_counter()
    client.predict(image=handle_file(str(SCENE)), prompt=PROMPT, model_name=str(folder), api_name="/sweep")
    out["sweep"] = time.perf_counter() - t0
    return out


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def markdown(report: dict) -> str:
    p, g = report["prefill_s"], report["prefill_last_s"]
    lines = [f"# /analyze and /sweep in prefills ({report['model']}, {report['parameters'] / 1e9:.2f} B parameters, "
             f"{report['threads']} threads)", "",
             f"`{report['command']}`; one unpruned prefill {p:.2f} s as `model(**inputs)` runs it (vision tower "
             "included, logits at every position; "
             + " and ".join(f"{t:.2f}" for t in report["prefill_before_after_s"]) + " s before and after the "
             f"requests), {g:.2f} s with the last position's logits only, as a generation's prefill runs it; one "
             f"decode step {report['decode_step_s']:.3f} s. Each time is given in both prefills (`plain | "
             "generation`). Random weights never emit the end of the "
             f"sequence: each of the page's answers runs to its {PAGE_TOKENS}-token limit ({PAGE_TOKENS - 1} decode "
             f"steps, {(PAGE_TOKENS - 1) * report['decode_step_s'] / p:.2f} plain prefills for one answer alone; "
             "`after` decodes the three as one batch), where a real checkpoint's short answer stops after a few; the "
             "sweep stops each answer after its first words as it would on a real model. `/analyze` rows: the "
             f"median of {report['repeats']} requests, each from a new client.", "",
             "| request | " + " | ".join(f"{m} s (plain \\| generation prefills)" for m in report["modes"])
             + " | target |",
             "|---|" + "---|" * len(report["modes"]) + "---|"]
    targets = {"analyze_off": "1.8", "analyze_auto": "4", "analyze_keeps": "", "sweep": "9", "load": ""}
    for key in targets:
        cells = [f"{t[key]:.1f} ({t[key] / p:.2f} \\| {t[key] / g:.2f})" for t in report["modes"].values()]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {targets[key]} |")
    return "\n".join(lines) + "\n"


def probe(folder: Path, checkout: Path, repeats: int, threads: int) -> dict:
    """`app/stages.py`'s report of `/analyze` per stage, served from `checkout` (its code first on the
    path)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stages.json"
        env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
               "GRADIO_ANALYTICS_ENABLED": "False"}
        subprocess.run([sys.executable, str(PROBE), "--model", str(folder), "--repeats", str(repeats), "--threads",
                        str(threads), "--json", str(out)], cwd=checkout, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def stage_rows(report: dict) -> dict[str, tuple[float, float] | None]:
    """The breakdown of one probe's report (`STAGES`) by row: (seconds, share of the request's own plain
    prefill), each the median over its requests. Each run's prefill is its own row (`prefill <run>`, its hooks
    included), `scoring` and `tracing` parts of them, the handler's `other` what its own time holds beyond the
    prefills, `payload` the client's time beyond the handler's (None: a stage the checkout has no function of, counted
    in `other`)."""
    def one(request: dict) -> dict[str, float | None]:
        seconds, runs = request["stages"], request["runs"]
        tracing = seconds.get("tracing", 0.0)
        handled = sum(seconds.values())  # the handler's own time and every stage nested in it
        row = {"vision": seconds.get("vision", 0.0)}
        row.update({f"prefill {r['label']}": r["prefill_s"] for r in runs})
        row.update(scoring=sum(r["scoring_s"] for r in runs), tracing=tracing, decode=seconds.get("decode", 0.0),
                   figures=seconds.get("figures", 0.0), present=seconds.get("present"),
                   other=seconds["handler"] - (sum(r["prefill_s"] for r in runs) - tracing),
                   payload=request["client"] - handled, total=request["client"])
        return row

    rows = [(one(r), r["prefill_s"]) for r in report["requests"]]
    return {k: None if rows[0][0][k] is None else (statistics.median(r[k] for r, _ in rows),
                                                   statistics.median(r[k] / unit for r, unit in rows))
            for k in rows[0][0]}


def stages_markdown(reports: dict[str, dict], command: str) -> str:
    """The per-stage table of `reports` (by checkout name): seconds and shares of the request's own plain prefill."""
    rows = {name: stage_rows(r) for name, r in reports.items()}
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    keys.sort(key=lambda k: list(STAGES).index(k.split(" ")[0]) if k.split(" ")[0] in STAGES else len(STAGES))
    units = {name: [round(q["prefill_s"], 2) for q in r["requests"]] for name, r in reports.items()}
    lines = [f"# /analyze per stage, in plain prefills ({command})", "",
             "Each `/analyze` (causal off, a scene of its own, a new client) against one plain unpruned prefill "
             "(`model(**inputs)`, vision tower included) timed in the same process, the mean of the one before it "
             "and the one after it: " + "; ".join(f"{name} {', '.join(map(str, u))} s" for name, u in units.items())
             + ". Each cell: the median over the requests of the seconds (the share of that prefill).", "",
             "| stage | " + " | ".join(f"{name} s (prefills)" for name in reports) + " |",
             "|---|" + "---|" * len(reports)]
    for key in keys:
        what = f"prefill, {key.removeprefix('prefill ')} (its hooks included)" if key.startswith("prefill ") else (
            STAGES.get(key, key))
        cells = ["-" if r.get(key) is None else f"{r[key][0]:.3f} ({r[key][1]:.3f})" for r in rows.values()]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=[n for n in SHAPES if n != "smoke"], default=next(iter(SHAPES)))
    p.add_argument("--smoke", action="store_true", help="a tiny shape: the same code in seconds")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "results" / "app_speed"))
    p.add_argument("--stages", action="store_true", help="/analyze per stage (app/stages.py) instead")
    p.add_argument("--base", help="with --stages: another checkout timed the same way first (e.g. a git worktree)")
    args = p.parse_args(argv)
    if args.base and not args.stages:
        p.error("--base needs --stages")
    if args.base and not (Path(args.base) / "app" / "layout.py").is_file():
        p.error(f"--base {args.base} is not a checkout of this project (no app/layout.py)")
    name = "smoke" if args.smoke else args.model
    torch.set_num_threads(args.threads)
    model, processor = build(name)
    report = {"command": "python -m analysis.app_speed " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": name, "parameters": sum(t.numel() for t in model.parameters()), "threads": args.threads,
              "repeats": args.repeats,
              "torch": torch.__version__, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
        if args.stages:
            del model  # the probes load the folder themselves
            checkouts = {**({"base": Path(args.base).resolve()} if args.base else {}), "this": ROOT}
            reports = {name: probe(folder, path, args.repeats, args.threads) for name, path in checkouts.items()}
            report["stages"] = reports
            text = stages_markdown(reports, report["command"])
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            slug = name.split("/")[-1]
            (out / f"{slug}.stages.json").write_text(json.dumps(report, indent=1))
            (out / f"{slug}.stages.md").write_text(text)
            print(text)
            return report
        first = prefill_seconds(model, processor, args.repeats)
        for mode in args.modes:
            port = free_port()
            proc = serve(folder, MODES[mode], port, args.threads)
            try:
                report["modes"][mode] = requests(lambda: connect(port, proc), folder, args.repeats)
            finally:
                proc.terminate()
                proc.wait(60)
        last = prefill_seconds(model, processor, args.repeats)  # the machine's speed again, after the requests
        report["prefill_before_after_s"] = [first[0], last[0]]
        report["prefill_s"], report["prefill_last_s"], report["decode_step_s"] = (
            statistics.mean(pair) for pair in zip(first, last))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = name.split("/")[-1]
    (out / f"{slug}.json").write_text(json.dumps(report, indent=1))
    (out / f"{slug}.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
