"""Cost of the pretraining arms (lightning_modules/arms.py): the training step of each causal and rotary arm against
RoBERTa's MLM step of the same size, side by side in one run, on the tiny MLM config (issue 30).

    python benchmarks/bench_arms.py             # configs/pretrain/tiny.yaml (4 layers, 128 wide, blocks of 128)
    python benchmarks/bench_arms.py --quick     # fewer steps and rounds
    python benchmarks/bench_arms.py --smoke     # a 2-layer model, 2 timed steps (tests/test_bench.py)

Each round trains every arm from the same seed (`--model.objective`, `--model.positions`; everything else the config's),
in an order that rotates with the round; timed: optimizer steps 1..--steps (step 0 holds the one-time set-up), no
logger, no callbacks, no validation. A ratio is the median over rounds of the paired per-round ratio of wall times to
the round's mlm-learned run (RobertaForMaskedLM, the default). One intra-op thread by default. Output: `RATIO
<arm>_step` for causal-learned, causal-none, mlm-rope and causal-rope (target <= 1.10 each), with the per-round
ratios and the median ratio of process CPU times as METRIC lines. A causal arm predicts every next token (T - 2 per
block) where the MLM predicts 15% of them: the LM head and its cross-entropy run on ~6.7 times the positions, which is
the objective's own cost (docs/benchmarks.md). So the script also times the stack alone (embeddings and layers,
forward and backward of the same blocks, no LM head, in this process, interleaved over --rounds x 5 repeats):
`METRIC <arm>_stack_cpu_time_ratio`, what the causal mask and the rotary attention cost by themselves; and
`METRIC causal_learned_matched_step...`: the causal-learned step predicting as many tokens as the MLM
(`--data.next_token_share 0.15`, ours, not the default). Beside each ratio: the arm's counted training FLOPs a step over
the MLM's (`METRIC <arm>_step_counted_flop_ratio`, gpu_train.py's `model_flops_per_token`) and the time ratio over
that FLOP ratio (`METRIC <arm>_step_time_per_flop_ratio`): what the arm's implementation costs beyond its arithmetic.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import time  # noqa: E402

import gpu_arms  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from bench_regularizer import rotated_rounds, step_timing_options  # noqa: E402

from benchmarks.gpu_train import model_flops_per_token  # noqa: E402
from lightning_modules.mlm import MLMModule  # noqa: E402

ARMS = ("mlm-learned", "causal-learned", "causal-none", "mlm-rope", "causal-rope", "causal-learned-matched")


def arm_args(arm: str) -> list[str]:
    objective, positions = arm.split("-")[:2]
    matched = ["--data.next_token_share", "0.15"] if arm.endswith("-matched") else []
    return ["--model.objective", objective, "--model.positions", positions, *matched]


def stack_times(small: dict | None, rounds: int, repeats: int = 5) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Process CPU time of `repeats` forward + backward passes of each arm's stack (no LM head) on the same random
    blocks, the arms interleaved, once per round; and each arm's counted training FLOPs a token, its LM head on the
    positions it predicts (benchmarks/gpu_train.py's `model_flops_per_token`)."""
    config = yaml.safe_load((ROOT / "configs" / "pretrain" / "tiny.yaml").read_text())
    model = {**config["model"], **((small or {}).get("model") or {})}
    data = {**config["data"], **((small or {}).get("data") or {})}
    sizes = {key: model[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "intermediate_size", "max_position_embeddings", "dropout")}
    blocks = torch.randint(5, data["vocab_size"], (data["batch_size"], data["block_length"]),
                           generator=torch.Generator().manual_seed(0))
    stacks, flops = {}, {}
    for arm in ARMS:
        objective, positions = arm.split("-")[:2]
        torch.manual_seed(0)
        module = MLMModule(objective=objective, positions=positions, vocab_size=data["vocab_size"], **sizes)
        share = 0.15 if arm.endswith("-matched") else 1.0
        flops[arm] = model_flops_per_token(module, data["block_length"],
                                           gpu_arms.predicted(objective, share, data["block_length"]))
        if not arm.endswith("-matched"):
            stacks[arm] = module.model.base_model.train()
    times: dict[str, list[float]] = {arm: [] for arm in stacks}
    names = list(stacks)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for arm in names[shift:] + names[:shift]:
            start = time.process_time()
            for _ in range(repeats):
                stacks[arm](input_ids=blocks).last_hidden_state.square().mean().backward()
            times[arm].append(time.process_time() - start)
    return times, flops


def main() -> None:
    args = step_timing_options(__doc__.split("\n\n")[0], rounds=5, quick_rounds=3,
                               steps_help="timed optimizer steps per run")
    walls, cpus, small = rotated_rounds(ARMS, arm_args, args)
    stacks, flops = stack_times(small, args.rounds)
    for arm in ARMS[1:]:
        name = f"{arm.replace('-', '_')}_step"
        if arm in stacks:
            stack = [variant / plain for variant, plain in zip(stacks[arm], stacks["mlm-learned"], strict=True)]
            print(f"METRIC {arm.replace('-', '_')}_stack_cpu_time_ratio {statistics.median(stack):.3f}  (embeddings "
                  "and layers only, forward and backward, no LM head: the arm's attention against RoBERTa's)")
        ratios = [variant / plain for variant, plain in zip(walls[arm], walls["mlm-learned"], strict=True)]
        print(f"METRIC {name}_per_round {' '.join(f'{r:.3f}' for r in ratios)}")
        counted = flops[arm] / flops["mlm-learned"]
        print(f"METRIC {name}_counted_flop_ratio {counted:.3f}  (training FLOPs a step, counted: the stack, attention "
              "and the LM head on the positions the arm predicts)")
        print(f"METRIC {name}_time_per_flop_ratio {statistics.median(ratios) / counted:.3f}  (the step's time ratio "
              "over its FLOP ratio: what the arm's implementation costs beyond its arithmetic)")
        cpu = [variant / plain for variant, plain in zip(cpus[arm], cpus["mlm-learned"], strict=True)]
        print(f"METRIC {name}_cpu_time_ratio {statistics.median(cpu):.3f}  (process CPU time, median of the rounds: "
              "less sensitive to a busy machine than wall time)")
        if arm.endswith("-matched"):  # not a default configuration: a measurement beside the ratios
            print(f"METRIC {name}_ratio {statistics.median(ratios):.3f}  (--data.next_token_share 0.15: as many "
                  "predictions a block as the MLM's, ours)")
        else:
            print(f"RATIO {name} {statistics.median(ratios):.3f} target <=1.10")
    if torch.cuda.is_available():  # the same arms at RoBERTa-base size on the GPU (benchmarks/gpu_arms.py)
        gpu_arms.run(gpu_arms.options(["--layers", "2", "--hidden", "128", "--length", "128", "--batch", "4",
                                       "--steps", "2", "--rounds", "1"] if args.smoke else []))
    else:
        print("note: no CUDA device: the arms' GPU steps at RoBERTa-base size (bf16, tokens/s, MFU) are "
              "benchmarks/gpu_arms.py's")


if __name__ == "__main__":
    main()
