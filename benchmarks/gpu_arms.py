"""The pretraining arms at RoBERTa-base size on a GPU (issue 30): each arm's training step (bf16 autocast, SDPA where
the class has it, fused AdamW) against RoBERTa's MLM step, side by side in one process, with tokens/s and the model
FLOP utilisation (MFU). A GPU is needed; CPU timings of the same arms are benchmarks/bench_arms.py's.

    python benchmarks/gpu_arms.py                       # 12 x 768, blocks of 512, batch 32 (the paper's recipe)
    python benchmarks/gpu_arms.py --batch 16 --steps 5 --rounds 2
    python benchmarks/bench_arms.py                     # runs it too where a GPU is (after the CPU arms)

What is timed is the project's own step (lightning_modules/mlm.py: `build_model`, `mlm_step`; the batches in the
form the collators give them: 15% masked positions for the MLM, every next token but the closing </s> for the causal arms, 15% of them
with `--data.next_token_share 0.15`), forward, backward and optimizer step, CUDA-synchronised; Lightning's loop
adds nothing to a step on a GPU (benchmarks/bench_train.py). Rounds rotate the arms' order; a ratio is the median
over rounds of the per-round ratio to that round's MLM step, printed beside the ratio of counted FLOPs. The FLOPs of a step are counted, not measured
(benchmarks/gpu_train.py's `model_flops_per_token`, tested against torch's FLOP counter: 6 x the stack's matrix
parameters, attention, the LM head on the predicted positions); MFU divides them by the step time and the device's
dense bf16 peak (gpu_train.py's table, or --peak_tflops).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_train import model_flops_per_token, peak_tflops  # noqa: E402
from lightning_modules.mlm import MLMModule, compile_step, mlm_step  # noqa: E402

ARMS = {"mlm-learned": ("mlm", "learned", 1.0), "causal-learned": ("causal", "learned", 1.0),
        "causal-none": ("causal", "none", 1.0), "mlm-rope": ("mlm", "rope", 1.0),
        "causal-rope": ("causal", "rope", 1.0), "causal-learned-matched": ("causal", "learned", 0.15)}


def batch_of(objective: str, share: float, batch: int, length: int, vocab: int, generator) -> dict:
    """A batch in the collators' form: MLM 15% of each block masked (80% <mask>), causal the next tokens."""
    ids = torch.randint(5, vocab, (batch, length), generator=generator)
    ids[:, 0], ids[:, -1] = 0, 2  # <s> ... </s>
    if objective == "mlm":
        k = predicted(objective, share, length)
        positions = torch.sort(torch.rand(batch, length - 2, generator=generator).argsort(1)[:, :k] + 1, 1).values
        targets = ids.gather(1, positions)
        inputs = ids.clone()
        inputs.scatter_(1, positions, 4)  # <mask>
        return {"input_ids": inputs, "positions": positions, "targets": targets}
    k = predicted(objective, share, length)
    positions = torch.arange(length - 2).expand(batch, -1) if share >= 1 else torch.sort(  # not the closing </s>
        torch.rand(batch, length - 2, generator=generator).argsort(1)[:, :k], 1).values
    return {"input_ids": ids, "positions": positions.contiguous(), "targets": ids.gather(1, positions + 1)}


def predicted(objective: str, share: float, length: int) -> int:
    """Predicted positions a block: the MLM's 15% of the maskable tokens, the causal arms' next tokens (or a share)."""
    if objective == "mlm":
        return round(0.15 * (length - 2))
    return length - 2 if share >= 1 else round(share * (length - 2))


def time_arm(arm: str, args, device, profile: bool = False) -> tuple[float, float]:
    """Median seconds of a step over --steps timed steps (after --warmup), and the step's counted FLOPs."""
    objective, positions, share = ARMS[arm]
    torch.manual_seed(0)
    module = MLMModule(position_embeddings=positions != "none", vocab_size=args.vocab, hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       intermediate_size=4 * args.hidden, max_position_embeddings=args.length + 2, dropout=0.1,
                       objective=objective, positions=positions,
                       pad_vocab_to_multiple_of=args.pad_vocab_to_multiple_of)
    model = module.model.to(device)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    batches = [{key: value.to(device) for key, value in batch_of(objective, share, args.batch, args.length,
                                                                     args.vocab, generator).items()}
               for _ in range(2)]
    forward = compile_step(model) if args.compile else mlm_step  # --model.compile true's graph

    def step(batch: dict) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(model, batch, vocab_size=args.vocab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step(batches[index % 2])
        torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    if profile and arm in (args.profile or []):  # where the step's GPU time goes: its kernels, by total time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            step(batches[0])
            torch.cuda.synchronize()
        print(f"profile of one {arm} step:\n" + profile.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                                            max_name_column_width=70), flush=True)
    flops = model_flops_per_token(module, args.length, predicted(objective, share, args.length)) * args.batch * args.length
    return statistics.median(times), flops  # (its model and optimizer freed on return: one arm resident at a time)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50265)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="the arms to time "
                        "(mlm-learned, the reference, always)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the step as --model.compile true does "
                        "(the first --warmup steps compile)")
    parser.add_argument("--pad_vocab_to_multiple_of", type=int, default=1, help="the LM head's rows padded to a "
                        "multiple (the fast recipe's 64; 1: RoBERTa's 50265, the paper's recipe)")
    parser.add_argument("--profile", nargs="*", default=None, choices=list(ARMS), help="print where one step of "
                        "these arms spends its GPU time (torch.profiler, the top kernels)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the device's dense bf16 peak (default: "
                        "gpu_train.py's table)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """Every arm's step on the GPU, rounds rotating the order; METRIC lines (bench_arms.py prints them as they are)."""
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, args.peak_tflops)
    print(f"METRIC gpu_arms device {name}; torch {torch.__version__}; {args.layers} x {args.hidden}, vocab "
          f"{args.vocab} (padded to a multiple of {args.pad_vocab_to_multiple_of}), batch {args.batch} x {args.length}, bf16 "
          f"autocast{', compiled' if args.compile else ''}; bf16 peak {peak} TFLOP/s", flush=True)
    arms = ["mlm-learned", *(arm for arm in args.arms if arm != "mlm-learned")]
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    flops: dict[str, float] = {}
    for round_index in range(args.rounds):
        order = arms[round_index % len(arms):] + arms[:round_index % len(arms)]
        for arm in order:
            step, flops[arm] = time_arm(arm, args, device, profile=round_index == 0)
            seconds[arm].append(step)
            torch.cuda.empty_cache()
        print(f"gpu round {round_index}: " + ", ".join(f"{arm} {seconds[arm][-1] * 1e3:.1f} ms" for arm in arms),
              flush=True)
    for arm in arms:
        step = statistics.median(seconds[arm])
        mfu = f"{flops[arm] / step / (peak * 1e12):.3f}" if peak else "unknown (no bf16 peak known: --peak_tflops)"
        print(f"METRIC {arm.replace('-', '_')}_gpu_step_ms {step * 1e3:.1f}  ({args.batch * args.length / step:,.0f} "
              f"tokens/s, {flops[arm] / 1e12:.2f} TFLOP a step, MFU {mfu})")
    for arm in arms[1:]:
        ratios = [mine / mlm for mine, mlm in zip(seconds[arm], seconds["mlm-learned"], strict=True)]
        print(f"METRIC {arm.replace('-', '_')}_gpu_step_ratio {statistics.median(ratios):.3f}  (against the MLM "
              f"step; per round {' '.join(f'{r:.3f}' for r in ratios)}; counted FLOPs "
              f"{flops[arm] / flops['mlm-learned']:.3f})")


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    if not torch.cuda.is_available():
        print("gpu_arms.py: error: no CUDA device (the CPU benchmark is benchmarks/bench_arms.py)", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
