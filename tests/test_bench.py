"""`make bench` kept from rotting: benchmarks/run_all.py --smoke runs every script, each prints finite ratios, and the
runner's table holds exactly those ratios with the verdicts their targets give; the FLOP count behind the GPU MFU
lines equals torch's own count of a training step.

    .venv/bin/pytest tests/test_bench.py -q
"""

from __future__ import annotations

import importlib.util
import math
import operator
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RATIO = re.compile(r"^RATIO (\S+) (\S+) target (<=|>=)(\S+)$")
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(\S+)\s+(<=|>=)(\S+)\s+(ok|MISSED)$")
OPS = {"<=": operator.le, ">=": operator.ge}
PER_ROUND = re.compile(r"^METRIC (\S+)_per_round ([^\n]+)$", re.M)
SINGLE = re.compile(r"^(?:RATIO|METRIC) (\S+) (-?[\d.]+(?:e[-+]?\d+)?)(?:\s|$)", re.M)  # a number, not a word
GPU_METRIC = re.compile(r"^METRIC (fast_seq\d+_\w+?_(?:tokens_per_s|mfu|sync_warnings)) (\S+)", re.M)


@pytest.mark.slow
def test_bench_smoke_runs_every_script_and_tabulates_what_each_printed():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out, table_at = done.stdout, done.stdout.index("\nscript ")
    sections = re.split(r"^== (\S+)[^\n]*\n", out[:table_at], flags=re.M)[1:]
    printed = dict(zip(sections[::2], sections[1::2]))
    assert sorted(printed) == sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert sum(map(medians_of_rounds, printed.values())) > 0
    expected = []
    for script, text in printed.items():
        ratios = [RATIO.match(line).groups() for line in text.splitlines() if RATIO.match(line)]
        assert ratios, f"{script} printed no RATIO line"
        for name, value, op, target in ratios:
            assert math.isfinite(float(value)) and float(value) > 0, (script, name, value)
            verdict = "ok" if OPS[op](float(value), float(target)) else "MISSED"
            expected.append((Path(script).stem, name, f"{float(value):.3f}", op, target, verdict))
    table = [ROW.match(line.strip()).groups() for line in out[table_at:].splitlines() if ROW.match(line.strip())]
    assert [(s, n, v, o, str(float(t)), r) for s, n, v, o, t, r in table] == \
        [(s, n, v, o, str(float(t)), r) for s, n, v, o, t, r in expected]
    ok = sum(row[-1] == "ok" for row in expected)
    assert f"{ok}/{len(expected)} ratios within target (smoke mode: sizes too small to judge)" in out
    gpu = {match.group(1): float(match.group(2)) for match in GPU_METRIC.finditer(printed["bench_train.py"])}
    if not torch.cuda.is_available():  # the GPU lines are replaced by a note, not left out silently
        assert "note: no CUDA device: roberta-base tokens/s and MFU" in printed["bench_train.py"] and gpu == {}
        return
    # on a GPU (smoke: length 128, eager): tokens/s of the bare loop and of the production configuration of the fast
    # config, MFU wherever the peak is known, and no synchronisation warning over the production run's ordinary steps
    names = [f"fast_seq128_{kind}_eager" for kind in ("bare", "production")]
    with_mfu = _bench_train().peak_tflops(torch.cuda.get_device_name(0), None) is not None
    assert with_mfu or "note: no bf16 peak known" in printed["bench_train.py"]
    assert sorted(gpu) == sorted([f"{name}_tokens_per_s" for name in names] + [f"{name}_mfu" for name in names] *
                                 with_mfu + ["fast_seq128_production_eager_sync_warnings"])
    assert gpu.pop("fast_seq128_production_eager_sync_warnings") == 0, printed["bench_train.py"]
    assert all(math.isfinite(value) and value > 0 for value in gpu.values()), gpu
    assert all(gpu[f"{name}_mfu"] < 1 for name in names if with_mfu)  # a utilisation: a share of the peak
    measured = {row.split()[1] for row in out[table_at:].splitlines() if row.startswith("bench_train ")}
    assert set(gpu) <= measured  # the runner's measurement table lists them too


def medians_of_rounds(text: str) -> int:
    """A script's RATIO (or single METRIC) named like one of its `<name>_per_round` lines (or `<name>_ratio`) is the
    median of those rounds; both printed to 3 decimals, so equal for an odd count of rounds, within 0.001 for an even
    one (the mean of the two middle ones, each rounded). Returns how many it checked."""
    single = {match.group(1): float(match.group(2)) for match in SINGLE.finditer(text)}
    checked = 0
    for match in PER_ROUND.finditer(text):
        name, rounds = match.group(1), [float(value) for value in match.group(2).split()]
        value = single.get(name, single.get(f"{name}_ratio"))
        if value is not None:
            assert abs(value - statistics.median(rounds)) <= (len(rounds) % 2 == 0) * 1e-3 + 1e-9, \
                (name, value, rounds)
            checked += 1
    return checked


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "benchmarks" / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("position_embeddings", [True, False])
def test_mfu_flops_per_token_equal_torch_count_of_a_training_step(position_embeddings):
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_modules.mlm import MLMModule, mlm_loss

    bench = _bench_train()
    torch.manual_seed(0)
    module = MLMModule(position_embeddings=position_embeddings, vocab_size=300, hidden_size=32, num_hidden_layers=3,
                       num_attention_heads=4, intermediate_size=48, max_position_embeddings=40, dropout=0.0,
                       attn_implementation="eager")  # eager: attention as explicit matmuls, which torch counts
    batch, seq, k = 3, 24, 5
    positions = torch.stack([torch.randperm(seq - 2)[:k].sort().values + 1 for _ in range(batch)])
    inputs = {"input_ids": torch.randint(5, 300, (batch, seq)), "positions": positions,
              "targets": torch.randint(5, 300, (batch, k))}
    with FlopCounterMode(display=False) as counter:
        loss, _ = mlm_loss(module.model, inputs)
        loss.backward()
    assert bench.model_flops_per_token(module, seq, k) * batch * seq == counter.get_total_flops()


def _gpu_arms():
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("gpu_arms", ROOT / "benchmarks" / "gpu_arms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arm", ["causal-learned", "causal-none", "mlm-rope", "causal-learned-matched"])
def test_the_gpu_arms_batches_and_flops_are_each_arms_own(arm):
    """benchmarks/gpu_arms.py (run on a GPU only): its batches are the collators' form for the arm, and the counted
    FLOPs of a step of the arm's model equal torch's count of the same step."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_modules.mlm import MLMModule, mlm_loss

    bench = _gpu_arms()
    objective, positions, share = bench.ARMS[arm]
    batch, seq, vocab = 3, 24, 300
    inputs = bench.batch_of(objective, share, batch, seq, vocab, torch.Generator().manual_seed(0))
    k = bench.predicted(objective, share, seq)
    assert inputs["positions"].shape == inputs["targets"].shape == (batch, k)
    if objective == "causal":  # the next token of each predicted position, the blocks unmasked
        assert torch.equal(inputs["targets"], inputs["input_ids"].gather(1, inputs["positions"] + 1))
        assert k == (seq - 2 if share == 1 else round(share * (seq - 2)))  # never the block's closing </s>
        assert int(inputs["positions"].max()) <= seq - 3
    else:  # 15% of the maskable tokens, each replaced by <mask> (4) in the input
        assert k == round(0.15 * (seq - 2)) and bool((inputs["input_ids"].gather(1, inputs["positions"]) == 4).all())
    assert bool((inputs["positions"].diff(dim=1) > 0).all())  # sorted, distinct
    torch.manual_seed(0)
    module = MLMModule(position_embeddings=positions != "none", vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=48, max_position_embeddings=seq + 2, dropout=0.0,
                       attn_implementation="eager", objective=objective, positions=positions)
    with FlopCounterMode(display=False) as counter:
        loss, _ = mlm_loss(module.model, inputs)
        loss.backward()
    assert _bench_train().model_flops_per_token(module, seq, k) * batch * seq == counter.get_total_flops()


def test_peak_lookup_prefers_the_exact_variant_and_the_override():
    """torch.cuda.get_device_name's strings against NVIDIA's datasheets (dense bf16 tensor-core TFLOPS, no sparsity):
    H100 SXM 989, H100 PCIe 756, H100 NVL 835 (per GPU), H200 989, A100 312."""
    bench = _bench_train()
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", None) == pytest.approx(989, abs=1)
    assert bench.peak_tflops("NVIDIA H100 PCIe", None) == pytest.approx(756, abs=1)
    assert bench.peak_tflops("NVIDIA H100 NVL", None) == pytest.approx(835, abs=1)
    assert bench.peak_tflops("NVIDIA H200", None) == pytest.approx(989, abs=1)
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB", None) == pytest.approx(312, abs=1)
    assert bench.peak_tflops("Some Future GPU", None) is None
    assert bench.peak_tflops("NVIDIA H100 PCIe", 123.0) == 123.0


def test_sync_warnings_count_synchronisations_not_torchs_notice_on_turning_the_mode_on():
    """torch warns once that its sync debug mode "is a prototype feature" when the mode is turned on: an H200 run
    counted that notice as a synchronisation (1 over 97 steps); a real synchronisation warning still counts."""
    import warnings

    gpu_train = importlib.import_module("benchmarks.gpu_train")
    caught: list[str] = []
    with gpu_train.sync_warnings(caught):
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
                      "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)", stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp)",
                      stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp)",
                      stacklevel=1)
    assert caught == ["called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp)"] * 2


def test_the_gpu_lines_code_path_on_cpu_with_cuda_stubbed(monkeypatch, capsys):
    """benchmarks/gpu_train.py's run_gpu (smoke: length 128, eager, bare and production) on the CPU, torch.cuda
    stubbed: the GPU path keeps running between GPU sessions. Its MFU line is tokens/s x the counted FLOPs / the peak
    (a peak of 1 MFLOP/s given, so that the tiny model's MFU on a CPU is not 0.000 whatever the formula), and turning
    the sync debug mode on (which makes torch warn that it is a prototype) counts no synchronisation."""
    import argparse
    import warnings

    gpu_train = importlib.import_module("benchmarks.gpu_train")
    monkeypatch.setattr(gpu_train, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_train, "ACCELERATOR", "cpu")
    monkeypatch.setattr(gpu_train, "VOCAB", 500)
    merged = gpu_train.merged_config

    def small(name):
        config = merged(name)
        config["model"].update(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        config["data"]["num_workers"] = 0
        return config

    def turned(mode):
        if mode == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations", stacklevel=2)

    monkeypatch.setattr(gpu_train, "merged_config", small)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", turned)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: "NVIDIA H200")
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = argparse.Namespace(peak_tflops=1e-6, gpu_config="fast", smoke=True, gpu_batch_512=1, gpu_warmup=2,
                              gpu_steps=6)
    gpu_train.run_gpu(args)
    metrics = {match.group(1): float(match.group(2)) for match in
               re.finditer(r"^METRIC (\S+) (\S+)", capsys.readouterr().out, re.M)}
    module = gpu_train.MLMModule(**{**small("fast")["model"], "vocab_size": 500, "compile": False})
    flops = gpu_train.model_flops_per_token(module, 128, round(0.15 * 126))
    for kind in ("bare", "production"):
        tokens = metrics[f"fast_seq128_{kind}_eager_tokens_per_s"]
        assert tokens > 0
        assert metrics[f"fast_seq128_{kind}_eager_mfu"] == pytest.approx(tokens * flops / 1e6, rel=1e-3)
    assert metrics["fast_seq128_production_eager_sync_warnings"] == 0


@pytest.mark.parametrize("script", sorted(path.name for path in (ROOT / "benchmarks").glob("*.py")
                                          if "\ndef main(" in path.read_text(encoding="utf-8")))
def test_every_benchmark_refuses_an_abbreviated_option(script, monkeypatch, capsys):
    """`--hel` is no `--help` (argparse's allow_abbrev): exit 2 naming it, as the entry points refuse `--enc`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [script, "--hel"])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    assert stopped.value.code == 2 and "unrecognized arguments: --hel" in capsys.readouterr().err
