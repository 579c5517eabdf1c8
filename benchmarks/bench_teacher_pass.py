"""On-policy distillation's forward passes (issue 61, item 1): the teacher's pass against the
reference's on the same base and batch -- a teacher adapter on the student's shared LoRA base, and a
full teacher model of its own -- and what a distilling iteration saves by taking the policy's side of
the teacher's reward from the log-probs the loop sampled with instead of an old pass of its own
(docs/design.md, "On-policy distillation").  SmolLM2-135M-Instruct with LoRA, bench_distill.py's
recipe (the README's chain_sum batch: 4 prompts x 8 samples, 32 new tokens, one optimizer step),
everything in one process, the ways alternating (this machine's speed drifts).

    make smollm2
    python benchmarks/bench_teacher_pass.py            # 4 rounds of each

The teachers are made here from the base (an adapter of random weights, a copy of the base's
folder): a pass costs the same whatever the weights hold.  Writes
benchmarks/results/teacher_pass.{json,md}.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from common import ab_arguments, ab_settings, ab_trainer, alternate, command, header, machine, write_results

OUT = Path("runs/bench_teacher_pass")
RECIPE = {"task_config": "min_terms=2,max_terms=2,min_digits=1,max_digits=2", "samples_per_prompt": 8,
          "batch_size": 32, "mini_batch_size": 32, "max_new_tokens": 32, "lr": 1e-4, "temperature": 0.7,
          "estimator": "reinforce++", "gamma": 0.0, "reward_weights": [0.0], "kl_coef": 0.0, "kl_in": "reward",
          "format_reward": 0.0}


def make_teachers(model: str) -> dict[str, Path]:
    """A LoRA adapter on ``model`` (the README's r 16, all linear layers, random weights) and a
    full model of its own (the base's files under another folder)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter, full = OUT / "teacher-adapter", OUT / "teacher-full"
    if not (adapter / "adapter_config.json").is_file():
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM",
                          init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(model), lora).save_pretrained(adapter)
    full.mkdir(parents=True, exist_ok=True)
    for file in Path(model).iterdir():
        if not (full / file.name).exists():
            (full / file.name).symlink_to(file.resolve())
    return {"adapter on the shared base": adapter, "a model of its own": full}


def pass_seconds(trainer, rounds: int) -> dict[str, list[float]]:
    """Each forward pass of one rollout batch, as the trainer runs it (its micro-batches and pass
    plan), timed alternately ``rounds`` times after a warm-up."""
    rows = trainer.run_parts.train_rows[:4]
    experience, _ = trainer.make_experience([row for row in rows for _ in range(8)])
    sequences = experience.sequences  # the whole batch (one process)
    passes = {"reference": lambda: trainer.rollout_passes(sequences, lambda p: trainer.reference_stats(p).logprobs),
              "old (the policy adapter)": lambda: trainer.rollout_passes(
                  sequences, lambda p: trainer.policy_and_values(p)[0].logprobs),
              "teacher": lambda: trainer.teacher_passes(sequences)}
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for round_index in range(rounds + 1):
        for name in (list(passes) if round_index % 2 else list(passes)[::-1]):
            trainer.actor.eval()
            start = time.perf_counter()
            with torch.no_grad():
                passes[name]()
            if round_index:
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    args = ab_arguments(__doc__, rounds=4)
    args.task = "chain_sum" if args.task == "gcd" else args.task
    teachers = make_teachers(args.model)
    results = {"command": command(), "date": time.strftime("%Y-%m-%d"), "note": args.note, "machine": machine()}
    lines = [*header("On-policy distillation's passes: the teacher's against the reference's", results),
             f"SmolLM2-135M-Instruct with LoRA, reasoning-gym:{args.task}, 4 prompts x 8 samples, 32 new tokens; "
             f"median seconds over {args.rounds} alternating rounds.", "",
             "| teacher | reference pass | teacher pass | teacher / reference | old pass (the policy adapter) |",
             "|---|---|---|---|---|"]
    results["passes"], results["iterations"] = {}, {}
    for name, folder in teachers.items():
        settings = ab_settings(args, **RECIPE, teacher=str(folder), out=str(OUT / "run"))
        trainer = ab_trainer(settings)
        seconds = pass_seconds(trainer, args.rounds)
        median = {key: statistics.median(values) for key, values in seconds.items()}
        results["passes"][name] = seconds
        lines.append(f"| {name} | {median['reference']:.2f} | {median['teacher']:.2f} | "
                     f"{median['teacher'] / median['reference']:.2f}x | {median['old (the policy adapter)']:.2f} |")
        if name == "adapter on the shared base":  # the iteration with and without the old pass
            assert trainer.old_logprobs_from_update, "distillation's recipe should read the sampler's log-probs"

            def set_way(sampler: bool) -> None:
                trainer.old_logprobs_from_update = sampler

            results["iterations"] = alternate(trainer, set_way, 4, 8, args.rounds, "sampler's log-probs")
    iterations = {way: {key: statistics.median(t[key] for t in results["iterations"][way])
                        for key in ("time/forward", "time/iteration")} for way in (False, True)}
    lines += ["", "A distilling iteration (the adapter teacher), the policy's log-probs for the teacher's reward:", "",
              "| from | forward passes before the update | whole iteration |", "|---|---|---|"]
    for way, name in ((False, "an old pass of their own (before)"), (True, "the sampler (after)")):
        lines.append(f"| {name} | {iterations[way]['time/forward']:.2f} | {iterations[way]['time/iteration']:.2f} |")
    ratio = iterations[True]["time/iteration"] / iterations[False]["time/iteration"]
    lines += ["", f"Whole iteration: {ratio:.2f} of the time with an old pass.", ""]
    results["iterations"] = {str(k): v for k, v in results["iterations"].items()}
    write_results("teacher_pass", results, "\n".join(lines), indent=1)


if __name__ == "__main__":
    main()
