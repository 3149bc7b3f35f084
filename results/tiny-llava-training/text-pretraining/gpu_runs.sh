#!/usr/bin/env bash
# The four text-pretraining runs of 2026-12-04, side by side on one GPU (an H200 lent through the device tool),
# at the toy study's batch (512 sequences of 128 words) for MINUTES of training each:
#   bb-bos-t8-lr3-b512  continues the committed bb-bos-t8-lr3 checkpoint (5,100 steps at batch 32 on the CPU)
#   b512-bos-t8-lr3     the same settings from scratch (<s> first, 8 triggers, lr 3e-3, weight decay 0.1)
#   b512-random-t8-lr3  a random word first (a sink would belong to position 0, not to <s>)
#   b512-bos-t3         bb-bos's settings (3 triggers, lr 1e-3, weight decay 0.3)
# Each run's folder is packed into OUT (weights, settings, sink.jsonl; the optimizer of the first two beside it).
#   bash results/tiny-llava-training/text-pretraining/gpu_runs.sh OUT MINUTES [DEVICE]     (MINUTES was 7)
# The checkpoint the first run continues is in the history (commit 233c80e) since its continuation replaced it:
#   git checkout 233c80e -- results/tiny-llava-training/text-pretraining/bb-bos-t8-lr3/checkpoint
# The first run then went on alone on the GPU for 4.2 more minutes (to step 14,713; bb-bos-t8-lr3-b512/checkpoint):
#   python -m analysis.training.pretrain_text --out runs/gpu-text/bb-bos-t8-lr3-b512 --resume --minutes 112.8 \
#     --batch 512 --check-every 1000 --device cuda
set -u
out=$1 minutes=$2 device=${3:-cuda}
runs=runs/gpu-text
rm -rf "$runs" && mkdir -p "$runs" "$out"
cp -r results/tiny-llava-training/text-pretraining/bb-bos-t8-lr3/checkpoint "$runs/bb-bos-t8-lr3-b512"
total=$(python3 -c "import json; print(json.load(open('$runs/bb-bos-t8-lr3-b512/state.json'))['elapsed'] / 60 + $minutes)")
common=(--batch 512 --check-every 500 --device "$device" --threads 2)
fresh=(--vision-from assets/tiny-llava --minutes "$minutes")
python3 -m analysis.training.pretrain_text --out "$runs/bb-bos-t8-lr3-b512" --resume --minutes "$total" "${common[@]}" \
  >"$runs/bb-bos-t8-lr3-b512.log" 2>&1 &
python3 -m analysis.training.pretrain_text --out "$runs/b512-bos-t8-lr3" --first bos --triggers 8 --lr 3e-3 --weight-decay 0.1 \
  "${fresh[@]}" "${common[@]}" >"$runs/b512-bos-t8-lr3.log" 2>&1 &
python3 -m analysis.training.pretrain_text --out "$runs/b512-random-t8-lr3" --first random --triggers 8 --lr 3e-3 \
  --weight-decay 0.1 "${fresh[@]}" "${common[@]}" >"$runs/b512-random-t8-lr3.log" 2>&1 &
python3 -m analysis.training.pretrain_text --out "$runs/b512-bos-t3" --first bos --triggers 3 --lr 1e-3 --weight-decay 0.3 \
  "${fresh[@]}" "${common[@]}" >"$runs/b512-bos-t3.log" 2>&1 &
wait
for run in bb-bos-t8-lr3-b512 b512-bos-t8-lr3 b512-random-t8-lr3 b512-bos-t3; do
  tail -n 3 "$runs/$run.log" | cut -c1-400
  mv "$runs/$run.log" "$runs/$run/train-gpu.log"
  tar -cf "$out/$run.tar" -C "$runs" --exclude optimizer.pt "$run"
done
cp "$runs/bb-bos-t8-lr3-b512/optimizer.pt" "$out/bb-bos-t8-lr3-b512.optimizer.pt"
cp "$runs/b512-bos-t8-lr3/optimizer.pt" "$out/b512-bos-t8-lr3.optimizer.pt"
ls -la "$out"
