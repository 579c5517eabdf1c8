"""PPO configuration for language models: every knob, its default and what it does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ppo_rlhf.config import (HARDWARE, KL, MODEL_DATA, REWARD, ROLLOUT, RUN, SEEDS, TEMPERATURES,
                             THREADS, UPDATE, ConfigError, above, any_number, at_least, between, check, option)
from ppo_rlhf.core import (KL_ESTIMATORS, KL_PLACEMENTS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                           RATIO_LEVELS, check_kl_placement)
from ppo_rlhf.core.adaptive_lr import BAND, MAX_FACTOR, SPAN
from ppo_rlhf.core.offpolicy import default_cap
from ppo_rlhf.data import hold_data_objects
from ppo_rlhf.envs.options import EnvironmentOptions
from ppo_rlhf.hardware import HardwareOptions
from ppo_rlhf.models.lora import LoraOptions
from ppo_rlhf.recipes import recipe_names
from ppo_rlhf.rollout.engines import RolloutEngineOptions
from ppo_rlhf.rollout.reward import RewardOptions
from ppo_rlhf.run_folder import RunFolderOptions
from ppo_rlhf.trackers import ReportOptions
from ppo_rlhf.sharding import sharding_from_launch
from ppo_rlhf.tasks import TaskOptions
from ppo_rlhf.trainers.ppo_offpolicy import OffPolicyOptions
from ppo_rlhf.trainers.estimators import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    PAPER_LOSS_AGGREGATION,
    PAPER_WHITENING,
    uses_critic,
)


# Default learning rates.  Full fine-tuning: 1e-5 at GPT-2 small's width (768), scaled by
# 768 / hidden width.  Adam moves every weight by about lr per step whatever its gradient's size,
# and a unit's output sums its inputs over the width, so one lr changes a wide model's outputs more
# than a narrow one's (the muP rule for hidden weights).  That gives 1.3e-5 for SmolLM2-135M (576),
# 1.9e-6 for a 7B model (4096), in the range InstructGPT and TRL used at those sizes, and 1.2e-4
# for a 64-wide model a user builds to try things, which 1e-5 leaves flat for 20 iterations
# (tests/test_default_learning.py).  A LoRA adapter at 1e-5 barely moves (its update is the product
# of two small matrices, one starting at 0); 3e-4 is the value the SmolLM2 + LoRA example learns
# with (benchmarks/results/smollm2_vader.md), and the cap of the width rule.
FULL_MODEL_LR = 1e-5
REFERENCE_WIDTH = 768
LORA_LR = 3e-4
VF_COEF = 0.1
# The KL penalty's default weight: TRL's PPOTrainer's value for the same placement (k1 per token in
# the reward, summed over the response), InstructGPT's order (0.02).  The penalty is in the
# score's units, and a reward that only says right or wrong (0/1) moves a response's return by at
# most 1: at 0.3 (the built-in task's preset, whose scores are normalised) the penalty summed over
# ~100 sampled tokens held such a reward flat (accuracy 0.30 -> 0.38 in 30 iterations on a user's
# tiny model); at 0.05 it rises 1.8-2.4x on three seeds (docs/design.md, "Defaults that learn").
KL_COEF = 0.05
# On-policy distillation's weight of the per-token reverse KL to the teacher: 1, the reverse KL itself
# as the reward (Thinking Machines, 2025; Agarwal et al., 2024's on-policy GKD).
TEACHER_COEF = 1.0
# DAPO's values: the whole score (of a 0/1 reward) off at the limit; a few extra rounds before giving up.
OVERLONG_PENALTY = 1.0
MAX_RESAMPLE_ROUNDS = 4
# SAPO's temperatures (Gao et al., 2025; verl's and TRL's defaults): negative advantages damped faster.
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05
# PPO's clip range (Schulman et al., 2017; TRL's and verl's default).
CLIP_RATIO = 0.2
# GSPO's clip range of the sequence ratio (Zheng et al., 2025), for the help and the plan.
GSPO_CLIP = "3e-4 / 4e-4"


def default_lr(hidden_width: int | None, lora: bool) -> float:
    """The actor's learning rate when --lr is not given (see above)."""
    if lora:
        return LORA_LR
    if not hidden_width:  # a config without a width: the GPT-2 small value
        return FULL_MODEL_LR
    return min(FULL_MODEL_LR * REFERENCE_WIDTH / hidden_width, LORA_LR)


@dataclass
class PPOConfig(RewardOptions, RunFolderOptions, ReportOptions, LoraOptions, HardwareOptions, TaskOptions,
                OffPolicyOptions, RolloutEngineOptions, EnvironmentOptions):
    """Every PPO knob.  With ``--lora`` one base model serves all four roles (models/lora.py):
    the actor is a policy adapter, the reference is the base with adapters disabled, a reward
    adapter from ``rm --lora`` runs on the same base, and ``--critic lora`` adds a critic adapter."""

    # The fields naming a file or folder the run reads: --out may not be, hold or lie in one (run_folder.py).
    input_paths: ClassVar[tuple] = ("model", "reward_model", "critic_model", "teacher", "prompts", "eval_prompts",
                                    "chat_template_file", "reward_judge", "judge_template")

    # --- model and data
    model: str | None = option(None, "actor initialisation: the SFT causal LM folder (also the frozen reference)",
                               group=MODEL_DATA, first=True)
    prompts: str | None = option(None, "prompt rows (JSONL/Parquet/save_to_disk, or a data set's name in the local Hugging "
                                       "Face cache; from Python also a datasets Dataset, IterableDataset or "
                                       "DatasetDict); {prompt}, {messages} or Alpaca {instruction, input}",
                                 group=MODEL_DATA, first=True)
    eval_prompts: str | None = option(None, "held-out prompt rows for evaluation (default: the task's, else none)",
                                      group=MODEL_DATA)
    chat_template: bool | None = option(None, "format prompts with the tokenizer's chat template; empty: on where "
                                              "the prompts are chat messages (--environment or --tool episodes, a "
                                              "reasoning-gym --task), else off", group=MODEL_DATA)
    prompt_field: str = option("prompt", "field of the prompt rows holding the prompt", group=MODEL_DATA)
    label_field: str = option("label", "field naming the class to reward, for a multi-class reward model",
                              group=MODEL_DATA)
    data_split: str = option("train", "the split of --prompts when it names a data set in the local Hugging Face cache",
                             group=MODEL_DATA)
    eval_split: str = option("test", "the split of --eval-prompts when it names a data set in the local Hugging Face "
                                     "cache", group=MODEL_DATA)
    critic: str = option("shared", "shared: value head on the actor's trunk; separate: its own model; lora: its own "
                                   "adapter on the actor's base (needs --lora)", choices=("shared", "separate", "lora"),
                         group=MODEL_DATA)
    critic_model: str | None = option(None, "separate critic initialisation (default: the reward model when it shares "
                                            "the actor's tokenizer, else the actor)", group=MODEL_DATA)

    # --- reward (the score and its shaping)
    reward_model: str | None = option(None, "reward model folder (sequence classifier); or, or with it, --reward-fn "
                                            "and --reward-url (the score is then the weighted sum, --reward-weights)",
                                      group=REWARD, first=True)
    missing_eos_penalty: float | None = option(None, "subtracted from the score of responses that never emit EOS, "
                                                     "as in TRL (>= 0; empty: no penalty)", range=at_least(0),
                                               group=REWARD)
    score_norm: bool = option(False, "normalise scores by their running mean and std", group=REWARD)
    score_clip: float | None = option(None, "clip scores to [-x, x] (empty: no clipping)", range=above(0),
                                      group=REWARD)
    overlong_buffer: int | None = option(None, "DAPO's soft overlong punishment: over the last L tokens before "
                                               "max_new_tokens the score loses up to overlong_penalty, linearly "
                                               "(empty: off)", range=above(0), group=REWARD)
    overlong_penalty: float | None = option(None, f"the most --overlong-buffer takes off a score, at max_new_tokens "
                                                  f"(empty: {OVERLONG_PENALTY:g} with a buffer)", range=above(0),
                                            group=REWARD)
    teacher: str | None = option(None, "on-policy distillation: a causal LM folder or a run's checkpoint (a --lora "
                                       "run's adapter too) with the student's tokenizer, whose log-probs of the "
                                       "student's own tokens give each token the reward -teacher_coef * (log pi - "
                                       "log teacher), besides any other reward (docs/estimators.md)", group=REWARD)
    teacher_coef: float | None = option(None, f"--teacher: weight of the per-token reward -teacher_coef * (log pi - "
                                              f"log teacher), in the score's units; gae, reinforce++ and remax take it "
                                              f"per token, the group estimators summed over the response into its "
                                              f"score (empty: {TEACHER_COEF:g})", range=above(0), group=REWARD)
    teacher_in: str = option("reward", "--teacher: where its reverse KL goes.  reward: -teacher_coef * (log pi - log "
                                       "teacher) on each token the student sampled, through PPO's score-function "
                                       "update (Thinking Machines' on-policy distillation); loss: teacher_coef x the "
                                       "exact reverse KL over the vocabulary at every position of the student's "
                                       "samples, differentiated directly (GKD's on-policy divergence), which also "
                                       "moves tokens the student never samples", choices=("reward", "loss"),
                             group=REWARD)

    # --- rollout
    batch_size: int = option(64, "sequences per PPO iteration (rollout batch): batch_size / samples_per_prompt "
                                 "prompts, each sampled samples_per_prompt times (so a multiple of it)", range=above(0),
                             group=ROLLOUT, first=True)
    samples_per_prompt: int = option(1, "responses sampled for each prompt of the batch (K), in adjacent rows; "
                                        "grpo, dr-grpo and rloo need K >= 2 (their baseline is the other responses)",
                                        range=above(0), group=ROLLOUT, first=True)
    max_new_tokens: int = option(128, "longest response in tokens", range=above(0), group=ROLLOUT, first=True)
    max_length: int | None = option(None, "longest prompt + response in tokens (empty: 256, or 1024 with "
                                          "--environment or --tool, whose prompts list tools and whose episodes "
                                          "hold several turns); prompts are cut from the left to fit",
                                    range=above(1), group=ROLLOUT, first=True)
    temperature: float = option(1.0, "sampling temperature; the same one divides the logits of the log-probs "
                                     "(below 0.01 sampling is greedy decoding: --no-do-sample)",
                                range=TEMPERATURES, group=ROLLOUT)
    do_sample: bool = option(True, "sample responses, as PPO's gradient assumes; --no-do-sample: greedy rollouts, a "
                                   "debugging mode in which every copy of a prompt gets the same response and "
                                   "nothing is explored (it warns at start)", group=ROLLOUT)
    dynamic_sampling: bool = option(False, "DAPO's dynamic sampling: drop the prompt groups whose K scores are all "
                                           "equal (no signal for a group baseline) and sample more prompts until the "
                                           "batch is full (group estimators: grpo, dr-grpo, rloo)", group=ROLLOUT)
    dynamic_sampling_on: str | None = option(None, "dynamic sampling: which scores must differ within a group. "
                                                   "accuracy: the rewards as they came, before any shaping (DAPO's "
                                                   "filter on the task's accuracy: an all-right group stays all right "
                                                   "whatever the overlong or missing-EOS penalties make of it); score: "
                                                   "after the shaping; empty: accuracy with --dynamic-sampling",
                                             choices=(None, "accuracy", "score"), group=ROLLOUT)
    prompt_order: str = option("random", "how each iteration's prompts are drawn: random (with replacement, from "
                                         "--seed's generator) or in-order (the rows in turn from the first, wrapping "
                                         "around: TRL's shuffle_dataset=False, and how a streamed data set is read)",
                               choices=("random", "in-order"), group=ROLLOUT)
    max_resample_rounds: int | None = option(None, f"dynamic sampling: extra rounds of sampling at most per "
                                                   f"iteration; after them the batch is completed with dropped "
                                                   f"groups (empty: {MAX_RESAMPLE_ROUNDS})", range=at_least(0),
                                             group=ROLLOUT)

    # --- update and loss
    iterations: int = option(200, "PPO iterations (rollout + update)", range=above(0), group=UPDATE, first=True)
    lr: float | None = option(None, f"learning rate of the actor (AdamW); empty: for a full model {FULL_MODEL_LR:g} x "
                                    f"{REFERENCE_WIDTH} / the model's hidden width (1.3e-5 for a 576-wide 135M model, "
                                    f"1.9e-6 for a 4096-wide 7B, at most {LORA_LR:g}), {LORA_LR:g} with --lora (an "
                                    f"adapter needs larger steps to move); the value used is printed and recorded",
                                    range=above(0), group=UPDATE, first=True)
    estimator: str = option(
        "gae", "advantage estimator; only the advantage changes, rollout, reward, KL and clipped loss stay. "
               "gae: PPO with a critic; critic-free (no critic built, trained or saved): grpo (score - group mean) "
               "/ group std, dr-grpo (score - group mean), rloo (score - mean of the other K-1), reinforce++ "
               "(return-to-go, whitened over the batch), remax (score - the greedy response's score, one extra "
               "greedy rollout per prompt).  KL as each paper put it: PPO, RLOO, ReMax and REINFORCE++ k1 in the "
               "reward (--kl-in reward); GRPO k3 in the loss (--kl-in loss --kl-coef 0.04); Dr. GRPO none "
               "(--kl-coef 0).  --kl-in is kept as given",
        choices=ESTIMATORS, group=UPDATE, first=True)
    ppo_epochs: int = option(4, "passes over each rollout batch", range=above(0), group=UPDATE)
    mini_batch_size: int = option(16, "sequences per gradient step; must divide batch_size", range=above(0),
                                  group=UPDATE)
    policy_loss: str = option("clip", "the policy-gradient surrogate.  clip: PPO's clipped ratio (and its variants: "
                                      "clip-higher, dual clip, GSPO's sequence ratio); cispo (MiniMax-M1): every "
                                      "token's log-prob gradient weighted by its ratio clipped to [1 - low, 1 + high], "
                                      "a constant, so no token loses its gradient (no lower bound unless "
                                      "--clip-ratio-low is given; its paper normalises over all tokens: "
                                      "--loss-aggregation token-mean); sapo (Qwen): a soft gate "
                                      "4/tau sigmoid(tau (ratio - 1)) in place of the clip",
                              choices=POLICY_LOSSES, group=UPDATE)
    loss_aggregation: str | None = option(
        None, "how the per-token policy (and KL) loss becomes one number.  token-mean: over all response tokens of "
              "the batch (long responses weigh more); sequence-mean: over each response's tokens, then over "
              "responses (GRPO's; a token of a long response weighs less, so long wrong answers are penalised less "
              "per token and responses can grow); sequence-sum-norm: each response's token sum over max_new_tokens, "
              "then over responses (Dr. GRPO's; no length bias).  Empty: the estimator's paper (grpo sequence-mean, "
              "dr-grpo sequence-sum-norm, others token-mean); set it to compare estimators with the loss fixed",
        choices=(None, *LOSS_AGGREGATIONS), group=UPDATE)
    clip_ratio: float | None = option(None, f"PPO clip range of the probability ratio: clip(ratio, 1 - x, 1 + x); "
                                            f"sets both bounds unless clip_ratio_low / clip_ratio_high are given "
                                            f"(empty: {CLIP_RATIO:g}; none with --policy-loss sapo, which has no clip)",
                                      range=above(0), group=UPDATE)
    clip_ratio_low: float | None = option(None, "lower clip range, ratio >= 1 - x (empty: clip_ratio; cispo: no "
                                                "lower bound, and a value >= 1 is none as well)", range=above(0),
                                          group=UPDATE)
    clip_ratio_high: float | None = option(None, "upper clip range, ratio <= 1 + x (empty: clip_ratio); DAPO's "
                                                 "clip-higher uses 0.28 with 0.2 below, so unlikely tokens with a "
                                                 "positive advantage can gain probability and the entropy does not "
                                                 "collapse", range=above(0), group=UPDATE)
    dual_clip: float | None = option(None, "dual-clip PPO: for a negative advantage the loss is at most -C x A "
                                           "(C > 1, e.g. 3), bounding what a ratio far above 1 can do (empty: off)",
                                           range=above(1), group=UPDATE)
    ratio_level: str = option("token", "token: PPO's per-token ratio; sequence: GSPO's, one ratio per response "
                                       "(exp of its mean token log-ratio) on every token of it, each token keeping "
                                       "its own advantage and weight (GSPO-token; with one advantage per response, "
                                       f"GSPO exactly).  The GSPO paper clips it at {GSPO_CLIP}: "
                                       "--clip-ratio-low 3e-4 --clip-ratio-high 4e-4 (clip loss only)",
                              choices=RATIO_LEVELS, group=UPDATE)
    sapo_tau_pos: float | None = option(None, f"sapo: the gate's temperature for tokens with a positive advantage "
                                              f"(empty: {SAPO_TAU_POS:g} with sapo)", range=above(0), group=UPDATE)
    sapo_tau_neg: float | None = option(None, f"sapo: the gate's temperature for the others, larger to damp them "
                                              f"faster (empty: {SAPO_TAU_NEG:g} with sapo)", range=above(0),
                                        group=UPDATE)
    gamma: float = option(1.0, "discount per token", range=between(0, 1), group=UPDATE)
    lam: float = option(1.0, "GAE lambda (gae only).  1: every token's advantage is the response's return minus "
                             "the critic's value, so a score given at the end reaches every token from the first "
                             "iteration; below 1 the critic's (at first untrained) values stand in for the rest, and "
                             "only the last ~1/(1 - lam) tokens hear the score until the critic has learned",
                             range=between(0, 1), group=UPDATE)
    whiten_advantages: bool | None = option(None, "whiten advantages over the response tokens of the batch; empty: as "
                                                  "the estimator's paper (gae and reinforce++ yes, the group and "
                                                  "greedy baselines no)", group=UPDATE)
    vf_coef: float | None = option(None, f"weight of the value loss (gae only); empty: {VF_COEF:g}", range=at_least(0),
                                   group=UPDATE)
    cliprange_value: float | None = option(0.2, "clip range of the value update around the old values (empty: none; "
                                                "gae only)", range=above(0), group=UPDATE)
    critic_lr: float | None = option(None, "learning rate of the critic (value head, or separate critic); empty: lr "
                                           "(gae only)", range=above(0), group=UPDATE)
    critic_warmup: int = option(0, "first N iterations train only the critic, so early advantages are not noise "
                                   "(gae only)", range=at_least(0), group=UPDATE)
    entropy_coef: float = option(0.0, "weight of the entropy bonus (loss -= entropy_coef * entropy); negative: an "
                                      "entropy penalty that sharpens the policy (the built-in task's preset: -1.0, ramped in "
                                      "over 100 iterations by entropy_warmup)", range=any_number(), group=UPDATE)
    entropy_warmup: int = option(0, "iterations over which entropy_coef ramps linearly from 0 to its value (0: at its "
                                    "value from the first iteration); a penalty then sharpens only a policy that has "
                                    "had time to explore", range=at_least(0), group=UPDATE)
    max_approx_kl: float | None = option(None, "end an iteration's update early once a minibatch's approx_kl "
                                               "(rollout policy -> current) exceeds this; empty: never", range=above(0),
                                         group=UPDATE)
    lr_target_kl: float | None = option(None, f"adapt the actor's lr at each step so the update moves the policy by "
                                              f"about this approx_kl from the one that sampled the batch (rsl_rl's "
                                              f"'adaptive' schedule; docs/design.md, \"A learning rate that follows "
                                              f"the update\"): x sqrt(target / kl) when outside [target/{BAND:g}, "
                                              f"{BAND:g} target], at most x{MAX_FACTOR:g} or /{MAX_FACTOR:g} a step, "
                                              f"within [lr/{SPAN:g}, lr x {SPAN:g}]; empty: lr fixed",
                                        range=above(0), group=UPDATE)
    weight_decay: float = option(0.0, "AdamW weight decay", range=at_least(0), group=UPDATE)
    adam_eps: float = option(1e-8, "AdamW epsilon; larger values damp the full-size steps Adam takes on parameters "
                                   "whose gradients are tiny noise", range=above(0), group=UPDATE)
    max_grad_norm: float = option(1.0, "clip the gradient norm to this", range=above(0), group=UPDATE)
    max_bad_steps: int = option(5, "skip a minibatch step with a non-finite loss or gradient norm (and an iteration "
                                   "with a non-finite score); stop after this many in a row", range=at_least(1),
                                group=UPDATE)
    disable_dropout: bool = option(True, "turn dropout off in actor and critic, so the first ratio is exactly 1 "
                                         "(all but --lora-dropout, which is kept)", group=UPDATE)
    recipe: str | None = option(None, "measured settings in place of the defaults (ppo_rlhf/recipes.py, docs/agents.md "
                                      "\"Recipes\"): agents-grpo (LoRA, GRPO on groups of episodes) or agents-ppo "
                                      "(LoRA, PPO with a critic); a setting given in --config or by a flag wins over "
                                      "the recipe's; the plan prints both",
                                choices=(None, *recipe_names("PPOConfig")), group=UPDATE)

    # --- KL
    kl_coef: float = option(KL_COEF, "weight of the per-token KL penalty -kl_coef * kl[t] (initial value if "
                                     "--target-kl)", range=at_least(0), group=KL, first=True)
    kl_in: str = option("reward", "where the KL to the reference goes: reward (r[t] = -kl_coef * kl[t], PPO's "
                                  "classic) or loss (+ kl_coef * mean(kl), differentiated directly, as GRPO does)",
                        choices=KL_PLACEMENTS, group=KL)
    kl_estimator: str | None = option(None, "per-token KL estimator, checked against kl_in: k1 (log ratio) in the "
                                            "reward; k3, k2 or full (exact over the vocabulary) in the loss; "
                                            "empty: k1 in the reward, k3 in the loss",
                                      choices=(None, *KL_ESTIMATORS), group=KL)
    target_kl: float | None = option(None, "adapt kl_coef toward this KL per response (Ziegler et al.); empty: fixed",
                                     range=above(0), group=KL)
    kl_horizon: int = option(10000, "adaptive KL: samples over which kl_coef moves by at most 20%", range=above(0),
                             group=KL)

    # --- hardware and memory
    num_threads: int = option(0, "torch CPU threads (0: leave torch's default)", range=THREADS, group=HARDWARE)
    gradient_checkpointing: bool = option(False, "recompute each layer's activations in the backward pass instead of "
                                                 "storing them (actor and critic): less memory, about 30% more compute",
                                          group=HARDWARE)
    train_micro_batch_size: int | None = option(None, "rows per forward/backward pass within a minibatch, the "
                                                      "gradients accumulated over them (per process); must divide "
                                                      "mini_batch_size; empty: the whole minibatch.  Same step, "
                                                      "less memory", range=above(0), group=HARDWARE)
    rollout_micro_batch_size: int | None = option(None, "rows per forward pass of the rollout's old, reference and "
                                                        "critic passes (their logits are (rows, T, vocabulary)); "
                                                        "empty: the whole batch at once.  Same results, less memory",
                                                        range=above(0), group=HARDWARE)
    max_tokens_per_micro_batch: int | str | None = option(
        "auto", "fill each micro-batch of the rollout's passes and of the update up to this many tokens (prompt + "
                "response), rows grouped longest first, instead of a number of rows: long and short responses share "
                "passes by their tokens; the step stays the whole minibatch's.  auto: as many as half the memory free "
                "at start holds (on a CPU at most 4 GiB a pass), from the model's size, said in the plan.  Empty: by "
                "rows (--rollout-micro-batch-size, --train-micro-batch-size)",
        range=above(0), words=("auto",), group=HARDWARE)
    padding_free: bool = option(True, "forward passes with the batch's rows packed end to end, position ids "
                                      "restarting at each row, instead of padded to the longest (with "
                                      "--fused-output-layer; checked against the padded pass on the first batch, off "
                                      "where a model differs)", group=HARDWARE)
    fused_output_layer: bool = option(True, "log-probs and entropies from the hidden states a chunk of positions at a "
                                            "time through the output layer, never the (rows, positions, vocabulary) "
                                            "logits (checked against the model's own forward on the first batch)",
                                      group=HARDWARE)
    share_prompts: bool = option(True, "with --samples-per-prompt K > 1, run each distinct prompt once per forward "
                                       "pass and its K responses on its cached keys and values (checked against the "
                                       "full pass on the first batch; off under FSDP and --gradient-checkpointing)",
                                 group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str = option("runs/ppo", "run folder", group=RUN, first=True)
    resume: bool = option(False, "continue the run in --out from OUT/checkpoints/last (its settings must match but for "
                                 "iterations, evaluation, saving and learning rates)", group=RUN, first=True)
    seed: int = option(0, "random seed", range=SEEDS, group=RUN)
    save_every: int = option(50, "write a resumable checkpoint every N iterations (0: only at the end)",
                             range=at_least(0), group=RUN)
    eval_every: int = option(10, "evaluate on held-out prompts every N iterations (0: only at the end)",
                             range=at_least(0), group=RUN)
    eval_size: int = option(2000, "held-out prompts per evaluation", range=above(0), group=RUN)
    eval_sampled: bool = option(True, "also evaluate with sampled decoding (temperature 1) at each evaluation",
                                group=RUN)
    eval_samples: int = option(1, "responses sampled for each held-out prompt in the sampled evaluation: above 1, "
                                  "eval_sampled/pass@k for k = 1..K, mean@K and maj@K as `eval --samples K` gives "
                                  "them (from the task's checker, or a reward of 0 or 1)", range=above(0), group=RUN)
    show_samples: int = option(0, "held-out prompts whose greedy responses before and after PPO go in summary.json",
                               range=at_least(0), group=RUN)
    sample_every: int = option(10, "every N iterations, print a few training rollouts (prompt, response, score) and "
                                   "add them to samples.jsonl and TensorBoard (0: never)", range=at_least(0),
                               group=RUN)
    save_rollouts: int = option(0, "every N iterations, write that iteration's rollouts to rollouts/iteration_N.jsonl: "
                                   "prompts, messages, token ids, the loss mask, rewards, tool calls (0: never)",
                                range=at_least(0), group=RUN)

    def __post_init__(self) -> None:
        # Data sets given in memory (PPOConfig(prompts=dataset)) are kept aside, the fields recording them.
        hold_data_objects(self, ("prompts", "eval_prompts"))
        super().__post_init__()

    @staticmethod
    def saved_settings_now(saved: dict) -> dict:
        """A run saved before --is-correction and --dynamic-sampling-on, as those settings spell what
        it did: --tis-cap C was token-truncate with cap C (empty: no weights), and dynamic sampling
        decided on the shaped scores; and one saved when the defaults were recorded for options that
        did nothing: a torch engine's importance weights (token-truncate, cap 2: none were applied) and
        SAPO's clip range (trainers/resume.py reads a saved run through this)."""
        saved = dict(saved)
        if "tis_cap" in saved:
            saved["is_cap"] = saved.pop("tis_cap")
            saved.setdefault("is_correction", "token-truncate" if saved["is_cap"] is not None else "none")
        if saved.get("dynamic_sampling") and "dynamic_sampling_on" not in saved:
            saved["dynamic_sampling_on"] = "score"
        if (saved.get("rollout_engine", "torch") == "torch" and saved.get("is_correction") == "token-truncate"
                and saved.get("is_cap") == default_cap("token-truncate") and saved.get("is_floor") is None):
            saved.update(is_correction="none", is_cap=None)
        if saved.get("policy_loss") == "sapo" and saved.get("clip_ratio") == CLIP_RATIO:
            saved["clip_ratio"] = None
        return saved

    def validate(self) -> None:
        self.resolve_max_length()
        self.validate_lora()
        self.validate_hardware()
        self.validate_task()
        self.validate_engine()
        check(self.critic != "lora" or self.lora, "critic", "shared or separate without --lora (lora needs --lora)",
              self.critic)
        if sharding_from_launch() is not None:  # an FSDP launch whose settings ppo-rlhf follows
            check(not self.lora, "lora", "off under an FSDP launch (ppo-rlhf shards full models; LoRA on one base "
                                         "runs data parallel: configs/accelerate/gpus_ddp.yaml)", self.lora)
        self.validate_estimator()
        check(self.batch_size % self.mini_batch_size == 0, "mini_batch_size",
              f"a divisor of batch_size ({self.batch_size})", self.mini_batch_size)
        check(self.train_micro_batch_size is None or self.mini_batch_size % self.train_micro_batch_size == 0,
              "train_micro_batch_size", f"a divisor of mini_batch_size ({self.mini_batch_size}) or empty",
              self.train_micro_batch_size)
        if self.lr is None and self.lora:  # resolved here, so config.yaml records the value used
            self.lr = LORA_LR
        # A full model's default needs its width: the trainer resolves it (resolve_lr).
        self.validate_loss_variants()
        try:
            check_kl_placement(self.kl_in, self.kl_estimator)
        except ValueError as error:
            raise ConfigError(f"invalid value for 'kl_estimator': {self.kl_estimator!r} with kl_in "
                              f"{self.kl_in!r}; {error}") from None
        # Options that would do nothing in the mode chosen are refused by name (docs/design.md, "Configuration").
        check(self.lr_target_kl is None or self.ppo_epochs * (self.batch_size // self.mini_batch_size) >= 2,
              "lr_target_kl", "left out with one optimizer step an iteration (the policy's move is measured at the "
              "steps after the first: raise --ppo-epochs or lower --mini-batch-size)", self.lr_target_kl)
        check(self.target_kl is None or self.kl_coef > 0, "target_kl",
              "left out with kl_coef 0 (the adaptive controller scales kl_coef, and 0 stays 0)", self.target_kl)
        check(self.critic_model is None or self.critic == "separate", "critic_model",
              f"left out unless --critic separate (critic {self.critic} builds no model of its own)", self.critic_model)
        check(self.show_samples == 0 or self.eval_prompts is not None or self.task is not None, "show_samples",
              "0 without held-out prompts (--eval-prompts, or a --task's)", self.show_samples)
        check(self.max_length > self.max_new_tokens, "max_length", f"> max_new_tokens ({self.max_new_tokens})", self.max_length)
        check(self.eval_samples == 1 or self.eval_sampled, "eval_samples",
              "1 with --no-eval-sampled (the K samples are the sampled evaluation's; drop --no-eval-sampled)",
              self.eval_samples)
        self.validate_teacher()
        self.validate_staleness()
        self.validate_rewards()
        self.validate_pass_at_k()
        self.validate_environment()
        self.validate_episode_rewards()
        self.chat_template = bool(self.chat_template)  # empty and nothing asked for it: off (recorded so)
        # (--chat-template-file unused is refused by PPOTrainer: tools given in Python may use it.)

    def validate_pass_at_k(self) -> None:
        """--eval-samples K's pass@k needs held-out prompts to sample and a right-or-wrong outcome
        per response: refused here where the settings say it has neither, not at the first sampled
        evaluation (with --eval-every 0, after the last iteration).  The scores of the evaluation
        before the first iteration are checked too (trainers/ppo_loop.py)."""
        if self.eval_samples == 1:
            return
        check(self.eval_prompts is not None or self.task is not None, "eval_samples",
              "1 without held-out prompts: the K samples are drawn for each held-out prompt, and without "
              "--eval-prompts FILE (or a --task's own) the run evaluates nothing; give --eval-prompts FILE",
              self.eval_samples)
        from ppo_rlhf.evaluation import pass_at_k_refusal

        refusal = pass_at_k_refusal(self)
        if refusal is not None:
            raise ConfigError(f"invalid value for 'eval_samples': {self.eval_samples}; pass@k needs a right-or-wrong "
                              f"outcome per response, and {refusal}: give a reward that scores 1 for right and 0 for "
                              f"wrong (--reward-fn), or --eval-samples 1")

    def validate_teacher(self) -> None:
        """--teacher's weight, and dynamic sampling, whose filter reads only the score: a group of
        equal scores still differs in what the teacher makes of each token."""
        if self.teacher is None:
            check(self.teacher_coef is None, "teacher_coef", "left out without --teacher", self.teacher_coef)
            check(self.teacher_in == "reward", "teacher_in", "left out without --teacher", self.teacher_in)
            return
        if self.teacher_coef is None:  # resolved here, so config.yaml records the value used
            self.teacher_coef = TEACHER_COEF
        check(not self.dynamic_sampling, "dynamic_sampling",
              "off with --teacher: it drops the groups whose scores are all equal, which under distillation still "
              "carry the teacher's per-token signal", self.dynamic_sampling)

    def validate_episode_rewards(self) -> None:
        """The environment's reward options need an environment that pays: tools alone earn nothing
        (the run's reward functions score their episodes)."""
        if self.environment is not None or not self.tool:
            return
        check(self.turn_rewards == "sum", "turn_rewards", "sum with --tool alone: tools pay no rewards, per turn or "
              "otherwise (an --environment's step rewards can go per turn)", self.turn_rewards)
        check(self.environment_reward_weight == 1.0, "environment_reward_weight",
              "left out with --tool alone: there is no environment reward to weigh (--reward-weights weighs the "
              "reward functions)", self.environment_reward_weight)

    def require_a_reward(self, environment_pays: bool = False) -> None:
        """A run needs a reward: the config's own, the task's rule, or an environment's
        (``environment_pays``).  Not part of ``validate``: a config built in Python may leave the
        reward to the trainer (``PPOTrainer(config, reward=f)``)."""
        if environment_pays and self.environment_reward_weight == 0 and not self.reward_count() and self.task is None \
                and self.teacher is None:
            raise ConfigError("invalid value for 'environment_reward_weight': 0 with the environment's rewards the "
                              "run's only ones: every score would be 0; give a non-zero weight, or a reward of your "
                              "own (--reward-fn, --reward-model, --reward-url, --reward-judge, --teacher)")
        if not self.reward_count() and self.task is None and not environment_pays and self.teacher is None:
            raise ConfigError("no reward: give --reward-model DIR, --reward-fn module:function or --reward-url URL "
                              "(several are summed), --task doubling for its rule, an --environment that pays "
                              "rewards (tools alone do not), or a --teacher to distill")

    def validate_estimator(self) -> None:
        """Samples per prompt, critic settings and paper defaults for the advantage estimator."""
        k = self.samples_per_prompt
        if self.estimator in GROUP_ESTIMATORS:
            check(k >= 2, "samples_per_prompt", f">= 2 with estimator {self.estimator} (its baseline is the other "
                                                f"responses to the same prompt)", k)
        check(self.batch_size % k == 0, "batch_size",
              f"a multiple of samples_per_prompt ({k}): batch_size counts sequences, batch_size / {k} prompts "
              f"sampled {k} times each", self.batch_size)
        if uses_critic(self.estimator):
            if self.vf_coef is None:  # resolved here, so config.yaml records the value used
                self.vf_coef = VF_COEF
        else:
            no_critic = f"left out with estimator {self.estimator}, which has no critic (only gae trains one)"
            for key, given in (("critic", self.critic != "shared"), ("critic_model", self.critic_model is not None),
                               ("critic_lr", self.critic_lr is not None), ("critic_warmup", self.critic_warmup != 0),
                               ("vf_coef", self.vf_coef is not None)):
                check(not given, key, no_critic, getattr(self, key))
        if self.loss_aggregation is None:
            self.loss_aggregation = PAPER_LOSS_AGGREGATION[self.estimator]
        if self.whiten_advantages is None:
            self.whiten_advantages = PAPER_WHITENING[self.estimator]

    def validate_loss_variants(self) -> None:
        """Clip bounds, dual clip, sequence ratio, dynamic sampling and overlong shaping
        (docs/design.md, "Policy-loss variants"): ranges, and the combinations that make no sense."""
        if self.policy_loss != "sapo" and self.clip_ratio is None:  # resolved here: config.yaml records it
            self.clip_ratio = CLIP_RATIO
        if self.policy_loss == "clip":  # CISPO's lower range may remove its bound (>= 1); SAPO has none
            check(self.clip_low < 1, "clip_ratio_low" if self.clip_ratio_low is not None else "clip_ratio",
                  "below 1 for the lower clip range (the ratio's lower bound 1 - x must stay above 0); set "
                  "clip_ratio_low to widen only the upper one", self.clip_low)
            check(self.clip_high >= self.clip_low, "clip_ratio_high",
                  f">= the lower clip range ({self.clip_low:g}): clip-higher widens the upper bound, a narrower one "
                  f"would hold back exactly the tokens a positive advantage should raise", self.clip_ratio_high)
        # GSPO's sequence ratio takes per-token advantages (GSPO-token), a critic's too; the other
        # surrogates have a ratio of their own (docs/design.md, "Policy-loss variants").
        not_clip = f"left out with --policy-loss {self.policy_loss}, which has no clipped ratio to change"
        for key, given in (("ratio_level", self.ratio_level != "token"), ("dual_clip", self.dual_clip is not None)):
            check(self.policy_loss == "clip" or not given, key, not_clip, getattr(self, key))
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            check(self.policy_loss != "sapo" or getattr(self, key) is None, key,
                  "left out with --policy-loss sapo: its soft gate has no clip range (--sapo-tau-pos, --sapo-tau-neg "
                  "shape it)", getattr(self, key))
        if self.policy_loss == "sapo":  # resolved here, so config.yaml records the values used
            self.sapo_tau_pos = SAPO_TAU_POS if self.sapo_tau_pos is None else self.sapo_tau_pos
            self.sapo_tau_neg = SAPO_TAU_NEG if self.sapo_tau_neg is None else self.sapo_tau_neg
        else:
            for key in ("sapo_tau_pos", "sapo_tau_neg"):
                check(getattr(self, key) is None, key, "left out without --policy-loss sapo", getattr(self, key))
        self.validate_is_correction()
        check(self.overlong_buffer is None or self.overlong_buffer <= self.max_new_tokens, "overlong_buffer",
              f"1..max_new_tokens ({self.max_new_tokens}) or empty: the penalty grows over the last L tokens "
              f"before the limit", self.overlong_buffer)
        check(self.overlong_penalty is None or self.overlong_buffer is not None, "overlong_penalty",
              "left out without --overlong-buffer (it is the most that buffer takes off a score)", self.overlong_penalty)
        if self.overlong_buffer is not None and self.overlong_penalty is None:  # resolved: config.yaml records it
            self.overlong_penalty = OVERLONG_PENALTY
        if self.dynamic_sampling:
            check(self.estimator in GROUP_ESTIMATORS, "dynamic_sampling",
                  f"off with estimator {self.estimator}: a group of equal scores carries no signal only under a "
                  f"group baseline ({', '.join(GROUP_ESTIMATORS)}); with a critic, a greedy baseline or none, its "
                  f"advantages are not 0", self.dynamic_sampling)
            if self.max_resample_rounds is None:
                self.max_resample_rounds = MAX_RESAMPLE_ROUNDS
            if self.dynamic_sampling_on is None:
                self.dynamic_sampling_on = "accuracy"
        else:
            for key in ("max_resample_rounds", "dynamic_sampling_on"):
                check(getattr(self, key) is None, key, "left out without --dynamic-sampling", getattr(self, key))

    @property
    def clip_low(self) -> float:
        """The lower clip range in force: ratio >= 1 - clip_low."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """The upper clip range in force: ratio <= 1 + clip_high."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def kl_estimator_used(self) -> str:
        """The estimator in force: the one given, or kl_in's default."""
        return check_kl_placement(self.kl_in, self.kl_estimator)

    @property
    def max_prompt_length(self) -> int:
        return self.max_length - self.max_new_tokens
