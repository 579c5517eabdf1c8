"""Stages 5-6 of a PPO iteration, rewards and advantages (docs/design.md, "One PPO iteration" and
"Advantage estimators"), on the whole batch gathered from every process, in every process alike:
the scores normalised and clipped (--score-norm, --score-clip), the per-token rewards shaped (the
KL penalty in the reward, an episode's per-turn rewards, a teacher's reward when distilling), then
GAE against the critic's values or a critic-free estimator's baseline, whitened.
:class:`AdvantageStage` is the part of PPOTrainer these are; a new reward shaping or estimator
enters here (its formula in core/ and trainers/estimators.py)."""

from __future__ import annotations

import torch

from ppo_rlhf.core import keep_masked, shaped_rewards, teacher_reverse_kl
from ppo_rlhf.distributed import gather_objects, gather_rows
from ppo_rlhf.rollout.sequences import pad_columns
from ppo_rlhf.trainers.estimators import advantages_and_returns, teacher_in_score
from ppo_rlhf.trainers.ppo_batch import Experience, Rollout
from ppo_rlhf.trainers.ppo_metrics import group_outcomes, turn_advantages


class AdvantageStage:
    """Stages 5-6 of PPOTrainer (module docstring)."""

    def experience(self, rollout: Rollout, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl: torch.Tensor,
                   values: torch.Tensor | None, teacher_logprobs: torch.Tensor | None, greedy: torch.Tensor | None,
                   greedy_unscored: torch.Tensor | None, metrics: dict[str, float]) -> Experience:
        """Stages 5-6: this process's ``rollout`` and its passes' (b, T) results (stages 1-4; ``greedy``:
        ReMax's greedy scores, ``greedy_unscored`` which of them no reward could score) gathered into
        the whole batch, its rewards shaped and its advantages and returns computed -- the
        :class:`Experience` the update trains on."""
        config = self.config
        # The whole batch, in every process (one process: these are the tensors themselves).
        sequences = self.gather_sequences(rollout.sequences)
        mask = sequences.loss_mask
        logprobs, ref_logprobs, values, kl, teacher_logprobs = (
            gather_rows(t) for t in (logprobs, ref_logprobs, values, kl, teacher_logprobs))
        engine_logprobs = gather_rows(rollout.episodes.engine_logprobs)
        raw_scores = gather_rows(rollout.raw_scores)
        unscored = gather_rows(rollout.unscored)  # (B,) no score known (a judge's unparsed answer)
        # An episode's per-turn rewards (--turn-rewards per-turn) go through the same --score-norm and --score-clip.
        scores, turn_rewards = self.normalise_scores(gather_rows(rollout.scores), gather_rows(rollout.turn_rewards),
                                                     scored=~unscored)
        greedy_scores = None
        if greedy is not None:  # ReMax: normalised as the sampled scores, without moving their statistics
            greedy_scores, _ = self.normalise_scores(gather_rows(greedy), update_moments=False)
            greedy_scores = greedy_scores.repeat_interleave(config.samples_per_prompt)
            # a greedy response with no score leaves its prompt's samples without a baseline
            unscored = unscored | gather_rows(greedy_unscored).repeat_interleave(config.samples_per_prompt)

        # 5. shaped rewards: the KL goes in the reward, or (kl_in: loss) into the update's loss
        # and the reward is the score alone; either way kl[t] is logged and drives the controller.
        # An episode's per-turn rewards (--turn-rewards per-turn) land on each turn's last token.
        kl_coef_in_reward = self.kl_controller.value if config.kl_in == "reward" else 0.0
        if teacher_logprobs is not None:  # distilling: the teacher's reward per token, or summed into the score
            # against the old log-probs; read off the update, they are not known yet: the sampler's instead
            student = logprobs if not self.old_logprobs_from_update else pad_columns(
                engine_logprobs.to(logprobs.device), logprobs.shape[1], 0.0)[:, :logprobs.shape[1]]
            scores, turn_rewards = self.add_teacher_rewards(student, teacher_logprobs, mask, scores, turn_rewards,
                                                            metrics)
        rewards = shaped_rewards(scores, kl, mask, kl_coef_in_reward, turn_rewards)

        # 6. advantages and returns: GAE against the critic, or the score less the estimator's baseline;
        # an unscored response gets advantage 0 and is in no baseline
        if values is not None:
            values = keep_masked(values, mask)
        advantages, returns = advantages_and_returns(config, rewards, values, scores, kl, mask, kl_coef_in_reward,
                                                     greedy_scores, turn_rewards, unscored)
        if rollout.filler is not None:  # dynamic sampling's filler groups keep the batch's size and teach nothing
            advantages = advantages.masked_fill(gather_rows(rollout.filler)[:, None], 0.0)
        if config.samples_per_prompt > 1 and len(raw_scores) % config.samples_per_prompt == 0:
            metrics.update(group_outcomes(raw_scores, config.samples_per_prompt))
        if self.environments is not None:  # episodes: where the credit falls, turn by turn
            # each process's episodes in rank order, as gather_rows joins their rows
            metrics.update(turn_advantages(advantages, mask, gather_objects(rollout.episodes.turn_ends)))
        return Experience(sequences, logprobs, ref_logprobs, values, kl, rewards, advantages, returns, scores,
                          raw_scores, greedy_scores, engine_logprobs)

    def normalise_scores(self, scores: torch.Tensor, turn_rewards: torch.Tensor | None = None,
                         update_moments: bool = True, scored: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole batch's scores (b,) and per-turn rewards (b, T) (--turn-rewards per-turn; None
        otherwise): --score-norm, running moments of each episode's whole return (its score and its
        turns' rewards; ``scored`` (b,): the rows that move them, not an unscored one's stand-in):
        the score less their mean, every reward over their std, so the normalised rewards of an
        episode sum to its normalised return; then --score-clip on each reward."""
        config = self.config
        if config.score_norm:
            returns = scores if turn_rewards is None else scores + turn_rewards.sum(dim=1)
            if update_moments and (scored is None or scored.any()):
                self.score_moments.update(returns if scored is None else returns[scored])
            scale = self.score_moments.std + 1e-8
            scores = (scores - self.score_moments.mean) / scale
            turn_rewards = None if turn_rewards is None else turn_rewards / scale
        if config.score_clip is not None:
            scores = scores.clamp(-config.score_clip, config.score_clip)
            turn_rewards = None if turn_rewards is None else turn_rewards.clamp(-config.score_clip, config.score_clip)
        return scores, turn_rewards

    def add_teacher_rewards(self, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                            scores: torch.Tensor, token_rewards: torch.Tensor | None, metrics: dict[str, float]
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On-policy distillation's reward, ``-teacher_coef * (log pi - log teacher)`` on each token the
        policy wrote, where the estimator takes it (docs/design.md, "On-policy distillation"): per
        token beside the other token rewards, as the KL penalty is (gae, reinforce++, remax), or
        summed over each response into its score before the group baseline (grpo, dr-grpo, rloo:
        their advantage is one number a response).  Returns (scores, token rewards); logs
        ``teacher/reverse_kl``, the KL summed over a response, averaged over the batch."""
        reverse_kl = teacher_reverse_kl(logprobs, teacher_logprobs, mask)  # (B, T)
        metrics["teacher/reverse_kl"] = reverse_kl.sum(dim=1).mean().item()
        if self.config.teacher_in == "loss":  # the update's loss holds the teacher's KL (PolicyUpdate.teacher_loss)
            return scores, token_rewards
        teacher_rewards = -self.config.teacher_coef * reverse_kl
        if teacher_in_score(self.config.estimator):
            return scores + teacher_rewards.sum(dim=1), token_rewards
        return scores, teacher_rewards if token_rewards is None else token_rewards + teacher_rewards
