"""What one PPO iteration's stages hand each other (docs/design.md, "One PPO iteration"): the
:class:`Rollout` of stages 1-2 (this process's episodes and their scores) and the
:class:`Experience` of stages 3-6 (the whole batch with everything the update needs)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ppo_rlhf.rollout.episodes import Episodes
from ppo_rlhf.rollout.sequences import Sequences, pad_columns


@dataclass
@dataclass
class Experience:
    """One scored rollout batch with everything the update needs; (B, T) aligned with the response."""

    sequences: Sequences
    logprobs: torch.Tensor  # (B, T) actor log-probs at rollout time
    ref_logprobs: torch.Tensor  # (B, T)
    values: torch.Tensor | None  # (B, T) critic at rollout time; None without a critic
    kl: torch.Tensor  # (B, T) per-token KL estimate
    rewards: torch.Tensor  # (B, T) shaped per-token rewards
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) reward of each response (after clipping / normalisation)
    raw_scores: torch.Tensor  # (B,) reward as the reward model / function gave it
    greedy_scores: torch.Tensor | None = None  # (B,) ReMax: score of the prompt's greedy response, as used
    engine_logprobs: torch.Tensor | None = None  # (B, T) the rollout engine's log-probs (vllm), for --is-correction

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) the tokens the model wrote: every loss, KL, entropy and value term reads this one."""
        return self.sequences.loss_mask

    def select(self, index: torch.Tensor) -> "Experience":
        tensors = [getattr(self, field.name) for field in dataclasses.fields(self)[1:]]
        return Experience(self.sequences.select(index), *(None if t is None else t[index] for t in tensors))


@dataclass
@dataclass
class Rollout:
    """Stages 1-2 on this process's rows: the episodes (one turn each without an environment) and
    their scores, before any batch-level arithmetic; (b,) and (b, T) row for row with ``rows``."""

    rows: list[dict]
    episodes: Episodes
    finished: torch.Tensor  # (b,) bool: the last model turn ended with a stop id
    raw_scores: torch.Tensor  # (b,) as the rewards gave them (the environment's included)
    scores: torch.Tensor  # (b,) each shaped on its own (missing EOS, overlong); what lands on the last token
    components: dict[str, torch.Tensor]  # name -> (b,) each reward's own scores, before its weight
    turn_rewards: torch.Tensor | None = None  # (b, T) --turn-rewards per-turn: step rewards on each turn's last token
    filler: torch.Tensor | None = None  # (b,) bool: a dropped group that fills a short batch (dynamic sampling)
    unscored: torch.Tensor | None = None  # (b,) bool: no score known (a judge's unparsed answer): teaches nothing

    @property
    def sequences(self) -> Sequences:
        return self.episodes.sequences

    def select(self, index: list[int]) -> "Rollout":
        tensor_index = torch.tensor(index, dtype=torch.long, device=self.scores.device)
        return Rollout([self.rows[i] for i in index], self.episodes.select(index), self.finished[tensor_index],
                       self.raw_scores[tensor_index], self.scores[tensor_index],
                       {name: part[tensor_index] for name, part in self.components.items()},
                       None if self.turn_rewards is None else self.turn_rewards[tensor_index],
                       None if self.filler is None else self.filler[tensor_index],
                       None if self.unscored is None else self.unscored[tensor_index])

    @staticmethod
    def concat(parts: list["Rollout"], pad_token_id: int) -> "Rollout":
        episodes = Episodes.concat([p.episodes for p in parts], pad_token_id)
        turn_rewards = None
        if parts[0].turn_rewards is not None:
            width = episodes.sequences.response_ids.shape[1]
            turn_rewards = torch.cat([pad_columns(p.turn_rewards, width, 0.0) for p in parts])
        filler = None
        if any(p.filler is not None for p in parts):
            filler = torch.cat([torch.zeros_like(p.finished) if p.filler is None else p.filler for p in parts])
        unscored = None
        if any(p.unscored is not None for p in parts):
            unscored = torch.cat([torch.zeros_like(p.finished) if p.unscored is None else p.unscored for p in parts])
        return Rollout([r for p in parts for r in p.rows], episodes, torch.cat([p.finished for p in parts]),
                       torch.cat([p.raw_scores for p in parts]), torch.cat([p.scores for p in parts]),
                       {name: torch.cat([p.components[name] for p in parts]) for name in parts[0].components},
                       turn_rewards, filler, unscored)
