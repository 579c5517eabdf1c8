"""TRL 0.11.4's PPOTrainer on the built-in task, for benchmarks/bench_peers.py.

Runs in its own virtual environment (`.venv-trl`: torch 2.13.0, trl 0.11.4, transformers < 4.47),
never imports ppo_rlhf (which needs transformers 5), and reads the SFT and reward-model folders
that ppo-rlhf wrote with transformers 5.

    .venv-trl/bin/python benchmarks/peers/trl_ppo.py check --sft DIR --reward DIR --inputs IN.pt --out OUT.pt
    .venv-trl/bin/python benchmarks/peers/trl_ppo.py train --settings RUN.json

`check` writes the policy's logits and the reward model's scores on the sequences in IN.pt,
computed as the training below computes them, for the benchmark to compare with ppo-rlhf's.

`train` is the loop of TRL's own example (examples/scripts/ppo.py of that version):
`ppo_trainer.generate` -> scores -> `ppo_trainer.step(queries, responses, scores)`, with the
task's prompts drawn as ppo-rlhf draws them, the reward model's logit of the requested style as
the score, and the policy saved every `save_every` iterations (outside the timed part) for
ppo-rlhf's evaluator to judge afterwards.  Per iteration it writes wall seconds and their split
(generate / score / forward: TRL's old and reference passes, rewards, advantages / train: TRL's
optimisation loop / other: the rest of `step`, TRL's statistics included) to metrics.jsonl.

Reading the transformers-5 folders: config.json and model.safetensors load as they are in
transformers 4.46 (a GPT-2 config; the newer `dtype` key is ignored); the tokenizer is built
from tokenizer.json (the `tokenizers` format is the same) with the special tokens named in
tokenizer_config.json, because that file's tokenizer class is a transformers-5 name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch


def load_tokenizer(folder: str | Path):
    """The task's tokenizer from a transformers-5 folder, for transformers 4.46."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if value is not None:
            special[key] = value
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special)
    # Right padding for step(): TRL's GPT-2 forward passes no position ids, so a left-padded row
    # would be read at shifted positions; TRL's generate() pads prompts on the left by itself.
    tokenizer.padding_side = "right"
    return tokenizer


DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")


def load_policy(folder: str | Path, dropout_off: bool):
    """AutoModelForCausalLMWithValueHead on the SFT folder.  ``dropout_off``: as ppo-rlhf trains
    (its disable_dropout), in the model and in TRL's value head; else TRL's defaults (the
    checkpoint's dropout, 0.1 in the value head)."""
    from transformers import AutoModelForCausalLM
    from trl import AutoModelForCausalLMWithValueHead

    overrides = {key: 0.0 for key in DROPOUT_KEYS} if dropout_off else {}
    base = AutoModelForCausalLM.from_pretrained(folder, **overrides)
    head_kwargs = {"summary_dropout_prob": 0.0} if dropout_off else {}
    return AutoModelForCausalLMWithValueHead.from_pretrained(base, **head_kwargs)


def load_reward(folder: str | Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder).eval().requires_grad_(False)


@torch.no_grad()
def reward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, K) classifier outputs at each row's last attended token (right-padded rows), as
    ppo-rlhf's reward reads them: position ids from the mask, the head on that token's state."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = model.transformer(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
    last = attention_mask.sum(dim=1) - 1
    return model.score(hidden[torch.arange(hidden.shape[0]), last]).float()


def score_responses(model, queries: list, responses: list, labels: list[int], pad_id: int) -> list[torch.Tensor]:
    """The score of each response: the reward model's logit of the style its prompt asks for,
    read after prompt + response (the response keeps its EOS when it has one, as ppo-rlhf scores)."""
    rows = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    logits = reward_logits(model, input_ids, attention_mask)
    chosen = logits[torch.arange(len(rows)), torch.tensor(labels)]
    return list(chosen.unbind())


# ---------------------------------------------------------------- the logits check
def check(args) -> None:
    inputs = torch.load(args.inputs)
    tokenizer = load_tokenizer(args.sft)
    policy = load_policy(args.sft, dropout_off=True).eval()
    reward = load_reward(args.reward)
    with torch.no_grad():
        ids, mask = inputs["input_ids"], inputs["attention_mask"]  # right-padded rows
        logits, _, values = policy(input_ids=ids, attention_mask=mask)  # TRL's own forward, as in step()
        scores = reward_logits(reward, ids, mask)
    encoded = [tokenizer(text)["input_ids"] for text in inputs["texts"]]
    import transformers
    import trl

    torch.save({"logits": logits, "reward_logits": scores, "encoded": encoded,
                "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__,
                             "trl": trl.__version__}}, args.out)


# ---------------------------------------------------------------- training
class ScoreNorm:
    """Scores less their running mean, over their running std (every score seen so far; Chan et
    al.'s update, as ppo-rlhf's score_norm).  TRL 0.11.4's own `use_score_scaling` fails on the
    first step (its RunningMoments keeps `std` as a Python float and `step` calls `.to` on it), so
    the same-settings row normalises the scores here, before `step`, and TRL's option stays off."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def __call__(self, scores: list[torch.Tensor]) -> list[torch.Tensor]:
        batch = torch.stack(scores).double()
        n, batch_mean, batch_var = batch.numel(), batch.mean().item(), batch.var(unbiased=False).item()
        delta, total = batch_mean - self.mean, self.count + n
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total
        return list(((batch - self.mean) / (math.sqrt(self.var) + 1e-8)).float().unbind())


def draw_batch(rows: list[dict], batch_size: int, generator: torch.Generator) -> list[dict]:
    """As ppo-rlhf's trainers/ppo_setup.py draw_batch with one sample per prompt (same torch, same draws)."""
    index = torch.randint(len(rows), (batch_size,), generator=generator)
    return [rows[i] for i in index.tolist()]


def train(args) -> None:
    settings = json.loads(Path(args.settings).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    if settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    warnings.filterwarnings("ignore", category=FutureWarning)  # "PPOTrainer is deprecated": we know
    warnings.filterwarnings("ignore", message="No dataset is provided")
    from trl import PPOConfig, PPOTrainer, set_seed

    seed = settings["seed"]
    set_seed(seed)  # the value head's initialisation too (PPOTrainer seeds again, after it)
    tokenizer = load_tokenizer(settings["sft"])
    policy = load_policy(settings["sft"], dropout_off=settings["dropout_off"])
    reward = load_reward(settings["reward"])
    rows = [json.loads(line) for line in Path(settings["prompts"]).read_text().splitlines() if line.strip()]
    config = PPOConfig(seed=seed, log_with=None, **settings["trl"])
    trainer = PPOTrainer(config, policy, ref_model=None, tokenizer=tokenizer)
    generation_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                         "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
                         "max_new_tokens": settings["max_new_tokens"]}
    batch_size = config.batch_size
    prompt_rng = torch.Generator().manual_seed(seed)
    save_every, iterations = settings["save_every"], settings["iterations"]
    score_norm = ScoreNorm() if settings.get("score_norm") else None

    def save(iteration: int) -> None:
        trainer.model.pretrained_model.save_pretrained(out / "policies" / f"{iteration:05d}")

    save(0)
    first_prompts = None
    with open(out / "metrics.jsonl", "w") as log:
        for iteration in range(1, iterations + 1):
            start = time.perf_counter()
            batch = draw_batch(rows, batch_size, prompt_rng)
            queries = [tokenizer(row["prompt"], return_tensors="pt")["input_ids"][0] for row in batch]
            t = time.perf_counter()
            responses = trainer.generate(queries, batch_size=batch_size, return_prompt=False, **generation_kwargs)
            generate = time.perf_counter() - t
            t = time.perf_counter()
            scores = score_responses(reward, queries, responses, [row["label"] for row in batch],
                                     tokenizer.pad_token_id)
            if score_norm is not None:
                scores_used = score_norm(scores)
            score = time.perf_counter() - t
            stats = trainer.step(queries, responses, scores_used if score_norm is not None else scores)
            wall = time.perf_counter() - start
            forward = (stats["time/ppo/forward_pass"] + stats["time/ppo/compute_rewards"]
                       + stats["time/ppo/compute_advantages"])
            optimize = stats["time/ppo/optimize_step"]
            record = {"iteration": iteration, "time/iteration": wall, "time/generate": generate,
                      "time/score": score, "time/forward": forward, "time/train": optimize,
                      "time/other": wall - generate - score - forward - optimize,
                      "time/trl_calc_stats": stats["time/ppo/calc_stats"],
                      "score": float(torch.stack(scores).mean()), "kl": float(stats["objective/kl"]),
                      "kl_coef": float(stats["objective/kl_coef"]),
                      "response_length": sum(len(r) for r in responses) / len(responses),
                      "update_steps": config.ppo_epochs * (batch_size // config.mini_batch_size)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if first_prompts is None:
                first_prompts = [row["prompt"] for row in batch]
            if iteration % save_every == 0 or iteration == iterations:
                save(iteration)
            if not math.isfinite(record["score"]) or not math.isfinite(record["kl"]):
                print(f"iteration {iteration}: non-finite score or KL", file=sys.stderr)
    import transformers
    import trl

    (out / "result.json").write_text(json.dumps({
        "system": "trl", "first_batch_prompts": first_prompts, "threads": torch.get_num_threads(),
        "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__, "trl": trl.__version__},
        "trl_config": {k: v for k, v in config.to_dict().items() if k in settings["trl"] or k in (
            "ppo_epochs", "cliprange", "gamma", "lam", "vf_coef", "cliprange_value", "adap_kl_ctrl", "init_kl_coef",
            "target", "horizon", "kl_penalty", "max_grad_norm", "early_stopping", "use_score_scaling",
            "use_score_norm", "whiten_rewards")},
    }, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check_parser = commands.add_parser("check")
    for name in ("--sft", "--reward", "--inputs", "--out"):
        check_parser.add_argument(name, required=True)
    train_parser = commands.add_parser("train")
    train_parser.add_argument("--settings", required=True)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check(args) if args.command == "check" else train(args)


if __name__ == "__main__":
    main()
