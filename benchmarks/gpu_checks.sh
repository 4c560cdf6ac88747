#!/usr/bin/env bash
# The GPU checks and benchmarks of ds_uniep, on one host with N >= 2 GPUs:
#   bash benchmarks/gpu_checks.sh OUTDIR [tests] [gemm] [dispatch] [layer] [commfuse] [hybrid] [gpt] [gpt_swiglu]
#   (default: all)
# GPU tests (kernels, megakernel vs reference layer, determinism over NCCL,
# CommFuse over NCCL), then the benchmarks, then a 20-step GPT-MoE training run
# per backend (gpt), and the SwiGLU GPT-MoE example sequential vs fused (gpt_swiglu). Each step's
# log goes to OUTDIR; a summary is printed last. The tests step runs each GPU test file on its own
# (GPU_TEST_LANES=N: N files at a time, ranks of different files then share the GPUs) and prints a
# table of file, exit status, seconds and pytest's summary (OUTDIR/tests/table.txt);
# GPU_TEST_FILTER=EXPR passes `-k EXPR` to pytest (e.g. '4 or four' for the 4-rank cases).
set -u
OUT=${1:?usage: gpu_checks.sh OUTDIR [tests] [gemm] [dispatch] [layer] [multinode] [commfuse] [hybrid] [gpt] [gpt_swiglu]}
shift
WANT=" ${*:-tests gemm dispatch layer multinode commfuse hybrid gpt gpt_swiglu} "
want() { [[ $WANT == *" $1 "* ]]; }
mkdir -p "$OUT"
export DS_ACCELERATOR=cuda NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
declare -A STATUS

step() {  # step NAME CMD...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  tail -n 40 "$OUT/$name.log"
}

gpu_tests() {  # every test file with tests that need GPUs (conftest's needs_gpus), one pytest run each
  local lanes=${GPU_TEST_LANES:-1} files=() i k=()
  [[ -n ${GPU_TEST_FILTER:-} ]] && k=(-k "$GPU_TEST_FILTER")
  mapfile -t files < <(python3 -m pytest --collect-only -q -m gpu "${k[@]}" tests 2>/dev/null | grep '::' | cut -d: -f1 |
    sort -u)
  if [[ ${#files[@]} -eq 0 ]]; then echo "no GPU tests collected"; return 5; fi
  mkdir -p "$OUT/tests" && rm -f "$OUT"/tests/lane*.txt
  for ((i = 0; i < lanes; i++)); do
    (
      for ((j = i; j < ${#files[@]}; j += lanes)); do
        local f=${files[j]} t0=$SECONDS rc
        python3 -m pytest -q -rs -m gpu "${k[@]}" "$f" > "$OUT/tests/$(basename "$f" .py).log" 2>&1
        rc=$?
        printf '%s | rc=%d | %ds | %s\n' "$f" "$rc" $((SECONDS - t0)) \
          "$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$OUT/tests/$(basename "$f" .py).log" | tail -n 1)" \
          >> "$OUT/tests/lane$i.txt"
      done
    ) &
  done
  wait
  sort "$OUT"/tests/lane*.txt > "$OUT/tests/table.txt"
  cat "$OUT/tests/table.txt"
  ! grep -q 'rc=[1-9]' "$OUT/tests/table.txt"
}

want tests && step tests gpu_tests
want gemm && step bench_grouped_gemm python3 benchmarks/bench_grouped_gemm.py --out "$OUT/gemm"
want dispatch && step bench_dispatch torchrun --nproc_per_node "$NGPU" benchmarks/bench_dispatch.py --out "$OUT/dispatch.json"
want layer && step bench_moe_layer torchrun --nproc_per_node "$NGPU" benchmarks/bench_moe_layer.py --autotune --streamed-steps 8 --out "$OUT"
if want multinode; then
  if [[ $NGPU -eq 4 ]]; then
    step bench_multinode torchrun --nproc_per_node 4 benchmarks/bench_moe_layer.py --node-size 2 \
      --backends reference autoep megakernel megakernel-pipelined-nodes --out "$OUT/multinode"
    # 20 GPT-MoE steps on one node of 4, on 2 emulated nodes of 2 (node_size in the config; also under
    # the pipelined schedule across nodes), and as two 2-GPU torchrun "nodes" rendezvousing on
    # localhost: the same losses bit for bit
    python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c.setdefault("uniep", {})["topology"] = {"node_size": 2}
json.dump(c, open(sys.argv[2], "w"), indent=2)
c["uniep"].setdefault("overlap", {})["schedule"] = "pipelined"
json.dump(c, open(sys.argv[3], "w"), indent=2)' configs/ds_config_uniep_default.json "$OUT/ds_config_node_size_2.json" \
      "$OUT/ds_config_node_size_2_pipelined.json"
    gpt_mn=(examples/gpt_moe/train.py --expert-type swiglu --expert-gemm uniep --num-experts 8
      --moe-expert-parallel-size 4 --topk 2 --disable-moe-token-dropping --create-moe-param-group --train-iters 20
      --hidden-size 256 --num-attention-heads 4 --seq-length 256 --eval-interval 1000 --log-interval 5
      --backend megakernel)
    step gpt_one_node torchrun --nproc_per_node 4 "${gpt_mn[@]}" --deepspeed_config configs/ds_config_uniep_default.json \
      --loss-log "$OUT/loss_one_node.json"
    step gpt_two_nodes torchrun --nproc_per_node 4 "${gpt_mn[@]}" --deepspeed_config "$OUT/ds_config_node_size_2.json" \
      --loss-log "$OUT/loss_two_nodes.json"
    step gpt_two_nodes_pipelined torchrun --nproc_per_node 4 "${gpt_mn[@]}" \
      --deepspeed_config "$OUT/ds_config_node_size_2_pipelined.json" --loss-log "$OUT/loss_two_nodes_pipelined.json"
    two_torchruns() {
      local n pids=()
      for n in 0 1; do
        CUDA_VISIBLE_DEVICES=$((2 * n)),$((2 * n + 1)) torchrun --nnodes 2 --nproc_per_node 2 --node_rank $n \
          --master_addr 127.0.0.1 --master_port 29533 "${gpt_mn[@]}" \
          --deepspeed_config configs/ds_config_uniep_default.json --loss-log "$OUT/loss_two_torchruns.json" &
        pids+=($!)
      done
      wait "${pids[0]}" && wait "${pids[1]}"
    }
    step gpt_two_torchruns two_torchruns
  else
    echo "=== bench_multinode: skipped (2 emulated nodes of 2 GPUs: needs exactly 4 GPUs, found $NGPU)"
    STATUS[bench_multinode]="skipped: $NGPU GPUs, needs 4"
  fi
fi
want commfuse && step bench_commfuse torchrun --nproc_per_node "$NGPU" benchmarks/bench_commfuse.py --out "$OUT/commfuse"
if want hybrid; then
  if [[ $NGPU -eq 4 ]]; then
    step bench_hybrid torchrun --nproc_per_node 4 benchmarks/bench_hybrid.py --out "$OUT/hybrid"
  else
    echo "=== bench_hybrid: skipped (it runs 2 sites of 2 GPUs: needs exactly 4 GPUs, found $NGPU)"
    STATUS[bench_hybrid]="skipped: $NGPU GPUs, needs 4"
  fi
fi
want gpt && for backend in deepspeed reference megakernel megakernel_again; do
  gemm_flag=(); [[ $backend == megakernel* ]] && gemm_flag=(--expert-gemm uniep)
  step "gpt_$backend" python3 -m deepspeed.launcher.runner --num_gpus "$NGPU" examples/gpt_moe/train.py \
    --deepspeed_config configs/ds_config_uniep_zero0_bf16.json --num-experts $((2 * NGPU)) \
    --moe-expert-parallel-size "$NGPU" --topk 2 --train-iters 20 --hidden-size 256 --num-attention-heads 4 \
    --seq-length 256 --eval-interval 1000 --log-interval 5 --backend "${backend%_again}" \
    --loss-log "$OUT/loss_$backend.json" "${gemm_flag[@]}"
done
# SwiGLU experts (grouped GEMMs), dropless, ZeRO 2: stock DeepSpeed MoE; the megakernel's sequential
# schedule; the fused schedule (epilogue combines only, twice) and the fused one with its dispatch in
# interleaved roles (twice); the sequential schedule replayed from CUDA graphs under ZeRO 2, and eager and
# replayed under ZeRO 0
want gpt_swiglu && for run in stock sequential graph_zero2 fused fused_again interleaved interleaved_again \
    sequential_zero0 graph; do
  cfg=configs/ds_config_uniep_fused.json; run_flags=(--expert-gemm uniep --backend megakernel)
  [[ $run == stock || $run == sequential || $run == graph_zero2 ]] && cfg=configs/ds_config_uniep_default.json
  [[ $run == sequential_zero0 || $run == graph ]] && cfg=configs/ds_config_uniep_zero0_bf16.json
  [[ $run == interleaved* ]] && cfg=configs/ds_config_uniep_fused_interleaved.json
  [[ $run == stock ]] && run_flags=(--backend deepspeed)
  [[ $run == graph* ]] && run_flags+=(--cuda-graph)
  step "gpt_swiglu_$run" python3 -m deepspeed.launcher.runner --num_gpus "$NGPU" examples/gpt_moe/train.py \
    --deepspeed_config "$cfg" --expert-type swiglu --num-experts $((2 * NGPU)) \
    --moe-expert-parallel-size "$NGPU" --topk 2 --disable-moe-token-dropping --create-moe-param-group \
    --train-iters 20 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --eval-interval 1000 \
    --log-interval 5 "${run_flags[@]}" --loss-log "$OUT/loss_swiglu_$run.json"
done

echo "=== summary (ngpu=$NGPU)"
for k in "${!STATUS[@]}"; do echo "$k ${STATUS[$k]}"; done | sort
grep -h "final:" "$OUT"/gpt_*.log 2>/dev/null || true
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
logs = {}
for b in ("deepspeed", "reference", "megakernel", "megakernel_again", "swiglu_stock", "swiglu_sequential",
          "swiglu_sequential_zero0", "swiglu_graph", "swiglu_graph_zero2", "swiglu_fused",
          "swiglu_fused_again", "swiglu_interleaved", "swiglu_interleaved_again", "one_node", "two_nodes",
          "two_nodes_pipelined", "two_torchruns"):
    p = os.path.join(out, f"loss_{b}.json")
    if os.path.exists(p):
        logs[b] = {int(k): float.fromhex(v) if isinstance(v, str) else v for k, v in json.load(open(p)).items()}
if "megakernel" in logs and "megakernel_again" in logs:
    print("megakernel losses bitwise equal across two runs:", logs["megakernel"] == logs["megakernel_again"])
for b in ("swiglu_fused", "swiglu_fused_again", "swiglu_interleaved", "swiglu_interleaved_again"):
    if b in logs and "swiglu_sequential" in logs:
        print(f"{b} losses bitwise equal to the sequential schedule's:", logs[b] == logs["swiglu_sequential"])
if "swiglu_graph_zero2" in logs and "swiglu_sequential" in logs:
    print("swiglu_graph_zero2 losses (ZeRO 2) bitwise equal to the eager run's:",
          logs["swiglu_graph_zero2"] == logs["swiglu_sequential"])
if "swiglu_graph" in logs and "swiglu_sequential_zero0" in logs:
    print("swiglu_graph losses (ZeRO 0) bitwise equal to the eager run's:",
          logs["swiglu_graph"] == logs["swiglu_sequential_zero0"])
for b in ("two_nodes", "two_nodes_pipelined", "two_torchruns"):
    if b in logs and "one_node" in logs:
        print(f"{b} losses bitwise equal to one node's:", logs[b] == logs["one_node"])
if "megakernel" in logs and "reference" in logs:
    d = max(abs(logs["megakernel"][s] - logs["reference"][s]) for s in logs["reference"])
    print(f"max |loss megakernel - reference| over 20 steps: {d:.3e}")
for b, l in logs.items():
    print(b, "step0", round(l[min(l)], 4), "last", round(l[max(l)], 4))
PY
