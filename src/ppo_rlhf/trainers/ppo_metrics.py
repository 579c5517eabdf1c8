"""Stage 8 of a PPO iteration, its metrics (docs/design.md, "Metrics"): what every iteration logs
-- score, KL, the update's averaged statistics, timings and throughput, the engine's distance from
the trainer's numerics, each reward's own score, the episodes' turns and tool calls -- each over
the whole batch of every process.  :class:`IterationMetrics` is the part of PPOTrainer these are; a
new metric enters here."""

from __future__ import annotations

import math

import torch

from ppo_rlhf.core import explained_variance, keep_masked, masked_mean, mismatch_statistics
from ppo_rlhf.distributed import gather_objects, sum_across_processes
from ppo_rlhf.rollout.episodes import Episodes
from ppo_rlhf.rollout.reward_base import averaged_logs
from ppo_rlhf.rollout.sequences import pad_columns
from ppo_rlhf.trainers.ppo_batch import Experience


def engine_gap(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """rollout/logprob_diff_mean and _max: |trainer's old log-prob - engine's| over the response tokens."""
    width = logprobs.shape[1]
    engine_logprobs = pad_columns(engine_logprobs.to(logprobs.device), width, 0.0)[:, :width]
    gap = keep_masked((logprobs - engine_logprobs).abs(), mask)
    return {"rollout/logprob_diff_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
            "rollout/logprob_diff_max": gap.max().item() if gap.numel() else 0.0}


def group_outcomes(scores: torch.Tensor, group_size: int) -> dict[str, float]:
    """How a batch's groups of ``group_size`` samples of one prompt (adjacent rows) can teach a
    group estimator, from their scores (B,): ``groups/zero_std``, the share whose samples all scored
    alike (a group baseline gives each advantage 0: TRL's ``frac_reward_zero_std``), and
    ``groups/one_best``, the share where one sample alone scored the group's best (with 0/1 rewards:
    one success among K, whose advantage carries the group's whole signal)."""
    groups = scores.detach().float().reshape(-1, group_size)
    best = groups.max(dim=1, keepdim=True).values
    alike = (groups == groups[:, :1]).all(dim=1)
    one_best = ((groups == best).sum(dim=1) == 1) & ~alike
    return {"groups/zero_std": alike.float().mean().item(), "groups/one_best": one_best.float().mean().item()}


TURNS_LOGGED = 6  # an episode's first turns each get their advantage statistics (turns/*)


def turn_advantages(advantages: torch.Tensor, mask: torch.Tensor, turn_ends: list[list[int | None]],
                    turns: int = TURNS_LOGGED) -> dict[str, float]:
    """How the update's credit falls on an episode's turns: for turn k (1..``turns``) of each
    episode that reached it, the mean advantage of its model tokens (positions after the previous
    turn's last model token, up to its own: ``turn_ends``, response indices), then averaged over those
    episodes -- ``turns/advantage_k`` -- with the mean |advantage| of those tokens (``turns/abs_advantage_k``)
    and the share of episodes that reached the turn (``turns/reached_k``).  A critic-free estimator
    gives each turn its episode's one advantage; a critic's GAE moves credit between turns."""
    sums = torch.zeros(turns, 3, dtype=torch.float64)  # per turn: sums of mean advantage, mean |advantage|; count
    masked = keep_masked(advantages, mask).double().cpu()
    owned = mask.bool().cpu()
    for row, ends in enumerate(turn_ends):
        start = 0
        for k, end in enumerate(ends[:turns]):
            if end is None:
                continue
            tokens = owned[row, start:end + 1]
            if tokens.any():
                values = masked[row, start:end + 1][tokens]
                sums[k] += torch.stack([values.mean(), values.abs().mean(), torch.ones((), dtype=torch.float64)])
            start = end + 1
    rows = max(len(turn_ends), 1)
    metrics = {}
    for k in range(turns):
        reached = sums[k, 2].item()
        if reached:
            metrics.update({f"turns/advantage_{k + 1}": sums[k, 0].item() / reached,
                            f"turns/abs_advantage_{k + 1}": sums[k, 1].item() / reached,
                            f"turns/reached_{k + 1}": reached / rows})
    return metrics


class IterationMetrics:
    """Stage 8 of PPOTrainer (module docstring)."""

    def iteration_metrics(self, experience: Experience, update_stats: dict[str, float], stage_metrics: dict,
                          kl_coef: float, entropy_coef: float, kl_per_response: float, old_logprobs_known: bool
                          ) -> dict[str, float]:
        """The iteration's metrics from its ``experience``, the update's statistics and the earlier
        stages' metrics and timings; ``old_logprobs_known``: False where the old log-probs were to be
        read off an update that was skipped (no engine gap to log)."""
        config = self.config
        timings = {k: v for k, v in stage_metrics.items() if k.startswith("time/")}
        # How far the engine's numerics are from the trainer's.
        if experience.engine_logprobs is not None and old_logprobs_known:
            stage_metrics.update(engine_gap(experience.logprobs, experience.engine_logprobs, experience.mask))
            stage_metrics.update(mismatch_statistics(experience.logprobs, experience.engine_logprobs, experience.mask,
                                                     config.is_correction, config.is_cap, config.is_floor))
        mask = experience.mask.float()
        total_time = sum(timings.values())
        n_response_tokens = mask.sum().item()
        n_tokens = n_response_tokens + experience.sequences.prompt_mask.sum().item()
        metrics = {
            "score": experience.raw_scores.mean().item(),
            "score_std": experience.raw_scores.std(unbiased=False).item(),
            "kl": kl_per_response,
            "kl_coef": kl_coef,
            # The KL's share of the reward (step 5's -kl_coef * kl): not rewards less the score, which
            # would count an episode's per-turn rewards in it too.
            "non_score_reward": (-kl_coef * experience.kl.sum(dim=1).mean().item()
                                 if config.kl_in == "reward" else 0.0),
            "response_length": mask.sum(dim=1).mean().item(),
            "advantages_mean": masked_mean(experience.advantages, experience.mask).item(),
            "returns_mean": masked_mean(experience.returns, experience.mask).item(),
            **update_stats,
            **timings,
            "time/iteration": total_time,
            "tokens_per_s": n_tokens / total_time,
            # (An asynchronous run's generation ran beside the trainer: the worker's own seconds.)
            "generated_tokens_per_s": stage_metrics.get("dynamic_sampling/generated_tokens", n_response_tokens)
                                      / stage_metrics.get("async/generate_seconds", timings["time/generate"]),
            # Dynamic sampling: its counts, and the score of the batch as drawn (the kept groups are
            # chosen for their spread, so their mean says less of how the policy does).
            **{k: v for k, v in stage_metrics.items() if not k.startswith("time/")},
        }
        metrics.update(self.episode_metrics(self.last_rollout.episodes))
        metrics.update(self.reward_counts())
        metrics.update(self.reward_logs())
        for name, part in self.reward_components.items():  # each reward as it came, before its weight
            scored = part[~torch.isnan(part)]  # the rows this reward applies to (None: not this one's)
            metrics[f"reward/{name}"] = scored.mean().item() if scored.numel() else math.nan
            metrics[f"reward/{name}_std"] = scored.std(unbiased=False).item() if scored.numel() else math.nan
        if config.entropy_coef != 0:
            metrics["entropy_coef"] = entropy_coef
        if experience.values is not None:
            metrics["explained_variance"] = explained_variance(experience.values, experience.returns,
                                                               experience.mask).item()
        if experience.greedy_scores is not None:
            metrics["greedy_score"] = experience.greedy_scores.mean().item()
        if (config.score_norm or config.score_clip is not None or config.missing_eos_penalty is not None
                or config.overlong_buffer is not None):
            metrics["score_used"] = experience.scores.mean().item()
        return metrics

    def reward_counts(self) -> dict[str, float]:
        """What the rewards counted this iteration (a judge's judge/unparsed), summed over the processes."""
        counts = self.reward.iteration_counts() if self.reward is not None else {}
        if not counts or self.processes == 1:
            return counts
        return dict(zip(counts, sum_across_processes(torch.tensor(list(counts.values()), dtype=torch.float64,
                                                                  device=self.device)).tolist()))

    def reward_logs(self) -> dict[str, float]:
        """What reward functions logged this iteration (TRL's ``log_metric``), each name averaged over
        every call of every process."""
        logged = self.reward.logged_metrics() if self.reward is not None else {}
        return averaged_logs(gather_objects([logged]) if self.processes > 1 else [logged])

    def episode_metrics(self, episodes: Episodes) -> dict[str, float]:
        """Per episode of the batch as drawn, over every process: turns, tokens (the model's and the
        environment's), the share cut by a limit, and tool calls, errors and timeouts (and what else
        the environments count, as env/<name>); nothing for single-turn rollouts."""
        if self.environments is None:
            return {}
        names = sorted(set(episodes.stats) | {"calls", "errors", "timeouts"})
        totals = torch.tensor([len(episodes.turns), sum(episodes.turns), episodes.sequences.response_mask.sum().item(),
                               sum(episodes.truncated), *(episodes.stats[name] for name in names)],
                              dtype=torch.float64, device=self.device)
        totals = sum_across_processes(totals).tolist() if self.processes > 1 else totals.tolist()
        count = max(totals[0], 1)
        metrics = {"episode/turns": totals[1] / count, "episode/tokens": totals[2] / count,
                   "episode/truncated": totals[3] / count}
        for name, total in zip(names, totals[4:]):
            metrics[f"tools/{name}" if name in ("calls", "errors", "timeouts") else f"env/{name}"] = total / count
        return metrics
