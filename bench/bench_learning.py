"""Does the gradient through the prompt teach a model more? Exact against detached GRPO at a
prompt length where a small hybrid's retrieval starts to fail.

    OMP_NUM_THREADS=1 nohup .venv/bin/python bench/bench_learning.py all --work /work/learning-runs &
    ... the same command with --resume continues an interrupted plan (finished parts are kept)

The plan (`bench/configs/learning/plan.yaml`; `PROTOCOL.md` beside it says what is compared):

1. `pretrain`: supervised next-token training of a small qwen3_5 hybrid (plain PyTorch over the
   transformers model) on the haystack task at `P_train` tokens: cross-entropy on the value
   tokens of every record whose key appeared earlier in the prompt (a lookup the prompt
   answers) and on the answer. Held-out teacher-forced exact match is checked every
   `check_every` steps; training stops at `target_accuracy` (or `max_examples`). Resumable
   (a state folder per `save_every` steps); the model is written through the project's
   checkpoint writer (`commit_checkpoint`) so `longstraw train` loads it as a user's checkpoint.
2. `base-eval`: `longstraw eval` of that checkpoint at P_train × 1, 2, 4, … (greedy,
   `eval_prompts` held-out prompts per length, exact match, binomial standard error), beside
   the guessing floor of the same prompts (the expected score of copying a random record's
   value, computed exactly per prompt), and the choice of P*: the shortest length whose
   accuracy is in [10 %, 50 %] and at least 10 points above its floor.
3. `grpo`: `longstraw train --no-prefect` from that checkpoint at P*, one run per (mode, seed)
   of `bench/configs/learning/grpo.yaml`, exact and detached alternating, held-out greedy
   evaluation at P* and 2·P* every `train.eval_steps` steps (the run's own `eval` section); the
   step-0 point is `longstraw eval` of the base checkpoint on the same prompts. Each run's
   metrics rows are copied into `bench/results/learning/grpo/<mode>-seed<k>.json`.
4. `fidelity`: the gradient cosine exact vs detached (and each against the full-sequence
   gradient) at the base checkpoint at P*, on task prompts with the base model's own sampled
   answers (`bench.grpo.methods.fidelity_step`).
5. `report`: the plots (docs/img) and the markdown tables of docs/benchmarks.md.

One torch thread per process (`--threads`); on a machine with CUDA every part runs there
unchanged (the device is `cuda` when `torch.cuda.is_available()`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "bench" / "configs" / "learning"
RESULTS = REPO / "bench" / "results" / "learning"
IMG = REPO / "docs" / "img"
MODES = ("exact", "detached")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def eta(done: float, total: float, elapsed: float) -> str:
    if done <= 0:
        return "ETA ?"
    left = elapsed / done * max(total - done, 0)
    return f"ETA {left / 3600:.1f} h" if left > 5400 else f"ETA {left / 60:.0f} min"


def write_json(path: Path, document) -> None:
    """Through a rename: a reader (or an interrupted plan) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def load_plan(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def task_config(plan: dict, num_prompt_tokens: int, seed: int, **overrides):
    from longstraw.schemas.data import HaystackTaskConfig

    fields = {**plan["task"], **overrides}
    return HaystackTaskConfig(**fields, num_prompt_tokens=num_prompt_tokens, seed=seed)


def stage_task(plan: dict, stage: dict) -> tuple[int, dict]:
    """(prompt tokens, task overrides) of a pre-training stage; the last stage is the benchmark's
    task at P_train itself."""
    return stage.get("prompt_tokens", plan["p_train"]), stage.get("task", {})


def lengths(plan: dict) -> list[int]:
    return [plan["p_train"] * m for m in plan["base_eval"]["length_multiples"]]


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


# --------------------------------------------------------------------------------------------
# Supervised pre-training


def model_config(plan: dict):
    """The qwen3_5 config of the plan: `init_size`'s, with `overrides` (a width between tiny and
    small, say) applied."""
    from longstraw.models.factory import build_config

    config = build_config("qwen3_5", plan["model"]["init_size"])
    for field, value in plan["model"].get("overrides", {}).items():
        setattr(config, field, value)
    assert len(config.layer_types) == config.num_hidden_layers
    return config


def record_value_spans(example, tokenizer) -> tuple[list[tuple[int, int]], int]:
    """([(start, end)] token spans of the values of records whose key appeared earlier in the
    prompt, the number of records): the lookups a prompt answers itself."""
    from longstraw.data.haystack import compact_record_prefix
    from longstraw.data.tasks import encode_texts

    texts = example.piece_texts
    lengths_K = [len(ids) for ids in encode_texts(tokenizer, list(texts))]
    record = re.compile(r"^Key (\w+): (\w+)\n$")
    parsed = [record.match(t) for t in texts]
    prefix_len = {
        k: len(encode_texts(tokenizer, [compact_record_prefix(m.group(1))])[0])
        for k, m in enumerate(parsed)
        if m
    }
    spans, seen, start, num_records = [], set(), 0, 0
    for k in example.piece_sequence.tolist():
        match = parsed[k]
        if match is not None:
            num_records += 1
            if match.group(1) in seen:
                begin = start + prefix_len[k]
                spans.append((begin, start + lengths_K[k] - 1))  # the value, not the newline
            seen.add(match.group(1))
        start += lengths_K[k]
    assert start == example.num_prompt_tokens
    return spans, num_records


def training_example(plan: dict, stage: dict, seed: int, tokenizer):
    """(ids [P + A], target mask [P + A]: 1 where the token is predicted by the loss, A)."""
    from longstraw.data.haystack import generate_haystack_task

    length, overrides = stage_task(plan, stage)
    example = generate_haystack_task(task_config(plan, length, seed, **overrides), tokenizer)
    spans, _ = record_value_spans(example, tokenizer)
    ids = np.concatenate([example.prompt_ids, example.answer_ids]).astype(np.int64)
    mask = np.zeros(ids.shape[0], dtype=np.float32)
    for begin, end in spans:
        mask[begin:end] = 1.0
    mask[example.num_prompt_tokens :] = 1.0
    return ids, mask, len(example.answer_ids)


def batch_of(plan: dict, stage: dict, seeds: list[int], tokenizer, device):
    import torch

    rows = [training_example(plan, stage, s, tokenizer) for s in seeds]
    (answer,) = {r[2] for r in rows}  # values of one length and alphabet: one token count
    ids = torch.from_numpy(np.stack([r[0] for r in rows])).to(device)
    mask = torch.from_numpy(np.stack([r[1] for r in rows])).to(device)
    return ids, mask, answer


def masked_loss(model, ids, mask):
    """Mean cross-entropy of the masked tokens, each predicted from the tokens before it."""
    import torch

    logits = model(input_ids=ids[:, :-1]).logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    target = mask[:, 1:]
    return -(logp * target).sum() / target.sum()


def teacher_forced_accuracy(model, plan, stage, seeds: list[int], tokenizer, device) -> float:
    """Exact match of the answer when every answer token is the argmax given the true ones
    before it (what greedy decoding gives when the answer's tokens are its canonical ones)."""
    import torch

    correct, chunk = 0, 16
    with torch.no_grad():
        for i in range(0, len(seeds), chunk):
            ids, _, answer = batch_of(plan, stage, seeds[i : i + chunk], tokenizer, device)
            # The last `answer` predictions are those of the answer's tokens.
            predicted = model(input_ids=ids[:, :-1]).logits[:, -answer:].argmax(-1)
            correct += int((predicted == ids[:, -answer:]).all(dim=1).sum())
    return correct / len(seeds)


def _state_dirs(folder: Path) -> list[Path]:
    found = [p for p in folder.glob("state-*") if re.fullmatch(r"state-\d{8}", p.name)]
    return sorted(found, key=lambda p: int(p.name[6:]))


def save_state(folder: Path, step: int, stage: int, model, optimizer, history: list) -> None:
    """Model, AdamW moments and the log so far, as safetensors + JSON (no pickle); the folder
    is renamed into place, older ones removed."""
    import torch
    from safetensors.torch import save_file

    final = folder / f"state-{step:08d}"
    if final.exists():
        return  # saved at this step already (the weights have not moved since)
    tmp = folder / f".tmp-state-{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        str(tmp / "model.safetensors"),
    )
    moments, steps = {}, {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if state:
                name = names[id(p)]
                moments[f"{name}/exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
                moments[f"{name}/exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
                steps[name] = float(torch.as_tensor(state["step"]).item())
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(
        json.dumps({"step": step, "stage": stage, "adam_steps": steps, "history": history})
    )
    os.replace(tmp, final)
    for old in _state_dirs(folder)[:-1]:
        shutil.rmtree(old, ignore_errors=True)


def load_state(folder: Path, model, optimizer, device) -> tuple[int, int, list]:
    """(step, stage, history) of the newest saved state, loaded into `model` and `optimizer`;
    (0, 0, []) when there is none."""
    import torch
    from safetensors.torch import load_file

    states = _state_dirs(folder)
    if not states:
        return 0, 0, []
    state_dir = states[-1]
    meta = json.loads((state_dir / "state.json").read_text())
    model.load_state_dict(load_file(str(state_dir / "model.safetensors"), device=str(device)))
    moments = load_file(str(state_dir / "optimizer.safetensors"), device=str(device))
    for name, p in model.named_parameters():
        if name in meta["adam_steps"]:
            optimizer.state[p] = {
                "step": torch.tensor(meta["adam_steps"][name]),
                "exp_avg": moments[f"{name}/exp_avg"],
                "exp_avg_sq": moments[f"{name}/exp_avg_sq"],
            }
    return int(meta["step"]), int(meta["stage"]), meta["history"]


def learning_rate(cfg: dict, stage: dict, step: int, stage_start: int) -> float:
    """Linear warm-up over `warmup_steps`, then the stage's rate (`learning_rate`, else the
    plan's); with `decay_to`, falling linearly to it over the stage's first `decay_examples`,
    then constant (training stops at a target, not at a planned length)."""
    peak, warm = cfg["learning_rate"], cfg["warmup_steps"]
    if step < warm:
        return peak * (step + 1) / warm
    rate = stage.get("learning_rate", peak)
    if "decay_to" not in stage:
        return rate
    done = min((step - stage_start) * cfg["batch_size"] / stage["decay_examples"], 1.0)
    return rate + (stage["decay_to"] - rate) * done


def write_base_checkpoint(path: Path, model, tokenizer, record: dict) -> None:
    """The pre-trained weights as a Hugging Face directory, through the project's writer
    (`commit_checkpoint`: weights digest, per-file sha256, renamed into place)."""
    from transformers import GenerationConfig

    from longstraw.storage.checkpoints import commit_checkpoint, new_checkpoint_dir

    model = model.to("cpu")
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None, do_sample=True
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    commit_checkpoint(
        new_checkpoint_dir(path),
        path,
        policy_version=0,
        model=model,
        tokenizer=tokenizer,
        trainer_state={"pretraining": record},
    )


def pretrain(args, plan: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from longstraw.models.tokenizer import build_hf_tokenizer

    out = args.results / "pretrain.json"
    base = args.work / "base"
    if (base / "longstraw.json").exists() and read_json(out) is not None:
        log(f"pretrain: {base} exists, skipped")
        return read_json(out)
    cfg = plan["pretrain"]
    stages = cfg["stages"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(plan)
    tokenizer = build_hf_tokenizer(vocab_size=config.vocab_size, seed=0)
    torch.manual_seed(cfg["init_seed"])
    model = AutoModelForCausalLM.from_config(config).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg["learning_rate"], weight_decay=cfg["weight_decay"]
    )
    folder = args.work / "pretrain"
    folder.mkdir(parents=True, exist_ok=True)
    step, stage_index, history = (
        load_state(folder, model, optimizer, device) if args.resume else (0, 0, [])
    )
    batch = cfg["batch_size"]
    checks = list(range(cfg["check_seed"], cfg["check_seed"] + cfg["check_prompts"]))
    log(f"pretrain: {num_params:,} parameters on {device}, from step {step} (stage {stage_index})")
    started, start_step, ema, first = time.time(), step, None, None
    model.train()
    while stage_index < len(stages):
        stage = stages[stage_index]
        stage_steps = [h for h in history if h["stage"] == stage_index]
        if first is None:
            # A stage starts at a check step (where the one before reached its accuracy), so
            # its first check is `check_every` steps after its start.
            first = stage_steps[0]["step"] - cfg["check_every"] if stage_steps else step
        last = first + stage["max_examples"] // batch
        if stage_steps and stage_steps[-1]["accuracy"] >= stage["until_accuracy"]:
            stage_index, first = stage_index + 1, None
            continue
        if step >= last:
            break  # the stage's budget is spent without reaching its accuracy: stop there
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, stage, step, first)
        seeds = [cfg["train_seed"] + step * batch + i for i in range(batch)]
        ids, mask, _ = batch_of(plan, stage, seeds, tokenizer, device)
        loss = masked_loss(model, ids, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % cfg["check_every"] == 0 or step == last:
            model.eval()
            accuracy = teacher_forced_accuracy(model, plan, stage, checks, tokenizer, device)
            model.train()
            elapsed = time.time() - started
            history.append(
                {
                    "stage": stage_index,
                    "step": step,
                    "examples": step * batch,
                    "loss_ema": ema,
                    "accuracy": accuracy,
                    "seconds": elapsed,
                }
            )
            rate = (step - start_step) * batch / elapsed
            length, overrides = stage_task(plan, stage)
            log(
                f"pretrain stage {stage_index} (P {length}, {overrides or 'the task'}) step "
                f"{step} (at most {last}) examples {step * batch:,} loss {ema:.3f} held-out "
                f"teacher-forced exact match {accuracy:.3f} ({rate:.1f} examples/s, "
                f"{eta(step - start_step, step - start_step + last - step, elapsed)} at most "
                "for the stage)"
            )
            if step % cfg["save_every"] == 0 or accuracy >= stage["until_accuracy"]:
                save_state(folder, step, stage_index, model, optimizer, history)
    reached = stage_index == len(stages)
    save_state(folder, step, stage_index, model, optimizer, history)
    record = {
        "model": {"family": "qwen3_5", **plan["model"], "num_parameters": num_params},
        "p_train": plan["p_train"],
        "task": plan["task"],
        "pretrain": cfg,
        "steps": step,
        "examples": step * batch,
        "reached_target": reached,
        "history": history,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }
    model.eval()
    write_base_checkpoint(base, model, tokenizer, record)
    write_json(out, record)
    log(f"pretrain: wrote {base} ({'target reached' if reached else 'TARGET NOT REACHED'})")
    return record


# --------------------------------------------------------------------------------------------
# The base model against length, and the guessing floor


def guessing_floor(example) -> dict:
    """The expected exact match of answering with a random record's value, computed exactly for
    this prompt: over its record lines (`per_line`: a frequent record is copied more often) and
    over its distinct records (`per_record`)."""
    record = re.compile(r"^Key (\w+): (\w+)\n$")
    answer = example.answer
    lines, distinct = 0, {}
    for k in example.piece_sequence.tolist():
        match = record.match(example.piece_texts[k])
        if match is not None:
            lines += 1
            distinct.setdefault(match.group(1), [match.group(2), 0])[1] += 1
    hits_lines = sum(n for value, n in distinct.values() if value == answer)
    hits_records = sum(1 for value, _ in distinct.values() if value == answer)
    return {
        "per_line": hits_lines / lines,
        "per_record": hits_records / len(distinct),
        "records": lines,
        "distinct_records": len(distinct),
    }


def eval_data(plan: dict, num_prompt_tokens: int) -> dict:
    """The `eval.data` section of `num_prompt_tokens`-token held-out prompts."""
    return {
        "type": "haystack",
        "task": {
            **plan["task"],
            "num_prompt_tokens": num_prompt_tokens,
            "seed": plan["base_eval"]["eval_seed"],
        },
        "num_prompts": plan["base_eval"]["eval_prompts"],
        "rewards": ["haystack_exact"],
    }


def eval_run_config(plan: dict, work: Path, checkpoint: Path, data: dict, shard: int) -> dict:
    """A run config whose eval section is `data` (what `longstraw eval` reads)."""
    return {
        "run_id": "base-eval",
        "model": {"checkpoint": str(checkpoint)},
        "engine": {"shard_tokens": shard},
        "grpo": {"max_completion_length": plan["grpo_answer_tokens"], "num_generations": 2},
        "data": {
            "type": "haystack",
            "task": {**plan["task"], "num_prompt_tokens": plan["p_train"]},
            "rewards": ["haystack_exact"],
        },
        "storage": {"root_uri": str(work / "eval-root"), "persist_mode": "off"},
        "train": {"eval_steps": 1},
        "eval": {"data": data},
    }


def longstraw_eval(args, config: dict, folder: Path) -> dict:
    """Run `longstraw eval` on `config` in its own process; its EvalMetrics as a dict."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    out = folder / "eval.json"
    command = [
        sys.executable,
        "-m",
        "longstraw.cli",
        "eval",
        "--config",
        str(folder / "run.yaml"),
        "--out",
        str(out),
    ]
    started = time.time()
    with open(folder / "log.txt", "ab") as handle:
        done = subprocess.run(
            command, cwd=folder, env=child_env(args), stdout=handle, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = (folder / "log.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"longstraw eval failed in {folder}:\n{tail}")
    return json.loads(out.read_text()) | {"wall_s": time.time() - started}


def child_env(args) -> dict:
    threads = str(args.threads)
    return {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONPATH": str(REPO),
    }


def floors_of(plan: dict, num_prompt_tokens: int, tokenizer) -> list[dict]:
    from longstraw.data.haystack import generate_haystack_task

    seed0, n = plan["base_eval"]["eval_seed"], plan["base_eval"]["eval_prompts"]
    return [
        guessing_floor(
            generate_haystack_task(task_config(plan, num_prompt_tokens, seed0 + i), tokenizer)
        )
        for i in range(n)
    ]


def summary_of(rewards: list[float], floors: list[dict]) -> dict:
    n = len(rewards)
    accuracy = sum(rewards) / n
    per_line = sum(f["per_line"] for f in floors) / n
    per_record = sum(f["per_record"] for f in floors) / n
    return {
        "prompts": n,
        "accuracy": accuracy,
        "accuracy_se": binomial_se(accuracy, n),
        "floor_per_line": per_line,
        "floor_per_record": per_record,
        "floor": max(per_line, per_record),
        "records_mean": sum(f["records"] for f in floors) / n,
        "distinct_records_mean": sum(f["distinct_records"] for f in floors) / n,
    }


def choose_target_length(rows: list[dict], rule: dict) -> int | None:
    """P*: the shortest length whose accuracy is in [low, high] and `margin` above its floor."""
    for row in sorted(rows, key=lambda r: r["prompt_tokens"]):
        s = row["summary"]
        in_band = rule["low"] <= s["accuracy"] <= rule["high"]
        if in_band and s["accuracy"] >= s["floor"] + rule["margin"]:
            return row["prompt_tokens"]
    return None


def base_eval(args, plan: dict) -> dict:
    from transformers import AutoTokenizer

    out = args.results / "base_eval.json"
    document = (read_json(out) if args.resume else None) or {"rows": []}
    base = args.work / "base"
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    done = {r["prompt_tokens"] for r in document["rows"]}
    todo = [p for p in lengths(plan) if p not in done]
    started = time.time()
    for i, length in enumerate(todo):
        shard = min(length, plan["base_eval"]["shard_tokens"])
        config = eval_run_config(plan, args.work, base, eval_data(plan, length), shard)
        log(
            f"base-eval P={length}: {plan['base_eval']['eval_prompts']} prompts "
            f"({i}/{len(todo)} lengths, {eta(i, len(todo), time.time() - started)})"
        )
        metrics = longstraw_eval(args, config, args.work / "base-eval" / f"p{length}")
        rewards = [g[0] for g in metrics["rewards"]]
        floors = floors_of(plan, length, tokenizer)
        row = {
            "prompt_tokens": length,
            "summary": summary_of(rewards, floors),
            "rewards": rewards,
            "floors": floors,
            "wall_s": metrics["wall_s"],
            "load_average": os.getloadavg(),
        }
        document["rows"] = sorted([*document["rows"], row], key=lambda r: r["prompt_tokens"])
        s = row["summary"]
        log(
            f"base-eval P={length}: exact match {s['accuracy']:.3f} ± {s['accuracy_se']:.3f}, "
            f"floor {s['floor']:.3f} ({metrics['wall_s']:.0f} s)"
        )
        write_json(out, document)
    document["target_length"] = choose_target_length(document["rows"], plan["target_rule"])
    document["rule"] = plan["target_rule"]
    write_json(out, document)
    log(f"base-eval: P* = {document['target_length']}")
    return document


# --------------------------------------------------------------------------------------------
# GRPO at P*: exact against detached


def target_length(args) -> int:
    if args.target_length is not None:
        return args.target_length
    document = read_json(args.results / "base_eval.json")
    if document is None or document.get("target_length") is None:
        raise SystemExit("no P* yet: run base-eval first (or give --target-length)")
    return int(document["target_length"])


def held_out_file(args, plan: dict, p_star: int) -> tuple[Path, list[int]]:
    """The JSONL of the held-out prompts at P* and 2·P* (the base evaluation's prompts at those
    lengths, the same seeds), and the length of each record in file order."""
    from transformers import AutoTokenizer

    from longstraw.data.haystack import generate_haystack_task
    from longstraw.data.tasks import write_task_dataset

    grpo = load_grpo(plan)
    multiples = grpo["eval_length_multiples"]
    n, seed0 = grpo["eval_prompts"], plan["base_eval"]["eval_seed"]
    path = args.work / "grpo" / f"held-out-{p_star}.jsonl"
    order = [p_star * m for m in multiples for _ in range(n)]
    if not path.exists():
        tokenizer = AutoTokenizer.from_pretrained(str(args.work / "base"))
        pairs = [
            (
                f"p{p_star * m}-{seed0 + i}",
                generate_haystack_task(task_config(plan, p_star * m, seed0 + i), tokenizer),
            )
            for m in multiples
            for i in range(n)
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        write_task_dataset(tmp, pairs, reward="haystack_exact")
        os.replace(tmp, path)
    return path, order


def load_grpo(plan: dict) -> dict:
    return yaml.safe_load((CONFIGS / plan["grpo_config"]).read_text())


def grpo_run_config(args, plan: dict, p_star: int, mode: str, seed: int) -> dict:
    """`grpo.yaml`'s run config for one (mode, seed): only `engine.prompt_grad`, `train.seed`
    and where it is stored differ between the runs."""
    grpo = load_grpo(plan)
    eval_path, _ = held_out_file(args, plan, p_star)
    config = json.loads(json.dumps(grpo["run"]))
    config["run_id"] = f"{mode}-seed{seed}"
    config["model"] = {"checkpoint": str(args.work / "base"), "dtype": "float32"}
    config["engine"]["prompt_grad"] = mode
    config["train"]["seed"] = seed
    config["data"]["task"] = {
        **plan["task"],
        "num_prompt_tokens": p_star,
        "seed": grpo["train_prompt_seed"],
    }
    config["eval"]["data"] = {
        "type": "jsonl",
        "path": str(eval_path),
        "rewards": ["haystack_exact"],
    }
    config["storage"] = {
        "root_uri": str(args.work / "grpo" / config["run_id"] / "root"),
        "persist_mode": "off",
    }
    return config


def run_started(root: Path, run_id: str) -> bool:
    folder = root / "runs" / run_id
    return folder.is_dir() and any(p.name != "RUN.lock" for p in folder.iterdir())


def read_rows(root: Path, run_id: str) -> list[dict]:
    path = root / "runs" / run_id / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def training_seconds(row: dict) -> float:
    """A step's wall-clock seconds less its evaluation and checkpoint writing."""
    seconds = row["seconds"]
    return row["step_seconds"] - seconds.get("eval", 0.0) - seconds.get("checkpoint", 0.0)


def launch_run(args, plan: dict, p_star: int, mode: str, seed: int):
    """Start one `longstraw train` process (continuing what its folder holds)."""
    config = grpo_run_config(args, plan, p_star, mode, seed)
    folder = args.work / "grpo" / config["run_id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    root = Path(config["storage"]["root_uri"])
    resume = run_started(root, config["run_id"])
    command = [
        sys.executable,
        "-m",
        "longstraw.cli",
        "train",
        "--config",
        str(folder / "run.yaml"),
        "--no-prefect",
        *(["--resume"] if resume else []),
    ]
    log(f"{config['run_id']}: start{' (resumed)' if resume else ''}")
    handle = open(folder / "log.txt", "ab")  # noqa: SIM115 (closed when the process ends)
    process = subprocess.Popen(
        command,
        cwd=folder,
        env=child_env(args),
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return {
        "config": config,
        "folder": folder,
        "root": root,
        "process": process,
        "handle": handle,
        "started": time.time(),
        "mode": mode,
        "seed": seed,
    }


def finish_run(run: dict, order: list[int]) -> dict:
    """The record of a finished run: its config, every metrics row, the eval split by length."""
    config, rows = run["config"], read_rows(run["root"], run["config"]["run_id"])
    record = {
        "run_id": config["run_id"],
        "mode": run["mode"],
        "seed": run["seed"],
        "returncode": run["process"].returncode,
        "config": config,
        "rows": rows,
        "eval_lengths": order,
        "load_average_at_end": os.getloadavg(),
    }
    if run["process"].returncode != 0:
        record["log_tail"] = (run["folder"] / "log.txt").read_text(errors="replace")[-3000:]
    return record


def grpo(args, plan: dict) -> None:
    p_star = target_length(args)
    grpo_cfg = load_grpo(plan)
    _, order = held_out_file(args, plan, p_star)
    num_steps = grpo_cfg["run"]["train"]["num_steps"]
    plan_runs = [(mode, seed) for seed in grpo_cfg["seeds"] for mode in MODES]
    out = args.results / "grpo"

    def recorded(mode: str, seed: int) -> bool:
        record = read_json(out / f"{mode}-seed{seed}.json")
        return record is not None and record["returncode"] == 0

    todo = [(m, s) for m, s in plan_runs if not (args.resume and recorded(m, s))]
    log(
        f"grpo at P*={p_star}: {len(plan_runs)} runs, {len(todo)} to run, {args.parallel} at a time"
    )
    started, running, finished = time.time(), [], 0
    last_progress = 0.0
    while todo or running:
        while todo and len(running) < args.parallel:
            running.append(launch_run(args, plan, p_star, *todo.pop(0)))
        time.sleep(5)
        for run in [r for r in running if r["process"].poll() is not None]:
            running.remove(run)
            run["handle"].close()
            record = finish_run(run, order)
            write_json(out / f"{run['mode']}-seed{run['seed']}.json", record)
            finished += 1
            status = "ok" if record["returncode"] == 0 else f"FAILED ({record['returncode']})"
            log(f"{record['run_id']}: {status}, {len(record['rows'])} steps recorded")
            if record["returncode"] != 0:
                for other in running:
                    os.killpg(other["process"].pid, 15)
                raise SystemExit(f"{record['run_id']} failed; see {run['folder'] / 'log.txt'}")
        if time.time() - last_progress >= args.progress_s and running:
            last_progress = time.time()
            steps_done = finished * num_steps
            for run in running:
                rows = read_rows(run["root"], run["config"]["run_id"])
                steps_done += len(rows)
                if rows:
                    last = rows[-1]
                    evals = [r for r in rows if r.get("eval")]
                    held = f", held-out {evals[-1]['eval']['reward_mean']:.3f}" if evals else ""
                    per_step = sum(training_seconds(r) for r in rows) / len(rows)
                    log(
                        f"{run['config']['run_id']}: step {len(rows)}/{num_steps}, reward "
                        f"{last['reward_mean']:.3f}{held}, {per_step:.1f} s/step training, "
                        f"{eta(len(rows), num_steps, time.time() - run['started'])}"
                    )
            total = len(plan_runs) * num_steps
            log(
                f"plan: {steps_done}/{total} steps, load {os.getloadavg()[0]:.1f}, "
                f"{eta(steps_done, total, time.time() - started)} for the plan"
            )


# --------------------------------------------------------------------------------------------
# Gradient fidelity at the base checkpoint at P*


def fidelity(args, plan: dict) -> dict:
    """Cosines of the exact and the detached GRPO gradient to the full-sequence one (and to each
    other) at the base checkpoint, on P*-token task prompts with G answers the base model
    samples (groups whose rewards differ, so the advantages are not all zero); the run's loss."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `bench.grpo`
    from bench.grpo.methods import compare, flat_grad, naive_group_gradient
    from bench.grpo.workload import Batch
    from longstraw.data.haystack import generate_haystack_task
    from longstraw.data.rewards import haystack_exact
    from longstraw.engine.group import accumulate_group_gradients
    from longstraw.engine.prefill import prefill
    from longstraw.engine.rollout import SamplingParams, sample_responses
    from longstraw.grpo.advantages import group_advantages
    from longstraw.models.checkpoint import load_checkpoint
    from longstraw.schemas.grpo import GRPOConfig
    from longstraw.schemas.run import EngineConfig

    out = args.results / "fidelity.json"
    if args.resume and read_json(out) is not None:
        return read_json(out)
    p_star = target_length(args)
    run = load_grpo(plan)["run"]
    loss_config = GRPOConfig(**run["grpo"])
    shard = run["engine"]["shard_tokens"]
    model, _, _ = load_checkpoint(args.work / "base")
    tokenizer = AutoTokenizer.from_pretrained(str(args.work / "base"))
    model.train(False)
    cfg = plan["fidelity"]
    rows, seed = [], cfg["prompt_seed"]
    generator = torch.Generator().manual_seed(cfg["sampling_seed"])
    params = SamplingParams(
        num_samples=loss_config.num_generations, max_new_tokens=loss_config.max_completion_length
    )
    while len(rows) < cfg["prompts"] and seed < cfg["prompt_seed"] + cfg["max_tries"]:
        example = generate_haystack_task(task_config(plan, p_star, seed), tokenizer)
        seed += 1
        prompt = torch.from_numpy(example.prompt_ids.astype(np.int64))
        with torch.no_grad():
            state = prefill(model, prompt, shard_tokens=shard)
            responses = sample_responses(
                model, state, params, generator=generator, tokenizer=tokenizer
            )
        rewards = [
            haystack_exact("", tokenizer.decode(r.token_ids), example.metadata) for r in responses
        ]
        if len(set(rewards)) < 2:
            continue
        advantages = group_advantages(rewards).float()
        ids = [torch.tensor(r.token_ids) for r in responses]
        batch = Batch(prompt, ids, advantages)
        reference, _ = naive_group_gradient(model, batch, loss_config)
        grads = {}
        for mode in MODES:
            accumulate_group_gradients(
                model,
                prompt,
                ids,
                advantages,
                loss_config,
                EngineConfig(shard_tokens=shard, prompt_grad=mode),
            )
            grads[mode] = flat_grad(model)
        rows.append(
            {
                "seed": seed - 1,
                "rewards": rewards,
                "exact_vs_full_sequence": compare(grads["exact"], reference),
                "detached_vs_full_sequence": compare(grads["detached"], reference),
                "detached_vs_exact": compare(grads["detached"], grads["exact"]),
            }
        )
        log(
            f"fidelity prompt {len(rows)}/{cfg['prompts']}: cosine detached/exact "
            f"{rows[-1]['detached_vs_exact']['cosine']:.4f}, exact/full "
            f"{rows[-1]['exact_vs_full_sequence']['cosine']:.7f}"
        )
    stock = args.results / "fidelity_random_prompt.json"
    command = [
        sys.executable,
        "-m",
        "longstraw.cli",
        "bench",
        "fidelity",
        "--checkpoint",
        str(args.work / "base"),
        "--prompt-tokens",
        str(p_star),
        "--group-size",
        str(cfg["stock_group_size"]),
        "--shard-tokens",
        str(shard),
        "--out",
        str(stock),
    ]
    log(f"fidelity: the stock benchmark on random tokens ({' '.join(command[2:])})")
    subprocess.run(command, check=True, env=child_env(args), cwd=REPO)
    document = {
        "prompt_tokens": p_star,
        "loss": run["grpo"],
        "shard_tokens": shard,
        "rows": rows,
        "tries": seed - cfg["prompt_seed"],
    }
    write_json(out, document)
    return document


# --------------------------------------------------------------------------------------------
# Analysis: the curves and the tables


STYLE = {
    "exact": dict(color="tab:blue", marker="o"),
    "detached": dict(color="tab:green", marker="s"),
}


def curves(records: list[dict], base: dict, p_star: int) -> dict:
    """Per mode: the held-out accuracy at each length per seed at every evaluated step (step 0:
    the base model on the same prompts), the cumulative training seconds at those steps, and
    the training reward per step."""
    base_rows = {r["prompt_tokens"]: r for r in base["rows"]}
    out: dict = {}
    for record in sorted(records, key=lambda r: (r["mode"], r["seed"])):
        mode = out.setdefault(
            record["mode"],
            {"seeds": [], "steps": None, "accuracy": {}, "seconds": [], "reward": []},
        )
        order = record["eval_lengths"]
        rows = record["rows"]
        steps, seconds, elapsed = [0], [0.0], 0.0
        accuracy = {p: [base_rows[p]["summary"]["accuracy"]] for p in sorted(set(order))}
        for row in rows:
            elapsed += training_seconds(row)
            if row.get("eval"):
                steps.append(row["step"] + 1)
                seconds.append(elapsed)
                flat = [g[0] for g in row["eval"]["rewards"]]
                for p in accuracy:
                    picked = [x for x, q in zip(flat, order, strict=True) if q == p]
                    accuracy[p].append(sum(picked) / len(picked))
        mode["seeds"].append(record["seed"])
        mode["steps"] = steps
        mode["seconds"].append(seconds)
        mode["reward"].append([r["reward_mean"] for r in rows])
        for p, values in accuracy.items():
            mode["accuracy"].setdefault(p, []).append(values)
    return out


def _band(ax, x, runs, label, style):
    values = np.asarray(runs, dtype=float)
    mean = values.mean(axis=0)
    ax.plot(x, mean, label=f"{label} (mean of {len(runs)})", **style)
    ax.fill_between(x, values.min(axis=0), values.max(axis=0), color=style["color"], alpha=0.15)


def plot_all(pre: dict, base: dict, records: list[dict], fid: dict | None, img: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    paths = []
    p_star = base["target_length"]

    fig, (ax_pre, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    hist = pre["history"]
    ax_pre.plot([h["examples"] for h in hist], [h["accuracy"] for h in hist], color="black")
    ax_pre.set_xlabel("training examples")
    ax_pre.set_ylabel("held-out exact match (teacher-forced)")
    ax_pre.set_title(f"pre-training at P_train = {pre['p_train']}")
    ax_pre.grid(alpha=0.3)
    xs = [r["prompt_tokens"] for r in base["rows"]]
    acc = [r["summary"]["accuracy"] for r in base["rows"]]
    se = [r["summary"]["accuracy_se"] for r in base["rows"]]
    ax_len.errorbar(
        xs,
        acc,
        yerr=se,
        color="black",
        marker="o",
        capsize=3,
        label="base model, greedy exact match ± 1 s.e.",
    )
    ax_len.plot(
        xs,
        [r["summary"]["floor"] for r in base["rows"]],
        color="gray",
        linestyle="--",
        label="guessing floor (copy a random record's value)",
    )
    rule = base["rule"]
    ax_len.axhspan(rule["low"], rule["high"], color="tab:orange", alpha=0.1, label="P* band")
    if p_star is not None:
        ax_len.axvline(p_star, color="tab:orange", linestyle=":", label=f"P* = {p_star}")
    ax_len.set_xscale("log", base=2)
    ax_len.set_xlabel("prompt tokens")
    ax_len.set_ylabel("held-out exact match")
    ax_len.set_ylim(0, 1.02)
    ax_len.grid(alpha=0.3)
    ax_len.legend(fontsize=7)
    fig.tight_layout()
    paths.append(img / "learning_base.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if not records:
        return paths
    data = curves(records, base, p_star)
    lengths_evaluated = sorted(next(iter(data.values()))["accuracy"])
    for x_name in ("step", "seconds"):
        fig, axes = plt.subplots(
            1, len(lengths_evaluated), figsize=(5.5 * len(lengths_evaluated), 4)
        )
        for ax, p in zip(np.atleast_1d(axes), lengths_evaluated, strict=True):
            for mode, d in data.items():
                if x_name == "step":
                    _band(ax, d["steps"], d["accuracy"][p], mode, STYLE[mode])
                else:
                    for i, (x, y) in enumerate(zip(d["seconds"], d["accuracy"][p], strict=True)):
                        ax.plot(
                            x,
                            y,
                            alpha=0.8,
                            label=f"{mode} (seeds)" if i == 0 else None,
                            **STYLE[mode],
                        )
            ax.set_title(f"held-out prompts of {p} tokens" + (" (P*)" if p == p_star else ""))
            ax.set_xlabel("GRPO step" if x_name == "step" else "training seconds (eval excluded)")
            ax.set_ylabel("greedy exact match")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(img / f"learning_{x_name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    window = min(10, min(len(r) for d in data.values() for r in d["reward"]))
    for mode, d in data.items():
        smooth = [np.convolve(r, np.ones(window) / window, mode="valid") for r in d["reward"]]
        x = np.arange(window, len(d["reward"][0]) + 1)
        _band(ax, x, smooth, mode, {k: v for k, v in STYLE[mode].items() if k != "marker"})
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"training reward (mean over the step's groups, {window}-step average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(img / "learning_reward.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def tables(pre: dict, base: dict, records: list[dict], fid: dict | None) -> str:
    lines = [
        "| prompt tokens | × P_train | greedy exact match ± s.e. | guessing floor (per line / per record) | records (distinct) |",
        "|---|---|---|---|---|",
    ]
    for row in base["rows"]:
        s = row["summary"]
        mark = " **P\\***" if row["prompt_tokens"] == base["target_length"] else ""
        lines.append(
            f"| {row['prompt_tokens']:,}{mark} | {row['prompt_tokens'] // pre['p_train']} | "
            f"{s['accuracy']:.3f} ± {s['accuracy_se']:.3f} | {s['floor_per_line']:.3f} / "
            f"{s['floor_per_record']:.3f} | {s['records_mean']:.0f} ({s['distinct_records_mean']:.1f}) |"
        )
    if records:
        data = curves(records, base, base["target_length"])
        lines += [
            "",
            "| mode | held-out prompts | step 0 | final, per seed | final, mean ± sd | mean over the evaluations after step 0 |",
            "|---|---|---|---|---|---|",
        ]
        for mode, d in data.items():
            for p, runs in d["accuracy"].items():
                finals = [r[-1] for r in runs]
                area = [float(np.mean(r[1:])) for r in runs]
                lines.append(
                    f"| {mode} | {p:,} | {runs[0][0]:.3f} | {', '.join(f'{x:.3f}' for x in finals)} | "
                    f"{np.mean(finals):.3f} ± {np.std(finals, ddof=1) if len(finals) > 1 else 0:.3f} | "
                    f"{np.mean(area):.3f} |"
                )
        per_step = {}
        for record in records:
            per_step.setdefault(record["mode"], []).extend(
                training_seconds(r) for r in record["rows"]
            )
        if set(per_step) == set(MODES):
            median = {m: float(np.median(v)) for m, v in per_step.items()}
            lines += [
                "",
                f"Median training seconds per step: exact {median['exact']:.2f} s, "
                f"detached {median['detached']:.2f} s, ratio exact/detached "
                f"{median['exact'] / median['detached']:.2f}.",
            ]
    if fid is not None and fid["rows"]:
        lines += [
            "",
            "| prompt seed | rewards of the group | cosine detached / exact | cosine detached / full sequence | cosine exact / full sequence |",
            "|---|---|---|---|---|",
        ]
        for row in fid["rows"]:
            lines.append(
                f"| {row['seed']} | {''.join(str(int(x)) for x in row['rewards'])} | "
                f"{row['detached_vs_exact']['cosine']:.4f} | "
                f"{row['detached_vs_full_sequence']['cosine']:.4f} | "
                f"{row['exact_vs_full_sequence']['cosine']:.7f} |"
            )
    return "\n".join(lines)


def verdict(exact: list[float], detached: list[float], prompts: int) -> dict:
    """PROTOCOL.md's comparison of one metric: d = mean(exact) - mean(detached), its standard
    error from the seeds' spread but not below the binomial one of `prompts` prompts per seed,
    and the call at 2 standard errors."""
    n_e, n_d = len(exact), len(detached)
    sd_e = float(np.std(exact, ddof=1)) if n_e > 1 else 0.0
    sd_d = float(np.std(detached, ddof=1)) if n_d > 1 else 0.0
    d = float(np.mean(exact) - np.mean(detached))
    pooled = float(np.mean([*exact, *detached]))
    binomial = math.sqrt(pooled * (1 - pooled) / prompts * (1 / n_e + 1 / n_d))
    se = max(math.sqrt(sd_e**2 / n_e + sd_d**2 / n_d), binomial)
    call = (
        "exact learns more"
        if d > 2 * se
        else "detached learns more"
        if d < -2 * se
        else "no difference at this resolution"
    )
    return {
        "exact": exact,
        "detached": detached,
        "difference": d,
        "se": se,
        "binomial_se": binomial,
        "resolution": 2 * se,
        "verdict": call,
    }


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """ys at x, linear between the points (x within [xs[0], xs[-1]])."""
    return float(np.interp(x, xs, ys))


def analysis(records: list[dict], base: dict, prompts: int, reward_window: int = 50) -> dict:
    """Every metric of PROTOCOL.md with its verdict."""
    data = curves(records, base, base["target_length"])
    p_star = base["target_length"]
    out: dict = {}
    for p in sorted(data["exact"]["accuracy"]):
        finals = {m: [r[-1] for r in data[m]["accuracy"][p]] for m in MODES}
        areas = {m: [float(np.mean(r[1:])) for r in data[m]["accuracy"][p]] for m in MODES}
        out[f"final_accuracy_{p}"] = verdict(finals["exact"], finals["detached"], prompts)
        out[f"mean_accuracy_after_step_0_{p}"] = verdict(areas["exact"], areas["detached"], prompts)
    rewards = {m: [float(np.mean(r[-reward_window:])) for r in data[m]["reward"]] for m in MODES}
    out["training_reward_last_steps"] = verdict(
        rewards["exact"], rewards["detached"], prompts=4 * 8 * reward_window
    )
    # Per second: exact at the training seconds detached spent on all its steps (same seed).
    at_time = []
    for seconds_e, acc_e, seconds_d in zip(
        data["exact"]["seconds"],
        data["exact"]["accuracy"][p_star],
        data["detached"]["seconds"],
        strict=True,
    ):
        at_time.append(interpolate(min(seconds_d[-1], seconds_e[-1]), seconds_e, acc_e))
    finals_d = [r[-1] for r in data["detached"]["accuracy"][p_star]]
    out["per_second_accuracy"] = verdict(at_time, finals_d, prompts) | {
        "detached_seconds": [s[-1] for s in data["detached"]["seconds"]],
        "exact_seconds": [s[-1] for s in data["exact"]["seconds"]],
    }
    per_step = {m: [] for m in MODES}
    for record in records:
        per_step[record["mode"]].extend(training_seconds(r) for r in record["rows"])
    median = {m: float(np.median(v)) for m, v in per_step.items()}
    out["median_training_seconds_per_step"] = median
    out["cost_ratio_exact_to_detached"] = median["exact"] / median["detached"]
    return out


def report(args, plan: dict) -> None:
    pre, base = (
        read_json(args.results / "pretrain.json"),
        read_json(args.results / "base_eval.json"),
    )
    records = [json.loads(p.read_text()) for p in sorted((args.results / "grpo").glob("*.json"))]
    records = [r for r in records if r["returncode"] == 0]
    fid = read_json(args.results / "fidelity.json")
    for path in plot_all(pre, base, records, fid, args.img):
        log(f"wrote {path}")
    print(tables(pre, base, records, fid))
    if {r["mode"] for r in records} == set(MODES):
        result = analysis(records, base, load_grpo(plan)["eval_prompts"])
        write_json(args.results / "analysis.json", result)
        for metric, value in result.items():
            print(metric, json.dumps(value))


# --------------------------------------------------------------------------------------------


PARTS = {
    "pretrain": pretrain,
    "base-eval": base_eval,
    "grpo": grpo,
    "fidelity": fidelity,
    "report": report,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=[*PARTS, "all"], help="what to run ('all': in order)")
    parser.add_argument("--work", type=Path, required=True, help="models and runs (not committed)")
    parser.add_argument("--plan", type=Path, default=CONFIGS / "plan.yaml")
    parser.add_argument("--resume", action="store_true", help="keep what finished, continue")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--parallel", type=int, default=1, help="GRPO runs at once (at most 2)")
    parser.add_argument("--target-length", type=int, default=None, help="P* (default: chosen)")
    parser.add_argument("--progress-s", type=float, default=300.0)
    parser.add_argument("--img", type=Path, default=IMG)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.work = args.work.resolve()
    plan = load_plan(args.plan)
    parts = list(PARTS) if args.part == "all" else [args.part]
    for part in parts:
        PARTS[part](args, plan)


if __name__ == "__main__":
    main()
